"""FlexAttention on packed rows ("asyncrl_flex", CUDA): the attention of
`learner.packing.packed_attention` by PyTorch's FlexAttention under one block mask per forward
(`learner.packing.PackedRows.flex_block_mask`), compiled on CUDA. Its own module: the kernel
that runs packed rows on CUDA, beside the packing and the CPU kernel in `learner.packing`.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention
from transformers import AttentionInterface

from learner.packing import FLEX_ATTENTION, PackedRows, _maybe_compiled, refuse_unsupported


def flex_packed_attention(
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
    """The attention of `packed_attention` (same signature and result) by FlexAttention under
    `packed_rows.flex_block_mask()`: no dense mask, no gathered keys, and blocks that no query
    sees are skipped. Queries, keys and values are zero-padded to the mask's length and the
    pad's outputs dropped. Compiled on CUDA (the first call compiles; eager FlexAttention
    materializes the full score matrix); eager elsewhere, where it has no backward.
    Grouped-query attention is FlexAttention's `enable_gqa`. No dropout: FlexAttention has
    none, and a model that asks for it is refused."""
    if packed_rows is None:
        raise ValueError(
            f"attention {FLEX_ATTENTION!r} needs packed inputs (learner.packing.pack_rows); "
            "this model was set up for packed sequences"
        )
    if dropout:
        raise ValueError(f"attention {FLEX_ATTENTION!r} has no dropout (asked: {dropout})")
    refuse_unsupported(FLEX_ATTENTION, packed_rows, kwargs)
    mask = packed_rows.flex_block_mask()
    n, pad = query.shape[2], mask.shape[-1] - query.shape[2]
    if pad:
        query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
    out = _maybe_compiled(flex_attention, query.device)(
        query,
        key,
        value,
        block_mask=mask,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    out = cast(torch.Tensor, out)  # [1, heads, N + pad, dim]
    return out[:, :, :n].transpose(1, 2).contiguous(), None


def register_flex_attention() -> str:
    """Make `flex_packed_attention` available to transformers models as FLEX_ATTENTION."""
    AttentionInterface.register(FLEX_ATTENTION, flex_packed_attention)
    return FLEX_ATTENTION
