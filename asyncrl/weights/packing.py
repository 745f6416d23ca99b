"""Bucket packing on learner rank 0 (`asyncrl.weights.sync`, step 2): how one layout of versions
is cut into buckets and laid out in a slot (`Plan`), and how a bucket's full tensors are copied
into the flat buffer a wire member is sent (`StagingBuffers`, `pack`) or into a staged member's
slot (`copy_into`), each cast to its spec's dtype (the engine's) in the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.weights.layout import Bucket, ParamSpec, layout_hash, plan_buckets
from asyncrl.weights.transports import slot_offsets

BATCHED_BELOW = 1 << 20
"""Tensors smaller than this many bytes are copied into a slot by one batched kernel per bucket
(`copy_into`); larger ones one by one, at the device's copy speed."""


@dataclass(frozen=True)
class Plan:
    """How one layout of versions is sent (`make_plan`)."""

    specs: list[ParamSpec]
    digest: int  # `layout_hash(specs)`
    buckets: list[Bucket]  # `plan_buckets`
    offsets: list[int]  # each bucket's byte offset in a slot (`slot_offsets`)
    slot_bytes: int  # a slot's size


def make_plan(specs: list[ParamSpec], bucket_bytes: int) -> Plan:
    """The buckets of `specs` (at most `bucket_bytes` each, but for one larger tensor) and
    where they lie in a slot."""
    buckets = plan_buckets(specs, bucket_bytes)
    offsets, nbytes = slot_offsets(buckets)
    return Plan(specs, layout_hash(specs), buckets, offsets, nbytes)


class StagingBuffers:
    """Two flat buffers per dtype and device, made at the first version and reused for the
    whole run: a bucket is packed into one while the previous one is still on the wire, so
    packing overlaps sending and no version pays for fresh memory."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}

    def pair(self, buckets: list[Bucket], device: torch.device) -> dict[torch.dtype, list]:
        """The two buffers of each dtype on `device`, large enough for every bucket."""
        out = {}
        for dtype in {b.dtype for b in buckets}:
            need = max(b.numel for b in buckets if b.dtype == dtype)
            have = self._buffers.get((device, dtype))
            if have is None or have[0].numel() < need:
                have = [torch.empty(need, dtype=dtype, device=device) for _ in "ab"]
                self._buffers[(device, dtype)] = have
            out[dtype] = have
        return out


def pack(flat: torch.Tensor, bucket: Bucket, parts: list[torch.Tensor]) -> None:
    """Copy a bucket's tensors into its flat buffer, each cast to its spec's dtype."""
    offset = 0
    for spec, t in zip(bucket.params, parts, strict=True):
        flat[offset : offset + spec.numel].copy_(t.reshape(-1))
        offset += spec.numel


def copy_into(views: list[torch.Tensor], parts: list[torch.Tensor]) -> None:
    """Copy each of `parts` into its view (of a slot), cast to the view's dtype: the large ones
    one by one, the small ones (norms, biases, adapters) in one batched copy, so a GPU does not
    pay a kernel launch for each."""
    small_views, small_parts = [], []
    for view, part in zip(views, parts, strict=True):
        if part.numel() * part.element_size() >= BATCHED_BELOW:
            view.copy_(part)
        else:
            small_views.append(view)
            small_parts.append(part)
    if small_views:
        torch._foreach_copy_(small_views, small_parts)


def checked(spec: ParamSpec, t: torch.Tensor) -> torch.Tensor:
    """`t` if it can be sent as `spec` (same shape; same dtype, or both floating point)."""
    cast = t.is_floating_point() and spec.dtype.is_floating_point
    if tuple(t.shape) != spec.shape or (t.dtype != spec.dtype and not cast):
        raise ValueError(f"{spec.name}: got {tuple(t.shape)} {t.dtype}, planned {spec}")
    return t
