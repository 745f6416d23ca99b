"""The KV cache the transformers engine decodes over: rows left-padded into one cache, caches
merged along the batch, and a cache layer that grows in place.

`hf_sampling` decides which rows share a cache (a `Cohort`) and when; this module holds what it
does to the tensors:
- `forward_whole`: a forward of left-padded rows' whole sequences, filling a fresh cache whose
  full-attention layers are `GrowingLayer`s; position ids come from the attention mask, so a
  left-padded row sees the same positions as unpadded;
- `concat_prefilled`: two caches (with their masks and next-token logits) as one, the narrower
  left-padded with zeros that the mask hides;
- `trim_front`: drop leading columns that are padding for every row (left by rows that finished);
- `GrowingLayer`: a decode step writes its token into spare room instead of copying the cache.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

Prefilled = tuple[torch.Tensor, DynamicCache, torch.Tensor]
"""Next-token logits, KV cache and attention mask of left-padded rows."""


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values are views of buffers with room to
    grow: a decode step writes its token in place, where `DynamicLayer` concatenates (a copy of
    the whole cache per layer and step, which made a row's copying quadratic in its length and
    cost the bench model ~40% of its decode time at a few hundred tokens). Anything that
    replaces `keys`/`values` (a merge, a row selection by the base class) is re-buffered at the
    next update; `trim_front` drops leading columns without a copy."""

    _keys_buf: torch.Tensor | None = None
    _values_buf: torch.Tensor | None = None
    _start = _end = 0  # the views' columns in the buffers

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            self.lazy_initialization(key_states, value_states)
            self._rebuffer(key_states[..., :0, :], value_states[..., :0, :], new)
        elif not self._views_current() or self._end + new > self._buffers()[0].shape[-2]:
            self._rebuffer(*_filled(self), new)
        keys_buf, values_buf = self._buffers()
        keys_buf[..., self._end : self._end + new, :] = key_states
        values_buf[..., self._end : self._end + new, :] = value_states
        self._end += new
        self.keys = keys_buf[..., self._start : self._end, :]
        self.values = values_buf[..., self._start : self._end, :]
        return self.keys, self.values

    def trim_front(self, columns: int) -> None:
        """Drop the first `columns` sequence columns (padding no row needs any more)."""
        if self._views_current():
            self._start += columns
        keys, values = _filled(self)
        self.keys, self.values = keys[..., columns:, :], values[..., columns:, :]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._views_current():  # select from the buffers, keeping their room
            keys_buf, values_buf = self._buffers()
            self._keys_buf, self._values_buf = keys_buf[indices], values_buf[indices]
            self.keys = self._keys_buf[..., self._start : self._end, :]
            self.values = self._values_buf[..., self._start : self._end, :]
        else:
            super().batch_select_indices(indices)

    def _views_current(self) -> bool:
        buf = self._keys_buf
        return (
            buf is not None
            and self.keys is not None
            and self.keys.shape[0] == buf.shape[0]
            and (
                self.keys.data_ptr() == buf[..., self._start :, :].data_ptr()
                and self.keys.shape[-2] == self._end - self._start
            )
        )

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers: `_rebuffer` makes both before any view into them."""
        assert self._keys_buf is not None and self._values_buf is not None
        return self._keys_buf, self._values_buf

    def _rebuffer(self, keys: torch.Tensor, values: torch.Tensor, adding: int) -> None:
        have = keys.shape[-2]
        room = have + adding + max(64, (have + adding) // 2)
        shape = (*keys.shape[:-2], room, keys.shape[-1])
        self._keys_buf = keys.new_empty(shape)
        self._values_buf = values.new_empty(shape)
        self._keys_buf[..., :have, :] = keys
        self._values_buf[..., :have, :] = values
        self._start, self._end = 0, have


def merges_caches(model: PreTrainedModel) -> bool:
    """Whether the model's caches can be padded and merged: only plain full-attention layers
    can (sliding windows and linear attention cannot; such models batch statically)."""
    probe = DynamicCache(config=model.config)
    return all(type(layer) is DynamicLayer for layer in probe.layers)


def forward_whole(
    model: PreTrainedModel, seq: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, DynamicCache]:
    """The next-token logits of every row after a forward of its whole sequence, and the cache
    that forward filled."""
    cache = DynamicCache(config=model.config)
    cache.layers = [GrowingLayer() if type(x) is DynamicLayer else x for x in cache.layers]
    out = model(
        input_ids=seq,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float(), cache


def left_padded(
    prompts: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and attention mask of `prompts`, each left-padded with `pad_id` to the longest."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    return ids.to(device), mask.to(device)


def concat_prefilled(a: Prefilled, b: Prefilled) -> Prefilled:
    """The rows of `a` then those of `b` (`a`'s cache object is reused): the narrower is
    left-padded with zeros that the mask hides."""
    (logits_a, cache_a, mask_a), (logits_b, cache_b, mask_b) = a, b
    width = max(mask_a.shape[1], mask_b.shape[1])
    for mine, theirs in zip(cache_a.layers, cache_b.layers, strict=True):
        assert isinstance(mine, DynamicLayer) and isinstance(theirs, DynamicLayer), "merges_caches"
        (keys_a, values_a), (keys_b, values_b) = _filled(mine), _filled(theirs)
        mine.keys = torch.cat([pad_left(keys_a, width), pad_left(keys_b, width)])
        mine.values = torch.cat([pad_left(values_a, width), pad_left(values_b, width)])
    mask = torch.cat([pad_left(mask_a, width), pad_left(mask_b, width)])
    return torch.cat([logits_a, logits_b]), cache_a, mask


def trim_front(cache: DynamicCache, columns: int) -> None:
    """Drop the first `columns` sequence columns of every layer (padding for every row)."""
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer):
            layer.trim_front(columns)
        else:
            assert isinstance(layer, CacheLayerMixin), "only attention layers trim (merges_caches)"
            keys, values = _filled(layer)
            layer.keys, layer.values = keys[..., columns:, :], values[..., columns:, :]


def _filled(layer: CacheLayerMixin) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of an attention layer a forward has filled (caches are merged and
    trimmed only after `forward_whole`)."""
    assert layer.keys is not None and layer.values is not None, "an empty cache layer"
    return layer.keys, layer.values


def pad_left(x: torch.Tensor, width: int) -> torch.Tensor:
    """`x` ([..., seq] masks, [batch, heads, seq, dim] keys and values) left-padded with zeros
    along the sequence to `width`."""
    seq_dim = 1 if x.dim() == 2 else -2
    missing = width - x.shape[seq_dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[seq_dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=seq_dim)
