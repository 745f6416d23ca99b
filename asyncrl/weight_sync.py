"""Bucketed weight broadcast from learner rank 0 to every rollout server.

The sync group is a torch.distributed process group of its own: rank 0 is learner rank 0 and
rank i+1 is rollout server i (gloo on CPU, NCCL on CUDA). It is built from its own TCPStore
rather than `init_process_group`, because learner ranks already have a default group (the FSDP
one) and a process can hold only one default group. Its store and its gloo/NCCL sockets listen
on the sync host only (`asyncrl.binds`).

One sync, every collective in this order:
  1. a header, int64 [version, num_params, layout_hash, bucket_bytes, probe]; version -1 means
     shutdown;
  2. the buckets: flat tensors of one dtype each, in the order of `plan_buckets`;
  3. when the header's probe is 1, the delivery probe: float32 [PROBE_LEN], the
     learner's log-probs of `probe_ids` under this version, then the tolerance. The engine
     scores the same ids after applying the version and fails loudly when they differ
     (`rollout_servers.engines.base.check_delivery`): an engine that keeps sampling the old
     policy (an update applied to a copy, a stale adapter or cache) cannot go unnoticed.

Both sides derive the bucket plan from their own view of the model (names, shapes and dtypes in
state-dict order) and the header's bucket size; the layout hash makes a mismatch fail loudly
instead of loading garbage. A receiver assembles a whole version in staging memory before it
hands it to the engine, so a version is applied entirely or not at all. Staging memory is
allocated once and reused on both sides (the sender double-buffers so that packing a bucket
overlaps sending the previous one; a receiver reuses a version's staging once it is released).
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.binds import bind_collectives_to, setup_store

log = logging.getLogger("asyncrl.weight_sync")

SHUTDOWN = -1
PROBE_LEN = 16


def probe_ids(vocab_size: int) -> list[int]:
    """The fixed token ids both sides score for the delivery probe."""
    return [(7 * i + 3) % vocab_size for i in range(PROBE_LEN)]


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    params: tuple[ParamSpec, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


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


class SyncGroup:
    """The learner-rank-0 + servers process group (rank 0 hosts the rendezvous store)."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float = 3600.0,
    ):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.device = rank, world_size, device
        bind_collectives_to(host)
        self._store = setup_store(host, port, world_size, rank == 0, timeout)
        if device.type == "cuda":
            self._pg = dist.ProcessGroupNCCL(self._store, rank, world_size)
        else:
            self._pg = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` in place from rank 0."""
        self._pg.broadcast(tensor, 0).wait()

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work:
        """Start broadcasting `tensor` from rank 0; `.wait()` on the result before touching it."""
        return self._pg.broadcast(tensor, 0)


class WeightBroadcaster:
    """Learner rank 0's side: streams full tensors into buckets and broadcasts each.

    Two staging buffers per dtype live for the whole run (allocated at the first version): a
    bucket is packed into one while the previous one is still on the wire, so packing overlaps
    sending and no version pays for fresh memory. A bucket of one tensor (one larger than the
    bucket size, e.g. an embedding) already in the engine's dtype is sent as it is, uncopied."""

    def __init__(self, group: SyncGroup, bucket_bytes: int):
        self.group, self.bucket_bytes = group, bucket_bytes
        self._staging: dict[torch.dtype, list[torch.Tensor]] = {}

    def _buffers(self, buckets: list[Bucket]) -> dict[torch.dtype, list[torch.Tensor]]:
        for dtype in {b.dtype for b in buckets}:
            need = max(b.numel for b in buckets if b.dtype == dtype)
            have = self._staging.get(dtype)
            if have is None or have[0].numel() < need:
                device = self.group.device
                self._staging[dtype] = [torch.empty(need, dtype=dtype, device=device) for _ in "ab"]
        return self._staging

    def broadcast(
        self,
        specs: list[ParamSpec],
        tensors: Iterator[torch.Tensor],
        version: int,
        probe: torch.Tensor | None = None,
    ) -> None:
        """Send one version. `tensors` yields the full tensors in `specs` order (it may gather
        them lazily: one bucket's full tensors are alive at a time); a floating-point
        tensor is cast to its spec's dtype as it is packed (the engine's dtype, one pass).
        `probe`: the delivery probe (module docstring), sent after the weights."""
        header = torch.tensor(
            [version, len(specs), layout_hash(specs), self.bucket_bytes, probe is not None],
            dtype=torch.int64,
        )
        self.group.broadcast(header.to(self.group.device))
        buckets = plan_buckets(specs, self.bucket_bytes)
        staging = self._buffers(buckets)
        in_flight: dict[int, dist.Work] = {}  # id of a staging buffer -> its broadcast
        sent_whole: list[tuple[torch.Tensor, dist.Work]] = []
        for i, bucket in enumerate(buckets):
            parts = [_checked(spec, next(tensors)) for spec in bucket.params]
            if len(parts) == 1 and parts[0].dtype == bucket.dtype and parts[0].is_contiguous():
                sent_whole.append((parts[0], self.group.broadcast_async(parts[0].reshape(-1))))
                continue  # one tensor already as the engine wants it: sent uncopied
            buffer = staging[bucket.dtype][i % 2]
            if (work := in_flight.pop(id(buffer), None)) is not None:
                work.wait()
            flat, offset = buffer[: bucket.numel], 0
            for spec, t in zip(bucket.params, parts, strict=True):
                flat[offset : offset + spec.numel].copy_(t.reshape(-1))  # casts to spec.dtype
                offset += spec.numel
            in_flight[id(buffer)] = self.group.broadcast_async(flat)
        for work in [*in_flight.values(), *(w for _, w in sent_whole)]:
            work.wait()
        if probe is not None:
            self.group.broadcast(probe.detach().float().reshape(PROBE_LEN).to(self.group.device))

    def shutdown(self) -> None:
        """Tell every receiver that no more versions will come."""
        self.group.broadcast(
            torch.tensor([SHUTDOWN, 0, 0, 0, 0], dtype=torch.int64).to(self.group.device)
        )


def _checked(spec: ParamSpec, t: torch.Tensor) -> torch.Tensor:
    """`t` if it can be sent as `spec` (same shape; same dtype, or both floating point)."""
    cast = t.is_floating_point() and spec.dtype.is_floating_point
    if tuple(t.shape) != spec.shape or (t.dtype != spec.dtype and not cast):
        raise ValueError(f"{spec.name}: got {tuple(t.shape)} {t.dtype}, planned {spec}")
    return t


@dataclass
class ReceivedVersion:
    version: int
    buckets: list[list[tuple[str, torch.Tensor]]]
    """(name, tensor) pairs grouped as they were broadcast; the tensors are views of one flat
    staging buffer per bucket."""
    release: Callable[[], None] = lambda: None
    """Call once the weights are applied: the receiver may then reuse the staging memory for
    the next version (without it, the next version gets fresh memory)."""
    probe: torch.Tensor | None = None
    """The delivery probe: the learner's log-probs of `probe_ids`, then the tolerance."""

    @property
    def weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every (name, tensor) in state-dict order."""
        return [pair for bucket in self.buckets for pair in bucket]


class WeightReceiver:
    """A rollout server's side: receives one whole version into staging memory."""

    def __init__(self, group: SyncGroup, specs: list[ParamSpec]):
        self.group, self.specs = group, specs
        self._hash = layout_hash(specs)
        self._free: list[torch.Tensor] | None = None  # released staging, one buffer per bucket

    def receive(self) -> ReceivedVersion | None:
        """Block until the next version arrives; None when the learner shuts the group down."""
        header = torch.zeros(5, dtype=torch.int64, device=self.group.device)
        self.group.broadcast(header)
        version, num_params, digest, bucket_bytes, has_probe = (int(x) for x in header.cpu())
        if version == SHUTDOWN:
            return None
        if num_params != len(self.specs) or digest != self._hash:
            raise RuntimeError(
                f"weight layout mismatch at version {version}: learner sends {num_params} params "
                f"(hash {digest}), this engine has {len(self.specs)} (hash {self._hash}); "
                "learner and servers must load the same model architecture"
            )
        plan = plan_buckets(self.specs, bucket_bytes)
        staging, self._free = self._free, None
        if staging is None or [t.numel() for t in staging] != [b.numel for b in plan]:
            staging = [torch.empty(b.numel, dtype=b.dtype, device=self.group.device) for b in plan]
        buckets: list[list[tuple[str, torch.Tensor]]] = []
        for bucket, flat in zip(plan, staging, strict=True):
            self.group.broadcast(flat)
            offset, pairs = 0, []
            for spec in bucket.params:
                pairs.append((spec.name, flat[offset : offset + spec.numel].view(spec.shape)))
                offset += spec.numel
            buckets.append(pairs)
        probe = None
        if has_probe:
            probe = torch.zeros(PROBE_LEN, dtype=torch.float32, device=self.group.device)
            self.group.broadcast(probe)
        release = lambda: setattr(self, "_free", staging)  # noqa: E731
        return ReceivedVersion(version, buckets, release, probe)
