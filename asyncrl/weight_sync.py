"""Bucketed weight broadcast from learner rank 0 to every rollout server.

Each rollout server has a process group of its own with learner rank 0: rank 0 is the learner,
rank 1 the server (gloo on CPU, NCCL on CUDA). Every group is built on the one TCPStore that
learner rank 0 hosts on the sync port, under a `torch.distributed.PrefixStore` named for the
server and its epoch (`sync_prefix`: `server_3/epoch_1` is server 3's second start), so a
restarted server joins a fresh group without the others stopping, and a member that dies or
hangs fails only its own group (`learner.sync_fleet` keeps the members). These groups stand
apart from `init_process_group`, because learner ranks already have a default group (the FSDP
one) and a process can hold only one. The store and the gloo/NCCL sockets listen on the sync
host only (`asyncrl.binds`).

Joining (`join_sync_group`, a server's side): the server sets `ready` under its prefix and
waits for the learner's `answer`: `join`, after which both build the group, or `abandon` (the
learner stopped waiting for it), after which the server fails and must restart to try again.

One sync, every collective in this order, on each member's group:
  1. a header, int64 [version, num_params, layout_hash, bucket_bytes, probe]; version -1 means
     shutdown;
  2. the buckets: flat tensors of one dtype each, in the order of `plan_buckets`;
  3. when the header's probe is 1, the delivery probe (`asyncrl.delivery_probe`): the
     learner's log-probs of fixed ids under this version and their tolerance, in the one
     float32 [PROBE_LEN] of `DeliveryProbe.to_wire`; the receiver hands the engine the
     `DeliveryProbe` back, which it checks after applying the version;
  4. the acknowledgement: an all-reduce of one element, which completes on the learner only
     once the receiver holds the whole version (a send completes as soon as the bytes are in
     the kernel's buffers, so without it a stopped receiver would go unnoticed).
Learner rank 0 starts each collective on every member's group before it waits on any, so the
members receive concurrently. A member whose collective fails (its process died: the connection
is reset) or does not complete within its group's timeout (hung, SIGSTOPped) is aborted and left
out of the rest of the version; the others still get it.

Both sides derive the bucket plan from their own view of the model (names, shapes and dtypes in
state-dict order) and the header's bucket size; the layout hash makes a mismatch fail loudly
instead of loading garbage (`asyncrl.weight_layout`; its `specs_of` and `weights_checksum`, and
the probe's `probe_ids`, are importable from here too). A receiver assembles a whole version in
staging memory before it hands it to the engine, so a version is applied entirely or not at
all. Staging memory is allocated once and reused on both sides (the sender double-buffers so
that packing a bucket overlaps sending the previous one; a receiver reuses a version's staging
once it is released).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, cast, overload

import torch
import torch.distributed as dist

from asyncrl.binds import bind_collectives_to, setup_store
from asyncrl.delivery_probe import PROBE_LEN, DeliveryProbe
from asyncrl.delivery_probe import probe_ids as probe_ids
from asyncrl.weight_layout import Bucket, ParamSpec, layout_hash, plan_buckets
from asyncrl.weight_layout import specs_of as specs_of
from asyncrl.weight_layout import weights_checksum as weights_checksum

log = logging.getLogger("asyncrl.weight_sync")

SHUTDOWN = -1
GIVE_UP_POLL_S = 1.0
"""How often a waiting broadcast asks its owner which members to give up (`_Fanout`)."""
JOIN, ABANDON = b"join", b"abandon"
"""The learner's answer to a server epoch's `ready` (module docstring, joining)."""


def sync_prefix(server_id: int, epoch: int) -> str:
    """The store prefix of one server epoch's group with learner rank 0."""
    return f"server_{server_id}/epoch_{epoch}"


K = TypeVar("K", bound=Hashable)
"""How a broadcaster's owner keys its members (`learner.sync_fleet`: (server id, epoch))."""


class _Backend(Protocol):
    """The collectives of a gloo or NCCL backend used here (torch's stubs for its `Backend`
    omit `broadcast` and `allreduce`, which it has at runtime)."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work: ...
    def allreduce(self, tensor: torch.Tensor) -> dist.Work: ...
    def abort(self) -> None: ...
    def _set_default_timeout(self, timeout: datetime.timedelta) -> None: ...


class GaveUp(RuntimeError):
    """The broadcaster's owner gave up on a member it was waiting for (`_Fanout`)."""


class SyncGroup:
    """A weight-sync process group whose rank 0 is learner rank 0."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float = 3600.0,
        store: dist.Store | None = None,
    ):
        """`store`: rendezvous there (a server epoch's prefix of learner rank 0's store) instead
        of on a TCPStore of the group's own at host:port (rank 0 hosting it). `timeout_s`
        bounds the rendezvous and every collective (`wait`)."""
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.device = rank, world_size, device
        bind_collectives_to(host)
        if store is None:
            store = setup_store(host, port, world_size, rank == 0, self.timeout)
        self._store = store
        if device.type == "cuda":  # (not run here: no GPU)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            nccl = dist.ProcessGroupNCCL(store, rank, world_size, options)
            self._pg: _Backend = nccl  # type: ignore[assignment]  # stubs lack its collectives
        else:
            gloo = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
            self._pg = gloo  # type: ignore[assignment]  # (as above)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` in place from rank 0."""
        self.wait(self._pg.broadcast(tensor, 0))

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work:
        """Start broadcasting `tensor` from rank 0; `wait` on the result before touching it."""
        return self._pg.broadcast(tensor, 0)

    def ack_async(self) -> dist.Work:
        """Start the acknowledgement that ends a version (module docstring)."""
        return self._pg.allreduce(torch.ones(1, device=self.device))

    def wait(self, work: dist.Work) -> None:
        """Block until `work` completes; raises when it fails or takes longer than the timeout
        (on CUDA too: with a timeout, NCCL's wait blocks the calling thread)."""
        work.wait(self.timeout)

    def set_op_timeout(self, timeout_s: float) -> None:
        """From now on collectives may take `timeout_s` (the group was built with a shorter
        bound for connecting)."""
        self.timeout = datetime.timedelta(seconds=timeout_s)
        with contextlib.suppress(AttributeError, RuntimeError):  # a backend without it
            self._pg._set_default_timeout(self.timeout)

    def abort(self) -> None:
        """Close the group's connections: its collectives in flight fail, here and at the peer."""
        with contextlib.suppress(Exception):  # best effort: the group is being given up
            self._pg.abort()


def join_sync_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float = 3600.0,
    server_id: int | None = None,
    epoch: int = 0,
) -> SyncGroup:
    """A rollout server's side. With `server_id`: the 2-member group of this server epoch on
    learner rank 0's store (it joins as rank 1 of 2; module docstring, joining); it waits up
    to `timeout_s` for the learner's answer. Without: a group of its own at host:port, as
    `rank` of `world_size` (tests and benches pair it with a plain `SyncGroup`)."""
    if server_id is None:
        return SyncGroup(host, port, rank, world_size, device, timeout_s)
    timeout = datetime.timedelta(seconds=timeout_s)
    prefix = sync_prefix(server_id, epoch)
    store = dist.PrefixStore(prefix, dist.TCPStore(host, port, None, False, timeout))
    store.set("ready", "1")
    store.wait(["answer"])
    if store.get("answer") != JOIN:
        raise RuntimeError(
            f"the learner stopped waiting for {prefix} to join the weight sync before it "
            "connected; this server must restart (a new epoch) to receive weights"
        )
    log.info("joined the weight sync as %s", prefix)
    return SyncGroup(host, port, 1, 2, device, timeout_s, store=store)


@dataclass
class _Fanout(Generic[K]):
    """One version's collectives on every member's group at once. A member whose collective
    fails or times out is aborted and left out of the rest of the version (`failed`).

    With `give_up` (member -> reason, of the members to stop waiting for: asked at most every
    `GIVE_UP_POLL_S`, and only while a wait lasts that long), a wait polls its collective
    instead of blocking, so that a member the owner knows to be frozen stops holding the
    version at once rather than at the op timeout. Its group is aborted, but gloo cannot cancel
    collectives in flight (NCCL can), and a gloo group destroyed with pending collectives
    blocks until they end; so the group and its collectives go to `abandoned`, to be let go
    once they have ended (they fail when the peer dies, or at their timeout)."""

    live: dict[K, SyncGroup]
    give_up: Callable[[], dict[K, str]] | None = None
    failed: dict[K, BaseException] = field(default_factory=dict)
    abandoned: list[tuple[SyncGroup, list[dist.Work]]] = field(default_factory=list)
    _works: dict[K, list[dist.Work]] = field(default_factory=dict)
    _given_up: dict[K, str] = field(default_factory=dict)

    def start(self, op: Callable[[SyncGroup], dist.Work]) -> list[tuple[K, dist.Work]]:
        started: list[tuple[K, dist.Work]] = []
        for key, group in list(self.live.items()):
            try:
                started.append((key, op(group)))
            except Exception as e:  # a member's failure is its own (module docstring)
                self._fail(key, e)
                continue
            if self.give_up is not None:
                self._works.setdefault(key, []).append(started[-1][1])
        return started

    def finish(self, started: list[tuple[K, dist.Work]]) -> None:
        for key, work in started:
            if key not in self.live:
                continue
            try:
                self._wait(key, work)
            except GaveUp as e:
                self.failed[key] = e
                group = self.live.pop(key)
                group.abort()  # NCCL cancels its collectives; gloo cannot (class docstring)
                self.abandoned.append((group, self._works.pop(key, [])))
            except Exception as e:  # a member's failure is its own (module docstring)
                self._fail(key, e)

    def run(self, op: Callable[[SyncGroup], dist.Work]) -> None:
        self.finish(self.start(op))

    def _wait(self, key: K, work: dist.Work) -> None:
        group = self.live[key]
        if self.give_up is None:
            return group.wait(work)
        start = time.monotonic()
        deadline, ask_at, nap = start + group.timeout.total_seconds(), start + GIVE_UP_POLL_S, 1e-4
        while not work.is_completed():
            now = time.monotonic()
            if now >= deadline:
                break  # the collective's own timeout ends it (`group.wait` raises)
            if now >= ask_at:
                ask_at, self._given_up = now + GIVE_UP_POLL_S, self.give_up()
            if key in self._given_up:
                raise GaveUp(self._given_up[key])
            time.sleep(nap)
            nap = min(2 * nap, 0.002)
        return group.wait(work)  # raises if it failed

    def _fail(self, key: K, error: BaseException) -> None:
        self.failed[key] = error
        self.live.pop(key).abort()


class WeightBroadcaster(Generic[K]):
    """Learner rank 0's side: streams full tensors into buckets and broadcasts each to every
    member's group, concurrently.

    Two staging buffers per dtype live for the whole run (allocated at the first version): a
    bucket is packed into one while the previous one is still on the wire, so packing overlaps
    sending and no version pays for fresh memory. A bucket of one tensor (one larger than the
    bucket size, e.g. an embedding) already in the engine's dtype is sent as it is, uncopied."""

    @overload
    def __init__(
        self: WeightBroadcaster[int],
        members: SyncGroup,
        bucket_bytes: int,
        device: torch.device | None = None,
    ) -> None: ...
    @overload
    def __init__(
        self, members: dict[K, SyncGroup], bucket_bytes: int, device: torch.device | None = None
    ) -> None: ...
    def __init__(
        self,
        members: SyncGroup | dict[K, SyncGroup],
        bucket_bytes: int,
        device: torch.device | None = None,
    ) -> None:
        # a lone group is member 0 (K is int then: the first overload)
        keyed = members if isinstance(members, dict) else {0: members}
        self.members = cast("dict[K, SyncGroup]", keyed)
        """The groups a version goes to, by key (the owner may add some between versions); a
        member that fails is removed."""
        self.bucket_bytes = bucket_bytes
        self.device = device or next(iter(self.members.values())).device
        self._staging: dict[torch.dtype, list[torch.Tensor]] = {}
        self.give_up: Callable[[], dict[K, str]] | None = None
        """Asked while a wait lasts, which members to stop waiting for (`_Fanout`); None: a
        member is waited for up to its group's timeout."""
        self._abandoned: list[tuple[SyncGroup, list[dist.Work]]] = []

    def _buffers(self, buckets: list[Bucket]) -> dict[torch.dtype, list[torch.Tensor]]:
        for dtype in {b.dtype for b in buckets}:
            need = max(b.numel for b in buckets if b.dtype == dtype)
            have = self._staging.get(dtype)
            if have is None or have[0].numel() < need:
                device = self.device
                self._staging[dtype] = [torch.empty(need, dtype=dtype, device=device) for _ in "ab"]
        return self._staging

    def broadcast(
        self,
        specs: list[ParamSpec],
        tensors: Iterator[torch.Tensor],
        version: int,
        probe: DeliveryProbe | None = None,
    ) -> dict[K, BaseException]:
        """Send one version to every member; returns the members that failed (aborted and
        removed from `members`) with their errors. `tensors` yields the full tensors in `specs`
        order (it may gather them lazily: one bucket's full tensors are alive at a time; it is
        consumed whole even with no member left); a floating-point tensor is cast to its spec's
        dtype as it is packed (the engine's dtype, one pass). `probe`: the delivery probe
        (module docstring), sent after the weights."""
        self._abandoned = [(g, w) for g, w in self._abandoned if not all_ended(w)]
        fan = _Fanout(dict(self.members), self.give_up)
        header = torch.tensor(
            [version, len(specs), layout_hash(specs), self.bucket_bytes, probe is not None],
            dtype=torch.int64,
        ).to(self.device)
        fan.run(lambda g: g.broadcast_async(header))
        buckets = plan_buckets(specs, self.bucket_bytes)
        staging = self._buffers(buckets)
        in_flight: dict[int, list[tuple[K, dist.Work]]] = {}  # id of a staging buffer -> its sends
        sent_whole: list[tuple[torch.Tensor, list[tuple[K, dist.Work]]]] = []
        for i, bucket in enumerate(buckets):
            parts = [_checked(spec, next(tensors)) for spec in bucket.params]
            if not fan.live:
                continue  # nobody to send to: the tensors are still gathered (a collective)
            if len(parts) == 1 and parts[0].dtype == bucket.dtype and parts[0].is_contiguous():
                flat = parts[0].reshape(-1)
                sent_whole.append((flat, fan.start(_broadcast_of(flat))))
                continue  # one tensor already as the engine wants it: sent uncopied
            buffer = staging[bucket.dtype][i % 2]
            fan.finish(in_flight.pop(id(buffer), []))
            flat, offset = buffer[: bucket.numel], 0
            for spec, t in zip(bucket.params, parts, strict=True):
                flat[offset : offset + spec.numel].copy_(t.reshape(-1))  # casts to spec.dtype
                offset += spec.numel
            in_flight[id(buffer)] = fan.start(_broadcast_of(flat))
        for started in [*in_flight.values(), *(w for _, w in sent_whole)]:
            fan.finish(started)
        if probe is not None:
            sent = probe.to_wire().to(self.device)
            fan.run(lambda g: g.broadcast_async(sent))
        fan.run(lambda g: g.ack_async())
        for key in fan.failed:
            self.members.pop(key, None)
        self._abandoned += fan.abandoned
        return fan.failed

    def shutdown(self) -> dict[K, BaseException]:
        """Tell every receiver that no more versions will come; returns the members that
        failed to hear it."""
        fan = _Fanout(dict(self.members))
        header = torch.tensor([SHUTDOWN, 0, 0, 0, 0], dtype=torch.int64).to(self.device)
        fan.run(lambda g: g.broadcast_async(header))
        return fan.failed


def _broadcast_of(tensor: torch.Tensor) -> Callable[[SyncGroup], dist.Work]:
    """The op that starts broadcasting `tensor` on a member's group (bound now, not when the
    op runs)."""
    return lambda g: g.broadcast_async(tensor)


def all_ended(works: list[dist.Work]) -> bool:
    """Whether every one of `works` has ended (completed or failed)."""
    return all(w.is_completed() for w in works)


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
    probe: DeliveryProbe | None = None
    """The version's delivery probe, when the learner sent one (`asyncrl.delivery_probe`)."""

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
            wire = torch.zeros(PROBE_LEN, dtype=torch.float32, device=self.group.device)
            self.group.broadcast(wire)
            probe = DeliveryProbe.from_wire(wire)
        self.group.wait(self.group.ack_async())
        release = lambda: setattr(self, "_free", staging)  # noqa: E731
        return ReceivedVersion(version, buckets, release, probe)
