"""Sequence packing: a micro-batch's rows laid end to end in one row, no pad token computed.

Rows of a `TrainBatch` are right-padded to the batch's longest. Packing keeps only real tokens
(`attention_mask == 1`), restarts `position_ids` at 0 for every row, and makes attention stay
inside each row:
- on CPU (and on CUDA without flash-attn) by `packed_attention`, registered with transformers
  as the attention implementation "asyncrl_packed": rows of equal length are gathered into one
  [rows, heads, length, dim] batch and run through causal SDPA, so every row attends exactly
  to its own prefix (the same arithmetic as the padded forward, without the pad tokens);
- on CUDA with flash-attn installed by transformers' "flash_attention_2" on `cu_seq_lens_*`
  (flash-attn's varlen kernel). Not exercised on this project's CPU machines.

Outputs (log-probs, entropies, values) come back to the [b, T] target layout of
`learner.update` with `PackedRows.unpack`, 0 at positions past a row's end, so losses,
advantages and their aggregation are computed exactly as in the padded layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

PACKED_ATTENTION = "asyncrl_packed"
"""Name of `packed_attention` in transformers' AttentionInterface."""


@dataclass
class PackedRows:
    """b right-padded rows packed into one row of N = sum of their lengths tokens."""

    input_ids: torch.Tensor  # [1, N] the rows' real tokens end to end
    position_ids: torch.Tensor  # [1, N] 0, 1, ... within every row
    cu_seqlens: torch.Tensor  # int32 [b + 1] row starts in the packed row, then N
    max_len: int  # the longest row
    groups: list[torch.Tensor]  # per distinct length l: [rows of length l, l] packed positions
    order_inverse: torch.Tensor  # [N] undoes the concatenation of `groups`
    rows: torch.Tensor  # [M] for each target token: its row in the micro-batch
    cols: torch.Tensor  # [M] ... its column in the [b, T] target layout
    flat: torch.Tensor  # [M] ... the packed position whose output predicts it
    num_rows: int

    def attention_kwargs(self) -> dict:
        """Keyword arguments a transformers model passes down to its attention function."""
        return {
            "packed_rows": self,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_len,
            "max_length_k": self.max_len,
        }

    def targets(self) -> torch.Tensor:
        """[M] the token each target position predicts."""
        return self.input_ids[0, self.flat + 1]

    def unpack(self, values: torch.Tensor, width: int) -> torch.Tensor:
        """[M] per-target values -> [b, width] in the target layout, 0 past each row's end."""
        out = values.new_zeros(self.num_rows, width)
        out[self.rows, self.cols] = values
        return out


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """Pack right-padded rows ([b, L] ids and 0/1 mask; row i's real tokens are its first
    mask.sum() positions)."""
    keep = attention_mask.bool()
    lengths = keep.sum(1)
    if bool((lengths == 0).any()):
        raise ValueError("pack_rows: a row has no tokens")
    device = input_ids.device
    starts = torch.cumsum(lengths, 0) - lengths
    n = int(lengths.sum())
    packed_ids = input_ids[keep]
    position_ids = torch.arange(n, device=device) - torch.repeat_interleave(starts, lengths)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(lengths, 0)
    groups = []
    for length in torch.unique(lengths).tolist():
        which = torch.nonzero(lengths == length).squeeze(-1)
        groups.append(starts[which, None] + torch.arange(length, device=device))
    order = torch.cat([g.reshape(-1) for g in groups])
    rows, cols = torch.nonzero(keep[:, 1:], as_tuple=True)
    return PackedRows(
        input_ids=packed_ids[None],
        position_ids=position_ids[None],
        cu_seqlens=cu,
        max_len=int(lengths.max()),
        groups=groups,
        order_inverse=torch.argsort(order),
        rows=rows,
        cols=cols,
        flat=starts[rows] + cols,
        num_rows=len(lengths),
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

    Rows of one length run as one batched causal SDPA call; the outputs are put back in
    packed order with one gather. Grouped-query attention is SDPA's `enable_gqa`."""
    if packed_rows is None:
        raise ValueError(
            f"attention {PACKED_ATTENTION!r} needs packed inputs (learner.packing.pack_rows); "
            "this model was set up for packed sequences"
        )
    q, k, v = query[0], key[0], value[0]  # [heads, N, dim]
    gqa = k.shape[0] != q.shape[0]
    outs = []
    for index in packed_rows.groups:  # [rows, length]
        rows, length = index.shape
        take = _gather_rows(index.reshape(-1), rows, length)
        out = F.scaled_dot_product_attention(
            take(q),
            take(k),
            take(v),
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )  # [rows, heads, length, dim]
        outs.append(out.transpose(1, 2).reshape(rows * length, q.shape[0], q.shape[-1]))
    return torch.cat(outs)[packed_rows.order_inverse][None], None


def _gather_rows(flat: torch.Tensor, rows: int, length: int):
    """[heads, N, dim] -> [rows, heads, length, dim] at packed positions `flat`."""

    def take(t: torch.Tensor) -> torch.Tensor:
        return t[:, flat].reshape(t.shape[0], rows, length, t.shape[-1]).transpose(0, 1)

    return take


def register_packed_attention() -> str:
    """Make `packed_attention` available to transformers models as PACKED_ATTENTION."""
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    return PACKED_ATTENTION
