"""Packing: layout bookkeeping checked by hand, and packed forwards equal to padded ones."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from learner.packing import pack_rows, register_packed_attention


def _tiny_config(kv_heads: int = 4, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        pad_token_id=0,
    )


def _rows(lengths, width):
    ids = torch.arange(1, len(lengths) * width + 1).reshape(len(lengths), width)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def test_layout_by_hand():
    ids, mask = _rows([3, 1, 2], 3)
    p = pack_rows(ids, mask)
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 7, 8]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert p.cu_seqlens.tolist() == [0, 3, 4, 6] and p.max_len == 3
    # targets: row 0 predicts 2, 3 (cols 0, 1); row 1 none; row 2 predicts 8 (col 0)
    assert p.rows.tolist() == [0, 0, 2] and p.cols.tolist() == [0, 1, 0]
    assert p.targets().tolist() == [2, 3, 8]
    assert p.unpack(torch.tensor([1.0, 2.0, 3.0]), 2).tolist() == [[1, 2], [0, 0], [3, 0]]


def test_shared_prompt_layout_by_hand():
    """Rows 0 and 1 share the prompt [1, 2]; row 2 is in their group with another prompt."""
    ids = torch.tensor([[1, 2, 5, 6], [1, 2, 7, 0], [1, 3, 8, 0]])
    mask = (ids > 0).long()
    p = pack_rows(ids, mask, torch.tensor([2, 2, 2]), torch.tensor([0, 0, 0]))
    assert p.input_ids.tolist() == [[1, 2, 5, 6, 7, 1, 3, 8]]  # row 1's prompt is not copied
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2]]
    # row 1 (1 2 7): 1->2 and 2->7 are predicted at packed 0 and 1 (row 0's prompt copy)
    assert p.rows.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert p.flat.tolist() == [0, 1, 2, 0, 1, 5, 6]
    assert p.targets().tolist() == [2, 5, 6, 2, 7, 3, 8]
    shapes = sorted((q.shape[1], k.shape[1] - q.shape[1], q.shape[0]) for q, k in p.groups)
    # (length, prefix, count): two 2-token prompts; rows 1 and 2's responses (1 token after a
    # 2-token prefix); row 0's (2 tokens after a 2-token prefix)
    assert shapes == [(1, 2, 2), (2, 0, 2), (2, 2, 1)]


def test_an_empty_row_is_refused():
    ids, mask = _rows([2, 0], 2)
    with pytest.raises(ValueError, match="no tokens"):
        pack_rows(ids, mask)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_forward_equals_padded_forward(kv_heads):
    torch.manual_seed(0)
    config = _tiny_config(kv_heads)
    padded = LlamaForCausalLM(config)
    config_packed = LlamaConfig(
        **{**config.to_dict(), "_attn_implementation": register_packed_attention()}
    )
    packed = LlamaForCausalLM(config_packed)
    packed.load_state_dict(padded.state_dict())
    padded.config._attn_implementation = "sdpa"
    ids, mask = _rows([7, 2, 7, 5, 1, 6], 7)
    ids = ids % 50
    ids[3, :3] = ids[2, :3] = ids[0, :3]  # rows 0, 2, 3 share a 3-token prompt
    want = padded(input_ids=ids, attention_mask=mask).logits
    logp_want = want[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    keep = mask.bool()
    prompts, groups = torch.tensor([3, 1, 3, 3, 1, 2]), torch.tensor([0, 1, 0, 0, 2, 2])
    for shared in (False, True):
        p = pack_rows(ids, mask, prompts, groups) if shared else pack_rows(ids, mask)
        got = packed(
            input_ids=p.input_ids, position_ids=p.position_ids, **p.attention_kwargs()
        ).logits[0]
        assert p.input_ids.shape[1] == int(keep.sum()) - (6 if shared else 0)
        logp = p.unpack(got[p.flat].log_softmax(-1).gather(-1, p.targets()[:, None])[:, 0], 6)
        target = keep[:, 1:]
        torch.testing.assert_close(logp[target], logp_want[target], atol=1e-5, rtol=1e-5)
        if not shared:
            torch.testing.assert_close(got, want[keep], atol=1e-5, rtol=1e-5)


def test_activation_checkpointing_recomputes_layers_in_the_backward(tmp_path, monkeypatch):
    """learner.activation_checkpointing really engages: each decoder layer's forward runs
    again during the backward (and the gradient is unchanged)."""
    import os

    import torch.distributed as dist

    from asyncrl.config import LearnerConfig
    from asyncrl.wire.sockets import free_port
    from learner.fsdp import setup_model

    config = _tiny_config()
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    monkeypatch.setitem(os.environ, "MASTER_ADDR", "127.0.0.1")
    monkeypatch.setitem(os.environ, "MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        grads, calls = {}, {}
        for saver in (False, True):
            model = setup_model(
                str(tmp_path), torch.device("cpu"), LearnerConfig(activation_checkpointing=saver)
            )
            mlp = model.model.layers[0].mlp
            calls[saver] = 0
            mlp.forward = _counting(mlp.forward, calls, saver)  # (module hooks miss recomputes)
            ids, mask = _rows([6, 3], 6)
            p = pack_rows(ids % 50, mask)
            out = model(input_ids=p.input_ids, position_ids=p.position_ids, **p.attention_kwargs())
            out.logits.sum().backward()
            grad = model.lm_head.weight.grad
            grads[saver] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
        assert calls == {False: 1, True: 2}
        torch.testing.assert_close(grads[True], grads[False])
    finally:
        dist.destroy_process_group()


def _counting(forward, calls: dict, key):
    def counted(*args, **kwargs):
        calls[key] += 1
        return forward(*args, **kwargs)

    return counted


def test_entropy_carries_a_gradient_only_for_an_entropy_bonus():
    from learner.batch import TrainBatch
    from learner.forward import policy_forward

    config = _tiny_config(layers=1)
    model = LlamaForCausalLM(config)
    ids, mask = _rows([4, 3], 4)
    z = torch.zeros(2, 4)
    mb = TrainBatch(
        ids % 50, mask, z, z, z.long(), z[:, 0], torch.tensor([0, 1]), z[:, 0], mask[:, 0]
    )
    for bonus in (False, True):
        logp, entropy = policy_forward(model, mb, 1.0, True, "padded", entropy_grad=bonus)
        assert logp.requires_grad and entropy.requires_grad == bonus
