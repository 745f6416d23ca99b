"""FlexAttention on packed rows (`learner.flex_attention.flex_packed_attention`): the same outputs and
gradients as the per-segment SDPA and as padded per-row SDPA, its block mask built once per
forward, and the rule that picks a packed attention per device.

On CPU FlexAttention runs eager and torch refuses its backward there (the check is
`_validate_device`); the gradient tests lift that check to run torch's own eager backward, so
what they test is this module's padding, slicing, GQA and scaling around it. The compiled CUDA
kernels are tested by the `gpu` test at the end."""

from __future__ import annotations

import logging
import typing
import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import learner.packing as packing
from asyncrl.config import LearnerConfig
from learner.batch import TrainBatch
from learner.flex_attention import flex_packed_attention, register_flex_attention
from learner.fsdp import _log_choice, attention_implementation
from learner.packing import (
    FLASH_ATTENTION,
    FLEX_ATTENTION,
    FLEX_BLOCK,
    PACKED_ATTENTION,
    choose_packed_attention,
    pack_rows,
    packed_attention,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _quiet():
    """Eager FlexAttention warns that it is not compiled (the CPU tests mean it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


@pytest.fixture
def cpu_backward(monkeypatch):
    """Let torch's eager FlexAttention run its backward on CPU (refused by default)."""
    monkeypatch.setattr(torch.nn.attention.flex_attention, "_validate_device", lambda q, k, v: None)


def _batch(lengths, prompts, groups, width=None, vocab=50, seed=0):
    """Right-padded rows of random tokens, their prompt lengths and groups, and for each row
    the row whose prompt it shares: rows of a group with equal prompt lengths get the group's
    first such row's prompt."""
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=g)
    first: dict[tuple[int, int], int] = {}
    owners = []
    for i, (p, grp) in enumerate(zip(prompts, groups, strict=True)):
        owners.append(first.setdefault((grp, p), i))
        ids[i, :p] = ids[owners[-1], :p]
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask, torch.tensor(prompts), torch.tensor(groups), owners


# (lengths, prompt lengths, groups): rows of length 1, a prompt-only row (prompt >= length),
# a row without prompt; a batch whose N spans several blocks and is not a multiple of 128
CASES = {
    "small": ([7, 1, 5, 5, 3, 2, 6], [3, 1, 3, 3, 3, 2, 0], [0, 1, 0, 0, 0, 2, 3]),
    "blocks": ([90, 40, 130, 70, 1], [30, 30, 30, 12, 1], [0, 0, 0, 1, 2]),
}


def test_segments_by_hand():
    """Rows 0 and 1 share the prompt [1, 2]; row 2 is in their group with another prompt."""
    ids = torch.tensor([[1, 2, 5, 6], [1, 2, 7, 0], [1, 3, 8, 0]])
    mask = (ids > 0).long()
    p = pack_rows(ids, mask, torch.tensor([2, 2, 2]), torch.tensor([0, 0, 0]))
    # packed: [1 2 | 5 6] [7] [1 3 | 8]; segment 2r = row r's prompt, 2r + 1 its response
    assert p.segment_ids.tolist() == [0, 0, 1, 1, 3, 4, 4, 5]
    assert p.prefix_ids.tolist() == [-1, -1, 0, 0, 0, -1, -1, 4]
    q = pack_rows(ids, mask)  # unshared: one segment per row, no prefix
    assert q.segment_ids.tolist() == [1] * 4 + [3] * 3 + [5] * 3
    assert q.prefix_ids.tolist() == [-1] * 10


def test_block_mask_by_hand():
    """The dense form of the block mask of the layout above (padded to one block of 128)."""
    ids = torch.tensor([[1, 2, 5, 6], [1, 2, 7, 0], [1, 3, 8, 0]])
    p = pack_rows(ids, (ids > 0).long(), torch.tensor([2, 2, 2]), torch.tensor([0, 0, 0]))
    block = p.flex_block_mask()
    assert block.shape[-2:] == (FLEX_BLOCK, FLEX_BLOCK)
    dense = block.to_dense()  # [1, 1, 1, 1]: the one block is partly seen
    assert dense.tolist() == [[[[1]]]]
    q, k = torch.meshgrid(torch.arange(FLEX_BLOCK), torch.arange(FLEX_BLOCK), indexing="ij")
    seen = block.mask_mod(0, 0, q, k)
    want = torch.tensor(
        [  # keys: 1 2 5 6 7 1 3 8 (row 0's prompt, its response, row 1's, row 2's)
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 0],  # row 1's response sees the shared prompt, then itself
            [0, 0, 0, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1, 1, 1],
        ]
    ).bool()
    assert torch.equal(seen[:8, :8], want)
    assert not seen[:8, 8:].any() and not seen[8:, :8].any()  # pads and real tokens apart
    assert torch.equal(seen[8:, 8:], torch.ones(120, 120).tril().bool())  # pads: causal


def _qkv_rows(b, width, heads, kv_heads, dim, prompts, owners, seed=1):
    """Per-row q, k, v [b, heads, width, dim]; a row's prompt part equal to its owner's (as a
    model's would be: a causal prompt does not depend on what follows it)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, width, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    for i, (p, j) in enumerate(zip(prompts.tolist(), owners, strict=True)):
        for t in (q, k, v):
            t[i, :, :p] = t[j, :, :p]
    return q, k, v


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flex_equals_segment_sdpa_and_padded_rows(case, shared, kv_heads):
    """Outputs at every packed token equal those of padded per-row causal SDPA, and those of
    `packed_attention`, within 1e-5 in fp32; GQA and a non-default scale included."""
    lengths, prompts, groups = CASES[case]
    ids, mask, prompt_lengths, group_index, owners = _batch(lengths, prompts, groups)
    p = pack_rows(ids, mask, prompt_lengths, group_index) if shared else pack_rows(ids, mask)
    n = p.input_ids.shape[1]
    assert n % FLEX_BLOCK  # the pad path is exercised
    q_rows, k_rows, v_rows = _qkv_rows(
        len(lengths), ids.shape[1], 4, kv_heads, 8, prompt_lengths, owners
    )
    row, col = p.segment_ids // 2, p.position_ids[0]  # each packed token's row and column
    q, k, v = (t[row, :, col].transpose(0, 1)[None] for t in (q_rows, k_rows, v_rows))
    scale = 0.3
    flex = flex_packed_attention(None, q, k, v, None, scaling=scale, packed_rows=p)[0]
    segments = packed_attention(None, q, k, v, None, scaling=scale, packed_rows=p)[0]
    padded = F.scaled_dot_product_attention(
        q_rows, k_rows, v_rows, is_causal=True, scale=scale, enable_gqa=kv_heads != 4
    )  # [b, heads, width, dim]; right padding does not reach real tokens under a causal mask
    assert flex.shape == (1, n, 4, 8)
    torch.testing.assert_close(flex[0], padded[row, :, col], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex, segments, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flex_gradients_equal_segment_sdpa(kv_heads, cpu_backward):
    """d(loss)/d(q, k, v) of the flex path equal the per-segment SDPA's within 1e-5 (shared
    prompts, several blocks, a pad)."""
    lengths, prompts, groups = CASES["blocks"]
    ids, mask, prompt_lengths, group_index, owners = _batch(lengths, prompts, groups)
    p = pack_rows(ids, mask, prompt_lengths, group_index)
    n = p.input_ids.shape[1]
    g = torch.Generator().manual_seed(2)
    inputs = [torch.randn(1, h, n, 8, generator=g) for h in (4, kv_heads, kv_heads)]
    weight = torch.randn(1, n, 4, 8, generator=g)
    grads = {}
    for attention in (flex_packed_attention, packed_attention):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = attention(None, *leaves, None, scaling=0.25, packed_rows=p)[0]
        (out * weight).sum().backward()
        grads[attention] = [t.grad for t in leaves]
    for got, want in zip(grads[flex_packed_attention], grads[packed_attention], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_no_pad_when_n_is_a_multiple_of_the_block():
    ids, mask, *_ = _batch([100, 28], [0, 0], [0, 1])
    p = pack_rows(ids, mask)
    assert p.input_ids.shape[1] == FLEX_BLOCK and p.flex_block_mask().shape[-1] == FLEX_BLOCK
    q, k, v = (torch.randn(1, 2, FLEX_BLOCK, 8) for _ in range(3))
    got = flex_packed_attention(None, q, k, v, None, packed_rows=p)[0]
    torch.testing.assert_close(got, packed_attention(None, q, k, v, None, packed_rows=p)[0])


def test_flex_refuses_dropout_and_unpacked_inputs():
    ids, mask, *_ = _batch([3], [0], [0])
    p = pack_rows(ids, mask)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="no dropout"):
        flex_packed_attention(None, q, q, q, None, dropout=0.1, packed_rows=p)
    with pytest.raises(ValueError, match="needs packed inputs"):
        flex_packed_attention(None, q, q, q, None)


def _tiny_llama(attention: str, kv_heads: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        pad_token_id=0,
    )
    config._attn_implementation = attention
    return LlamaForCausalLM(config)


def _train_batch(case: str) -> TrainBatch:
    lengths, prompts, groups = CASES[case]
    ids, mask, prompt_lengths, group_index, owners = _batch(lengths, prompts, groups)
    z = torch.zeros(ids.shape)
    rows = torch.zeros(len(lengths))
    return TrainBatch(ids, mask, z, z, z.long(), rows, group_index, rows, prompt_lengths)


@pytest.mark.parametrize(("layout", "case"), [("shared", "blocks"), ("packed", "small")])
def test_policy_forward_with_flex_equals_padded(layout, case, cpu_backward):
    """A tiny Llama with the flex attention gives the padded model's log-probs (1e-5, fp32)
    through `policy_forward`, and the same parameter gradients of a weighted log-prob sum."""
    from learner.forward import policy_forward

    padded, flex = _tiny_llama("sdpa"), _tiny_llama(register_flex_attention())
    flex.load_state_dict(padded.state_dict())
    mb = _train_batch(case)
    target = mb.attention_mask[:, 1:].bool()
    weight = torch.randn(target.shape, generator=torch.Generator().manual_seed(3)) * target
    logps, grads = {}, {}
    for name, model, how in ((0, padded, "padded"), (1, flex, layout)):
        logp, _ = policy_forward(model, mb, 0.7, False, how)
        (logp * weight).sum().backward()
        logps[name] = logp
        grads[name] = {n: t.grad for n, t in model.named_parameters()}
    torch.testing.assert_close(logps[1][target], logps[0][target], atol=1e-5, rtol=1e-5)
    for n, want in grads[0].items():
        torch.testing.assert_close(grads[1][n], want, atol=1e-5, rtol=1e-5, msg=n)


def test_block_mask_is_built_once_per_forward(monkeypatch):
    """Every layer (and a checkpointed layer's recompute) reuses the PackedRows' mask."""
    built = []
    make = packing._document_block_mask
    monkeypatch.setattr(packing, "_document_block_mask", lambda s, p: built.append(1) or make(s, p))
    model = _tiny_llama(register_flex_attention())
    ids, mask, prompts, groups, _ = _batch(*CASES["small"])
    p = pack_rows(ids, mask, prompts, groups)
    with torch.no_grad():
        model(input_ids=p.input_ids, position_ids=p.position_ids, **p.attention_kwargs())
    assert len(built) == 1 and p.flex_block_mask() is p.flex_block_mask()


def test_block_mask_is_built_once_under_fsdp_mixed_precision(tmp_path, monkeypatch, cpu_backward):
    """FSDP's bf16 policy copies the PackedRows at every sharded layer, and activation
    checkpointing reruns each layer in the backward: still one mask for the whole step."""
    import os

    import torch.distributed as dist

    from asyncrl.wire.sockets import free_port
    from learner.fsdp import setup_model

    _tiny_llama("sdpa").save_pretrained(tmp_path)
    built = []
    make = packing._document_block_mask
    monkeypatch.setattr(packing, "_document_block_mask", lambda s, p: built.append(1) or make(s, p))
    monkeypatch.setitem(os.environ, "MASTER_ADDR", "127.0.0.1")
    monkeypatch.setitem(os.environ, "MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        lc = LearnerConfig(
            dtype="bfloat16", activation_checkpointing=True, packed_attention=FLEX_ATTENTION
        )
        model = setup_model(str(tmp_path), torch.device("cpu"), lc)
        ids, mask, prompts, groups, _ = _batch(*CASES["small"])
        p = pack_rows(ids, mask, prompts, groups)
        out = model(input_ids=p.input_ids, position_ids=p.position_ids, **p.attention_kwargs())
        out.logits.float().sum().backward()
        assert len(built) == 1
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("device", "dtype", "share", "flash", "want"),
    [
        ("cpu", "float32", True, False, PACKED_ATTENTION),
        ("cpu", "bfloat16", False, True, PACKED_ATTENTION),
        ("cuda", "bfloat16", True, False, FLEX_ATTENTION),
        ("cuda", "bfloat16", True, True, FLEX_ATTENTION),  # sharing outweighs flash's kernel
        ("cuda", "bfloat16", False, True, FLASH_ATTENTION),
        ("cuda", "bfloat16", False, False, FLEX_ATTENTION),
        ("cuda", "float32", False, True, FLEX_ATTENTION),  # flash-attn has no fp32 kernel
    ],
)
def test_choice_rule(device, dtype, share, flash, want):
    assert choose_packed_attention(device, dtype, share, flash)[0] == want


def test_forcing_a_packed_attention():
    assert choose_packed_attention("cpu", "float32", True, False, FLEX_ATTENTION)[0] == (
        FLEX_ATTENTION
    )
    with pytest.raises(ValueError, match="needs CUDA"):
        choose_packed_attention("cpu", "bfloat16", False, True, FLASH_ATTENTION)
    with pytest.raises(ValueError, match="expected"):
        choose_packed_attention("cuda", "bfloat16", False, True, "sdpa")


def test_the_config_key_names_every_kernel_the_rule_accepts():
    """`learner.packed_attention` offers exactly `choose_packed_attention`'s names plus auto."""
    offered = typing.get_args(LearnerConfig.model_fields["packed_attention"].annotation)
    assert set(offered) == {"auto", PACKED_ATTENTION, FLEX_ATTENTION, FLASH_ATTENTION}
    for name in offered[1:]:  # each is one the rule takes (flash only where it can run)
        assert choose_packed_attention("cuda", "bfloat16", False, True, name)[0] == name
    with pytest.raises(ValueError, match="packed_attention"):
        LearnerConfig(packed_attention="sdpa")


def test_the_choice_is_logged_once_and_sets_the_layout(caplog):
    from learner.forward import layout_of

    _log_choice.cache_clear()
    cpu, lc = torch.device("cpu"), LearnerConfig()
    with caplog.at_level(logging.INFO, logger="asyncrl.learner"):
        assert attention_implementation(lc, cpu) == PACKED_ATTENTION
        assert layout_of(lc, cpu) == "shared"
        forced = lc.model_copy(update={"packed_attention": FLEX_ATTENTION})
        assert attention_implementation(forced, cpu) == FLEX_ATTENTION
        assert layout_of(forced, cpu) == "shared"
        assert layout_of(forced.model_copy(update={"share_prompts": False}), cpu) == "packed"
    said = [r.getMessage() for r in caplog.records if "packed attention" in r.getMessage()]
    assert said == [
        f"packed attention on cpu: {PACKED_ATTENTION}, per-segment SDPA "
        "(FlexAttention has no backward on CPU)",
        f"packed attention on cpu: {FLEX_ATTENTION}, forced",
    ]


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_flex_on_cuda_equals_segment_sdpa(dtype):
    """The compiled CUDA kernels (forward and backward) against the per-segment SDPA, on
    three packed rows of different lengths (recompiles with new shapes included). fp32: within
    1e-5 (TF32 off, torch's default). bf16: the max difference is printed, and must be no
    larger than twice the SDPA path's own bf16 error against fp32 (plus 1e-2)."""
    cuda = torch.device("cuda")
    for seed, case in enumerate(["small", "blocks", "blocks"]):
        lengths, prompts, groups = CASES[case]
        lengths = [x * (seed + 1) for x in lengths]  # a new N each time
        ids, mask, prompt_lengths, group_index, owners = _batch(lengths, prompts, groups, seed=seed)
        p = pack_rows(ids.to(cuda), mask.to(cuda), prompt_lengths, group_index.to(cuda))
        n = p.input_ids.shape[1]
        g = torch.Generator(device=cuda).manual_seed(seed)
        base = [torch.randn(1, h, n, 64, device=cuda, generator=g) for h in (8, 2, 2)]
        weight = torch.randn(1, n, 8, 64, device=cuda, generator=g)
        results = {}
        for attention, dt in (
            (flex_packed_attention, dtype),
            (packed_attention, dtype),
            (packed_attention, torch.float32),
        ):
            leaves = [t.to(dt).clone().requires_grad_() for t in base]
            out = attention(None, *leaves, None, scaling=0.125, packed_rows=p)[0]
            (out.float() * weight).sum().backward()
            results[attention, dt] = [out.float()] + [t.grad.float() for t in leaves]
        flex, sdpa, exact = (
            results[flex_packed_attention, dtype],
            results[packed_attention, dtype],
            results[packed_attention, torch.float32],
        )
        for name, a, b, e in zip(["out", "dq", "dk", "dv"], flex, sdpa, exact, strict=True):
            if dtype == torch.float32:
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
                continue
            flex_err, sdpa_err = (a - e).abs().max().item(), (b - e).abs().max().item()
            print(f"bf16 N={n} {name}: flex {flex_err:.3e}, sdpa {sdpa_err:.3e} (vs fp32)")
            assert flex_err <= 2 * sdpa_err + 1e-2, name


@pytest.mark.parametrize("attention", [packed_attention, flex_packed_attention])
def test_attention_the_kernels_do_not_compute_is_refused(attention):
    """Logit soft-capping and a sliding window shorter than a row would silently compute
    other numbers than the model's: refused by name. A window longer than every row is exact."""
    ids, mask, prompts, groups, _ = _batch(*CASES["small"])
    rows = pack_rows(ids, mask, prompts, groups)
    q = torch.randn(1, 2, rows.input_ids.shape[1], 8)
    with pytest.raises(ValueError, match="soft-capping"):
        attention(None, q, q, q, None, packed_rows=rows, softcap=30.0)
    with pytest.raises(ValueError, match="sliding window: a row of 7 tokens exceeds"):
        attention(None, q, q, q, None, packed_rows=rows, sliding_window=4)
    out, _ = attention(None, q, q, q, None, packed_rows=rows, sliding_window=4096, softcap=None)
    assert out.shape == (1, q.shape[2], 2, 8)
