"""Sequence packing: a micro-batch's rows laid end to end in one row, no pad token computed.

Rows of a `TrainBatch` are right-padded to the batch's longest. Packing keeps only real tokens
(`attention_mask == 1`), gives every token its position within its own row, and makes
attention stay inside each row. Rows of a group with the same prompt (the n samples of a GRPO
group) may share ONE copy of it: the prompt is a segment of its own and each response attends
to it as a prefix, then causally to itself, which is exactly the attention each row would
compute alone (a causal prompt does not depend on what follows it). Three attention
implementations run packed rows (`learner.fsdp.attention_implementation` picks one per device):
- `packed_attention` ("asyncrl_packed", CPU): segments of one shape run as one batched SDPA
  call over gathered keys. Shares prompts. Exact.
- `learner.flex_attention.flex_packed_attention` ("asyncrl_flex", CUDA): PyTorch's
  FlexAttention, compiled, under
  one block mask per forward built from each token's segment and the prompt segment it sees
  (`PackedRows.flex_block_mask`); no [N, N] mask, no gathered keys. Shares prompts.
  FlexAttention has no backward on CPU (torch 2.13), so it trains on CUDA only.
- transformers' "flash_attention_2" on `cu_seq_lens_*` (flash-attn's varlen kernel, CUDA in
  bf16, when installed): one segment per row, no prompt sharing.

Outputs (log-probs, entropies, values) come back to the [b, T] target layout of
`learner.update` with `PackedRows.unpack`, 0 at positions past a row's end (a shared prompt's
outputs go to every row that shares it), so losses, advantages and their aggregation are
computed exactly as in the padded layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from transformers import AttentionInterface

PACKED_ATTENTION = "asyncrl_packed"
"""Name of `packed_attention` in transformers' AttentionInterface."""
FLEX_ATTENTION = "asyncrl_flex"
"""Name of `learner.flex_attention.flex_packed_attention` in transformers' AttentionInterface."""
FLASH_ATTENTION = "flash_attention_2"
"""transformers' flash-attn implementation (varlen on `cu_seq_lens_*`; no prompt sharing)."""
SHARING_ATTENTIONS = (PACKED_ATTENTION, FLEX_ATTENTION)
"""The implementations that run a shared prompt once for its whole group."""
FLEX_BLOCK = 128
"""FlexAttention's block size; a block mask covers the packed row padded to a multiple of it."""


class _MaskSlot:
    """Where a PackedRows keeps its block mask. FSDP's mixed precision rebuilds the dataclasses
    among a module's inputs (`dataclasses.replace`) at every sharded layer; the copies share
    this one slot, so the mask built by the first layer serves all of them."""

    def __init__(self) -> None:
        self.mask: BlockMask | None = None


@dataclass
class PackedRows:
    """b right-padded rows packed into one row of N tokens (their real tokens, less the prompt
    copies that sharing saves)."""

    input_ids: torch.Tensor  # [1, N] the rows' real tokens end to end
    position_ids: torch.Tensor  # [1, N] each token's position within its own row
    cu_seqlens: torch.Tensor | None  # int32 [b + 1] row starts then N (unshared packing only)
    max_len: int  # the longest row
    groups: list[tuple[torch.Tensor, torch.Tensor]]  # per segment shape: (queries, keys)
    order_inverse: torch.Tensor  # [N] undoes the concatenation of the groups' queries
    rows: torch.Tensor  # [M] for each target token: its row in the micro-batch
    cols: torch.Tensor  # [M] ... its column in the [b, T] target layout
    flat: torch.Tensor  # [M] ... the packed position whose output predicts it
    target_ids: torch.Tensor  # [M] ... the token itself
    num_rows: int
    segment_ids: torch.Tensor  # [N] each token's attention segment (a prompt, a response/row)
    prefix_ids: torch.Tensor  # [N] the segment a token also sees whole (its prompt), else -1
    flex_mask: _MaskSlot = field(default_factory=_MaskSlot, repr=False, compare=False)

    def flex_block_mask(self) -> BlockMask:
        """The block mask of `learner.flex_attention.flex_packed_attention`, built on the first
        call and kept: one per forward (a PackedRows lives for one forward), shared by every
        layer and by the recomputation of checkpointed layers. It covers the row padded to a multiple of
        FLEX_BLOCK; a pad token sees only pad tokens and no real token sees a pad token."""
        if self.flex_mask.mask is None:
            self.flex_mask.mask = _document_block_mask(self.segment_ids, self.prefix_ids)
        return self.flex_mask.mask

    def attention_kwargs(self) -> dict:
        """Keyword arguments a transformers model passes down to its attention function."""
        kwargs: dict = {"packed_rows": self}
        if self.cu_seqlens is not None:  # flash-attn varlen (one segment per row)
            kwargs.update(
                cu_seq_lens_q=self.cu_seqlens,
                cu_seq_lens_k=self.cu_seqlens,
                max_length_q=self.max_len,
                max_length_k=self.max_len,
            )
        return kwargs

    def targets(self) -> torch.Tensor:
        """[M] the token each target position predicts."""
        return self.target_ids

    def unpack(self, values: torch.Tensor, width: int) -> torch.Tensor:
        """[M] per-target values -> [b, width] in the target layout, 0 past each row's end."""
        out = values.new_zeros(self.num_rows, width)
        out[self.rows, self.cols] = values
        return out


def prompt_owners(
    input_ids: torch.Tensor, prompt_lengths: torch.Tensor, group_index: torch.Tensor
) -> torch.Tensor:
    """[b] for each row, the first row of its group with the same (non-empty) prompt tokens,
    itself when none comes before it: the row whose copy of the prompt it will share."""
    owners = list(range(len(prompt_lengths)))
    lengths = prompt_lengths.tolist()
    seen: dict[int, list[int]] = {}
    for i, g in enumerate(group_index.tolist()):
        p = lengths[i]
        for j in seen.setdefault(g, []):
            if p and p == lengths[j] and torch.equal(input_ids[i, :p], input_ids[j, :p]):
                owners[i] = j
                break
        else:
            seen[g].append(i)
    return torch.tensor(owners, device=input_ids.device)


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_lengths: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
) -> PackedRows:
    """Pack right-padded rows ([b, L] ids and 0/1 mask; row i's real tokens are its first
    mask.sum() positions). Given prompt lengths and groups, rows of a group with the same
    prompt share one copy of it; without them every row is one segment."""
    keep = attention_mask.bool()
    lengths = keep.sum(1)
    if bool((lengths == 0).any()):
        raise ValueError("pack_rows: a row has no tokens")
    device, b = input_ids.device, len(lengths)
    rows_ = torch.arange(b, device=device)
    share = prompt_lengths is not None and group_index is not None
    if prompt_lengths is not None and group_index is not None:  # i.e. share
        prompt = torch.minimum(prompt_lengths.to(device), lengths)
        owner = prompt_owners(input_ids, prompt, group_index)
    else:
        prompt, owner = torch.zeros_like(lengths), rows_
    owns = owner == rows_
    skip = torch.where(owns, 0, prompt)  # a sharing row's packed tokens start after its prompt
    emitted = lengths - skip
    starts = torch.cumsum(emitted, 0) - emitted
    n = int(emitted.sum())
    row_of = torch.repeat_interleave(rows_, emitted)
    col = torch.arange(n, device=device) - starts[row_of] + skip[row_of]
    prompt_start = starts[owner]
    response_start = torch.where(owns, starts + prompt, starts)
    # segment 2r: row r's own prompt copy (owners only); 2r + 1: row r's response (unshared:
    # the whole row); a response token also sees its owner's prompt segment whole
    in_prompt = col < prompt[row_of]
    segment_ids = 2 * row_of + (~in_prompt).long()
    sees_prompt = ~in_prompt & (prompt[row_of] > 0)
    prefix_ids = torch.where(sees_prompt, 2 * owner[row_of], -1)
    groups = _segments(prompt, lengths - prompt, owns, starts, response_start, prompt_start)
    rows, cols = torch.nonzero(keep[:, 1:], as_tuple=True)
    p = prompt[rows]
    flat = torch.where(cols < p, prompt_start[rows] + cols, response_start[rows] + cols - p)
    cu = None
    if not share:
        cu = torch.zeros(b + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(lengths, 0)
    order = torch.cat([queries.reshape(-1) for queries, _ in groups])
    return PackedRows(
        input_ids=input_ids[row_of, col][None],
        position_ids=col[None],
        cu_seqlens=cu,
        max_len=int(lengths.max()),
        groups=groups,
        order_inverse=torch.argsort(order),
        rows=rows,
        cols=cols,
        flat=flat,
        target_ids=input_ids[rows, cols + 1],
        num_rows=b,
        segment_ids=segment_ids,
        prefix_ids=prefix_ids,
    )


def _segments(prompt, response, owns, starts, response_start, prompt_start):
    """Attention segments grouped by shape: (queries [k, len], keys [k, prefix + len]) packed
    positions. An owner's prompt is a segment without prefix; a response attends to its
    (possibly shared) prompt as a prefix, then causally to itself."""
    by_shape: dict[tuple[int, int], list[tuple[int, int]]] = {}
    table = zip(
        prompt.tolist(),
        response.tolist(),
        owns.tolist(),
        starts.tolist(),
        response_start.tolist(),
        prompt_start.tolist(),
        strict=True,
    )
    for p, r, own, start, r_start, p_start in table:
        if own and p:
            by_shape.setdefault((p, 0), []).append((start, 0))
        if r:
            by_shape.setdefault((r, p), []).append((r_start, p_start))
    device = starts.device
    groups = []
    for (length, prefix), where in by_shape.items():
        q0 = torch.tensor([w[0] for w in where], device=device)[:, None]
        k0 = torch.tensor([w[1] for w in where], device=device)[:, None]
        queries = q0 + torch.arange(length, device=device)
        keys = torch.cat([k0 + torch.arange(prefix, device=device), queries], dim=1)
        groups.append((queries, keys))
    return groups


def refuse_unsupported(name: str, packed_rows: PackedRows, kwargs: dict) -> None:
    """ValueError when the model asks for attention these kernels do not compute: logit
    soft-capping (Gemma 2), or a sliding window shorter than a packed row (Mistral-style);
    computing full causal attention instead would give other numbers than the engine's."""
    if kwargs.get("softcap") is not None:
        raise ValueError(f"attention {name!r} has no logit soft-capping (the model asks for it)")
    window = kwargs.get("sliding_window")
    if window is not None and packed_rows.max_len > window:
        raise ValueError(
            f"attention {name!r} has no sliding window: a row of {packed_rows.max_len} tokens "
            f"exceeds the model's window of {window} (learner.packing=false runs it padded)"
        )


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_rows: PackedRows | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed row (transformers' attention-function signature:
    query [1, heads, N, dim], key/value [1, kv_heads, N, dim]; returns [1, N, heads, dim]).

    Segments of one shape run as one batched SDPA call: causal when a segment has no prefix,
    else under a lower-right causal mask over [prefix, segment] keys (a response sees its
    whole prompt and its own past). Outputs are put back in packed order with one gather.
    Grouped-query attention is SDPA's `enable_gqa`."""
    if packed_rows is None:
        raise ValueError(
            f"attention {PACKED_ATTENTION!r} needs packed inputs (learner.packing.pack_rows); "
            "this model was set up for packed sequences"
        )
    refuse_unsupported(PACKED_ATTENTION, packed_rows, kwargs)
    q, k, v = query[0], key[0], value[0]  # [heads, N, dim]
    gqa = k.shape[0] != q.shape[0]
    outs = []
    for queries, keys in packed_rows.groups:  # [rows, length], [rows, prefix + length]
        rows, length = queries.shape
        prefix = keys.shape[1] - length
        mask = None
        if prefix:
            i = torch.arange(length, device=q.device)[:, None]
            mask = torch.arange(prefix + length, device=q.device)[None] <= prefix + i
        out = F.scaled_dot_product_attention(
            _gather(q, queries),
            _gather(k, keys),
            _gather(v, keys),
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=not prefix,
            scale=scaling,
            enable_gqa=gqa,
        )  # [rows, heads, length, dim]
        outs.append(out.transpose(1, 2).reshape(rows * length, q.shape[0], q.shape[-1]))
    return torch.cat(outs)[packed_rows.order_inverse][None], None


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[heads, N, dim] at packed positions `index` [rows, len] -> [rows, heads, len, dim]."""
    rows, length = index.shape
    return t[:, index.reshape(-1)].reshape(t.shape[0], rows, length, t.shape[-1]).transpose(0, 1)


def choose_packed_attention(
    device_type: str,
    dtype: str,
    share_prompts: bool,
    flash_installed: bool,
    forced: str | None = None,
) -> tuple[str, str]:
    """(attention implementation for packed rows, why), the rule:
    - CUDA, bf16, flash-attn installed and prompts not shared: flash-attn's varlen kernel (the
      fastest kernel, but it cannot share a prompt);
    - other CUDA: FlexAttention (shares prompts: a group of n samples computes its prompt once
      in every layer instead of n times, which outweighs flash-attn's faster kernel; flash-attn
      has no fp32 kernel);
    - any other device: the per-segment SDPA (exact; FlexAttention has no backward on CPU).
    `forced` (one of the three names: `learner.packed_attention` when not auto) overrides the
    rule, for tests and benchmarks; flash-attn is refused where it cannot run."""
    if forced is not None:
        if forced not in (PACKED_ATTENTION, FLEX_ATTENTION, FLASH_ATTENTION):
            raise ValueError(
                f"packed attention {forced!r}: expected {PACKED_ATTENTION}, {FLEX_ATTENTION} "
                f"or {FLASH_ATTENTION}"
            )
        if forced == FLASH_ATTENTION and not (
            device_type == "cuda" and dtype == "bfloat16" and flash_installed
        ):
            raise ValueError(f"{FLASH_ATTENTION} needs CUDA, bfloat16 and flash-attn installed")
        return forced, "forced"
    if device_type != "cuda":
        return PACKED_ATTENTION, "per-segment SDPA (FlexAttention has no backward on CPU)"
    if dtype == "bfloat16" and flash_installed and not share_prompts:
        return FLASH_ATTENTION, "flash-attn varlen (installed, bf16, prompts not shared)"
    if share_prompts:
        why = "shares prompts"
    elif not flash_installed:
        why = "flash-attn not installed"
    else:
        why = "flash-attn has no fp32 kernel"
    return FLEX_ATTENTION, f"FlexAttention, compiled ({why})"


def register_packed_attention() -> str:
    """Make `packed_attention` available to transformers models as PACKED_ATTENTION."""
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    return PACKED_ATTENTION


def _document_block_mask(segment_ids: torch.Tensor, prefix_ids: torch.Tensor) -> BlockMask:
    """FlexAttention block mask over the packed row padded to a multiple of FLEX_BLOCK: query q
    sees key k when they are in one segment and k <= q, or when k is in q's prefix segment
    (the prompt its response shares). Pad tokens form a segment of their own (-2: no real
    token's segment or prefix), so every query, pad included, sees at least itself."""
    n = len(segment_ids)
    length = -(-n // FLEX_BLOCK) * FLEX_BLOCK
    segment = F.pad(segment_ids, (0, length - n), value=-2)
    prefix = F.pad(prefix_ids, (0, length - n), value=-1)

    def sees(b, h, q, k):
        return ((segment[q] == segment[k]) & (k <= q)) | (prefix[q] == segment[k])

    make = _maybe_compiled(create_block_mask, segment.device)
    return make(sees, None, None, length, length, device=segment.device, BLOCK_SIZE=FLEX_BLOCK)


def _maybe_compiled(fn, device: torch.device):
    """`fn` compiled (once per process) on CUDA, where FlexAttention's fused kernels and a
    block mask built without the dense [N, N] mask need torch.compile; `fn` itself elsewhere
    and inside a model that is being compiled already."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return fn
    return _compiled(fn)


@functools.cache
def _compiled(fn):
    return torch.compile(fn)
