"""Chunked log-probs (`learner.logprobs`) equal the full-logits path: values and gradients,
alone, through `policy_forward` on a tiny Llama (padded, packed, shared; tied head; LoRA),
in bf16, and on two FSDP2 ranks; heads that cannot be chunked take the full path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from learner.batch import TrainBatch
from learner.forward import full_logits_reason, policy_forward
from learner.logprobs import chunked_logprobs, default_chunk_tokens
from learner.losses import entropy_from_logits
from learner.packing import pack_rows, register_packed_attention

TOLERANCE = 1e-5


def _full(h, w, b, targets, temperature, entropy_grad):
    """Today's full path on the same inputs: float32 logits / T, log-softmax, entropy."""
    logits = F.linear(h, w, b).float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    return logp, entropy_from_logits(logits if entropy_grad else logits.detach())


def _head_inputs(m=20, hidden=16, vocab=37, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (m,), generator=g)
    upstream = torch.randn(2, m, generator=g)  # d loss / d logp, d loss / d entropy
    return h, w, b, targets, upstream


def _value_and_grads(fn, h, w, b, upstream, entropy_grad):
    for t in (h, w, b):
        t.grad = None
    logp, entropy = fn()
    loss = (upstream[0] * logp).sum()
    if entropy_grad:
        loss = loss + (upstream[1] * entropy).sum()
    loss.backward()
    return [logp.detach(), entropy.detach(), h.grad.clone(), w.grad.clone(), b.grad.clone()]


@pytest.mark.parametrize("chunk", [3, 7, 20, 64])  # 3, 7 do not divide 20; 64 > M
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_equals_full_values_and_gradients(chunk, temperature, entropy_grad):
    h, w, b, targets, upstream = _head_inputs()
    want = _value_and_grads(
        lambda: _full(h, w, b, targets, temperature, entropy_grad), h, w, b, upstream, entropy_grad
    )
    got = _value_and_grads(
        lambda: chunked_logprobs(h, w, b, targets, temperature, True, entropy_grad, chunk),
        h,
        w,
        b,
        upstream,
        entropy_grad,
    )
    for name, a, c in zip(
        ["logp", "entropy", "d_hidden", "d_weight", "d_bias"], want, got, strict=True
    ):
        torch.testing.assert_close(c, a, atol=TOLERANCE, rtol=TOLERANCE, msg=name)
    assert got[2].abs().max() > 0.01 and got[3].abs().max() > 0.01  # the backward did work


def test_entropy_is_a_detached_statistic_unless_asked():
    h, w, b, targets, _ = _head_inputs()
    _, entropy = chunked_logprobs(h, w, b, targets, 1.0, True, entropy_grad=False)
    assert entropy is not None and not entropy.requires_grad
    _, entropy = chunked_logprobs(h, w, b, targets, 1.0, True, entropy_grad=True)
    assert entropy is not None and entropy.requires_grad
    logp, entropy = chunked_logprobs(h, w, None, targets, 1.0, False)
    assert entropy is None and logp.requires_grad and logp.dtype == torch.float32


def test_entropy_gradient_by_hand():
    """d entropy / d logits = -p (z - sum p z), checked on one row of 3 logits by formula."""
    z = torch.tensor([[0.5, -1.0, 2.0]])
    w = torch.eye(3).requires_grad_()
    h = z.clone().requires_grad_()
    _, entropy = chunked_logprobs(h, w, None, torch.tensor([0]), 1.0, True, True)
    assert entropy is not None
    entropy.sum().backward()
    p = torch.softmax(z, -1)
    want_h = -p * (z - (p * z).sum())  # the head is the identity: d/dh = d/dz
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1))
    torch.testing.assert_close(h.grad, want_h)


def test_default_chunk_fills_its_byte_budget():
    assert default_chunk_tokens(128256) == 523  # 256 MiB of float32 logits
    assert default_chunk_tokens(2**40) == 1


def test_bf16_compute_stays_close_to_fp32_and_to_the_bf16_full_path():
    """bf16 weights and hidden states (what FSDP2's MixedPrecisionPolicy hands the head), and
    fp32 ones under autocast: the matmul runs in bf16, log-softmax in fp32, as the full path."""
    h, w, b, targets, upstream = _head_inputs(m=40, hidden=32, vocab=101)
    fp32 = _value_and_grads(
        lambda: chunked_logprobs(h, w, b, targets, 0.8, True, True, 16), h, w, b, upstream, True
    )
    h16, w16, b16 = (t.detach().bfloat16().requires_grad_() for t in (h, w, b))
    full16 = _value_and_grads(
        lambda: _full(h16, w16, b16, targets, 0.8, True), h16, w16, b16, upstream, True
    )
    got16 = _value_and_grads(
        lambda: chunked_logprobs(h16, w16, b16, targets, 0.8, True, True, 16),
        h16,
        w16,
        b16,
        upstream,
        True,
    )
    assert got16[0].dtype == torch.float32 and got16[3].dtype == torch.bfloat16
    for a, c, ref in zip(full16, got16, fp32, strict=True):
        scale = ref.abs().max()
        assert (c.float() - a.float()).abs().max() <= 0.02 * scale  # the bf16 full path
        assert (c.float() - ref).abs().max() <= 0.05 * scale  # and fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = _value_and_grads(
            lambda: chunked_logprobs(h, w, b, targets, 0.8, True, True, 16), h, w, b, upstream, True
        )
        auto_full = _value_and_grads(
            lambda: _full(h, w, b, targets, 0.8, True), h, w, b, upstream, True
        )
    assert auto[3].dtype == torch.float32  # the weight's gradient in the weight's dtype
    for a, c, ref in zip(auto_full, auto, fp32, strict=True):
        assert (c - a).abs().max() <= 0.02 * ref.abs().max()
    assert (auto[0] - fp32[0]).abs().max() > 1e-4  # autocast did compute in bf16


# ---- through policy_forward --------------------------------------------------------------
VOCAB = 61


def _tiny_llama(tied: bool = False, seed: int = 0, layout: str = "packed") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config)
    packed = register_packed_attention()
    model.config._attn_implementation = "sdpa" if layout == "padded" else packed
    return model


def _batch(seed: int = 1) -> TrainBatch:
    """Two groups of rows, rows 0-2 sharing a 3-token prompt, right-padded, lengths 2 to 9."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 5, 7, 2, 6])
    width = int(lengths.max())
    pos = torch.arange(width)[None]
    mask = (pos < lengths[:, None]).long()
    ids = torch.randint(1, VOCAB, (5, width), generator=g)
    ids[1:3, :3] = ids[0, :3]
    ids = ids * mask
    z = torch.zeros(5, width)
    prompts = torch.tensor([3, 3, 3, 1, 1])
    loss_mask = ((pos >= prompts[:, None]) & (mask > 0)).float()
    groups = torch.tensor([0, 0, 0, 1, 1])
    return TrainBatch(ids, mask, loss_mask, z, z.long(), z[:, 0], groups, z[:, 0], prompts)


def _policy_step(model, mb, layout, chunked, entropy_grad, chunk_tokens=4, temperature=0.8):
    """(logp, entropy at real targets, gradient of every trainable parameter) of a loss that
    weighs every target token differently."""
    model.zero_grad()
    logp, entropy = policy_forward(
        model, mb, temperature, True, layout, entropy_grad, chunked, chunk_tokens
    )
    assert entropy is not None
    real = mb.attention_mask[:, 1:] > 0
    weights = torch.linspace(-1.0, 1.0, real.numel()).reshape(real.shape) * real
    loss = (weights * logp).sum() + (0.5 * weights * entropy).sum() * entropy_grad
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logp[real].detach(), entropy[real].detach(), grads


def _assert_same(a, b, tolerance=TOLERANCE):
    torch.testing.assert_close(b[0], a[0], atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(b[1], a[1], atol=tolerance, rtol=tolerance)
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        torch.testing.assert_close(b[2][name], a[2][name], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_policy_forward_chunked_equals_full_logits(layout, tied, entropy_grad):
    model = _tiny_llama(tied, layout=layout)
    mb = _batch()
    full = _policy_step(model, mb, layout, False, entropy_grad)
    chunked = _policy_step(model, mb, layout, True, entropy_grad)
    _assert_same(full, chunked)
    assert full_logits_reason(model) is None
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert chunked[2][head].abs().max() > 1e-3


def test_padded_chunked_is_zero_past_a_rows_end():
    """As packed: no vocabulary softmax for a pad position; its output is 0."""
    mb = _batch()
    model = _tiny_llama(layout="padded")
    logp, entropy = policy_forward(model, mb, 1.0, True, "padded", chunk_tokens=4)
    assert entropy is not None
    pad = mb.attention_mask[:, 1:] == 0
    assert pad.any() and (logp[pad] == 0).all() and (entropy[pad] == 0).all()


def test_the_head_is_restored_and_a_no_grad_pass_works():
    """The reference model's and the recompute's pass (no autograd), then the head is the
    model's own again."""
    model = _tiny_llama(True)
    mb = _batch()
    with torch.no_grad():
        logp, _ = policy_forward(model, mb, 1.0, False, "packed", chunk_tokens=4)
        want, _ = policy_forward(model, mb, 1.0, False, "packed", chunked=False)
    torch.testing.assert_close(logp, want, atol=TOLERANCE, rtol=TOLERANCE)
    assert "forward" not in model.lm_head.__dict__
    p = pack_rows(mb.input_ids, mb.attention_mask)
    out = model(input_ids=p.input_ids, position_ids=p.position_ids, **p.attention_kwargs())
    assert out.logits.shape == (1, p.input_ids.shape[1], VOCAB)


def test_lora_policy_chunked_equals_full_logits():
    """Adapters on the decoder layers: the head is still a plain (frozen) Linear, chunked.
    Adapters on the head too: it is a LoRA layer, the full-logits path."""
    from asyncrl.config.learner import LoraConfig
    from learner.lora import add_adapters

    mb = _batch()
    for targets, chunkable in ((["q_proj", "v_proj"], True), (["q_proj", "lm_head"], False)):
        model = add_adapters(_tiny_llama(), LoraConfig(rank=4, alpha=8.0, target_modules=targets))
        with torch.no_grad():  # B starts at 0: move it, so the adapters change the output
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3)
        assert (full_logits_reason(model) is None) == chunkable
        full = _policy_step(model, mb, "packed", False, True)
        chunked = _policy_step(model, mb, "packed", True, True)
        _assert_same(full, chunked)
        assert all("lora_" in n for n in chunked[2])


def test_a_soft_capped_head_takes_the_full_logits_path():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=0.5,  # small: the cap changes every log-prob a lot
        pad_token_id=0,
    )
    model = Gemma2ForCausalLM(config)
    model.config._attn_implementation = "eager"
    assert "final_logit_softcapping" in (full_logits_reason(model) or "")
    mb = _batch()
    _assert_same(
        _policy_step(model, mb, "padded", False, True),
        _policy_step(model, mb, "padded", True, True),
    )


def test_a_model_that_changes_its_logits_unannounced_is_refused():
    """A forward that post-processes the head's output in a way `full_logits_reason` does not
    know would make the chunked log-probs wrong: it fails loudly instead."""

    class Scaled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    model = _tiny_llama()
    scaled = Scaled(model.config)
    with pytest.raises(RuntimeError, match="POSTPROCESSED_LOGITS"):
        policy_forward(scaled, _batch(), 1.0, False, "packed", chunk_tokens=4)
    assert "forward" not in scaled.lm_head.__dict__


# ---- two FSDP2 ranks ---------------------------------------------------------------------
def test_two_fsdp2_ranks_chunked_equals_full_logits(tmp_path):
    """Two gloo ranks shard a tied-head Llama with FSDP2 (learner.fsdp.setup_model: root params
    unsharded by the root's hooks, activation checkpointing); each rank's loss and every full
    gradient agree chunked and full in fp32, and closely in bf16 mixed precision; the
    reference model's no-grad pass too."""
    _tiny_llama(tied=True).save_pretrained(tmp_path / "model")
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", WORLD_SIZE="2")
    from asyncrl.wire.sockets import free_port

    env["MASTER_PORT"] = str(free_port())
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(tmp_path / "model"), str(tmp_path / f"r{r}.json")],
            env=env | {"RANK": str(r)},
        )
        for r in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    for r in range(2):
        report = json.loads((tmp_path / f"r{r}.json").read_text())
        assert report["float32"]["logp"] < TOLERANCE and report["float32"]["grad"] < TOLERANCE
        assert report["float32"]["grad_max"] > 1e-3
        assert report["bfloat16"]["logp"] < 0.05 and report["bfloat16"]["grad"] < 0.05
        assert report["reference"] < TOLERANCE


def _fsdp_rank(model_path: str, out: str) -> None:
    import torch.distributed as dist

    from asyncrl.config import LearnerConfig
    from learner.fsdp import setup_distributed, setup_model

    rank, _, device = setup_distributed("cpu")
    mb = _batch(seed=rank)
    report: dict = {}
    for dtype in ("float32", "bfloat16"):
        lc = LearnerConfig(packing=True, activation_checkpointing=True, dtype=dtype)
        steps = []
        for chunked in (False, True):
            model = setup_model(model_path, device, lc)
            logp, _, grads = _policy_step(model, mb, "shared", chunked, True)
            full = {n: g.full_tensor() for n, g in grads.items()}  # a collective: in step
            steps.append((logp, full))
        (a, ga), (b, gb) = steps
        report[dtype] = {
            "logp": float((a - b).abs().max()),
            "grad": max(float((ga[n] - gb[n]).abs().max()) for n in ga),
            "grad_max": max(float(g.abs().max()) for g in ga.values()),
        }
    ref = setup_model(model_path, device, LearnerConfig(packing=True), trainable=False)
    with torch.no_grad():
        a, _ = policy_forward(ref, mb, 0.8, False, "packed", chunked=False)
        b, _ = policy_forward(ref, mb, 0.8, False, "packed", chunk_tokens=3)
    report["reference"] = float((a - b).abs().max())
    Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    from asyncrl.launch.worker import exit_now

    _fsdp_rank(sys.argv[1], sys.argv[2])
    exit_now(0)  # as learner ranks: torch's process-group threads can abort teardown


# ---- the memory benchmark ----------------------------------------------------------------
@pytest.mark.long
def test_memory_benchmark_sees_the_float32_logits_go():
    """tools/bench_logprob_memory.py, one small case per path in fresh processes: the chunked
    path's extra peak is below the full path's by more than one float32 copy of the logits."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_logprob_memory", Path(__file__).parents[2] / "tools" / "bench_logprob_memory.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # logits large enough (256 MiB) that the full path's copies rise above the high-water
    # mark the imports left (ru_maxrss never falls): at 32 MiB both extra peaks read 0
    tokens, vocab = 2048, 32768
    budget = bench.available_bytes() - bench.MARGIN
    full = bench.measure("full", tokens, vocab, 64, 1, budget)
    chunked = bench.measure("chunked", tokens, vocab, 64, 1, budget)
    logits = full["targets"] * vocab * 4  # 256 MiB
    assert full["extra_peak"] - chunked["extra_peak"] > logits


def test_a_micro_batch_whose_logits_are_small_takes_the_full_path(monkeypatch):
    """By default (no chunk size asked for) the chunked path, which computes the head again in
    the backward, is taken only once the float32 logits outgrow WHOLE_LOGITS_MAX_BYTES; both
    give the same numbers."""
    import learner.forward as forward

    model, mb = _tiny_llama(), _batch()
    taken: list[str] = []
    real = forward.chunked_logprobs
    monkeypatch.setattr(
        forward, "chunked_logprobs", lambda *a, **k: taken.append("chunked") or real(*a, **k)
    )
    small, _ = policy_forward(model, mb, 1.0, False, "packed")
    assert taken == []
    monkeypatch.setattr(forward, "WHOLE_LOGITS_MAX_BYTES", 0)
    large, _ = policy_forward(model, mb, 1.0, False, "packed")
    assert taken == ["chunked"]
    torch.testing.assert_close(large, small, atol=TOLERANCE, rtol=TOLERANCE)
