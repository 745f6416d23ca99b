"""A model's weight layout as the weight sync sees it, and how a version is cut into buckets.

Both ends of the weight sync (`asyncrl.weights.sync`) derive the same bucket plan from their own
view of the model, names, shapes and dtypes in state-dict order (`specs_of`), and the bucket
size the learner's header names (`plan_buckets`); `layout_hash` makes a mismatch between the
two views fail loudly instead of loading garbage. `weights_checksum` lets a test or a run with
`learner.weight_checksum` compare the bytes on both sides.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSpec:
    """One tensor of a version, as both ends of the weight sync plan it."""

    name: str  # the tensor's name, in the learner's state-dict naming
    shape: tuple[int, ...]  # its full, unsharded shape
    dtype: torch.dtype  # the dtype it travels and is loaded in (the engine's)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors of one dtype, sent as one flat tensor (`plan_buckets`)."""

    dtype: torch.dtype  # the dtype of every tensor in it
    params: tuple[ParamSpec, ...]  # its tensors, in state-dict order

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


def tensor_views(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of each tensor of `bucket` in its flat tensor."""
    offset, pairs = 0, []
    for spec in bucket.params:
        pairs.append((spec.name, flat[offset : offset + spec.numel].view(spec.shape)))
        offset += spec.numel
    return pairs


def specs_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[ParamSpec]:
    """The layout of named tensors (full shapes, as the engine sees them)."""
    return [ParamSpec(n, tuple(t.shape), t.dtype) for n, t in named]


def plan_buckets(specs: list[ParamSpec], bucket_bytes: int) -> list[Bucket]:
    """Group consecutive params of one dtype into buckets of at most bucket_bytes (a larger
    param gets a bucket of its own)."""
    buckets: list[Bucket] = []
    current: list[ParamSpec] = []
    size = 0
    for spec in specs:
        nbytes = spec.numel * spec.dtype.itemsize
        if current and (spec.dtype != current[0].dtype or size + nbytes > bucket_bytes):
            buckets.append(Bucket(current[0].dtype, tuple(current)))
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current:
        buckets.append(Bucket(current[0].dtype, tuple(current)))
    return buckets


def layout_hash(specs: list[ParamSpec]) -> int:
    """A 31-bit digest of names, shapes and dtypes (fits the int64 header)."""
    text = ";".join(f"{s.name}:{list(s.shape)}:{s.dtype}" for s in specs)
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Digest of names and exact bytes; equal on both sides iff the weights are identical."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
