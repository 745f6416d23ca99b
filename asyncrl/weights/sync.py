"""Bucketed weight delivery from learner rank 0 to every rollout server.

Each rollout server epoch is a member with a 2-member group of its own with learner rank 0
(`asyncrl.weights.group`: how it joins and over which transport, `asyncrl.weights.transports`), so a
member that dies or hangs fails only its own group.

One sync, in this order, on each member's group:
  1. a header, int64 [version, num_params, layout_hash, bucket_bytes, probe]; version -1 means
     shutdown. A wire member (`nccl`, `gloo`) gets it by broadcast. A staged member (`cuda_ipc`,
     `shm`) gets it in an all-reduce with its slot's handle after it (`staged_header`: the
     receiver adds zeros), which is also the claim: it completes only once the receiver has
     come back for this version, so it no longer reads the previous one, and the learner writes
     the member's slot only after it;
  2. the weights, in the buckets of `plan_buckets` (flat tensors of one dtype each): a wire
     member gets one broadcast per bucket, into the receiver's staging; a staged member's slot
     gets one batched copy per bucket (`slot_offsets`), and the receiver, which mapped the slot
     once, takes views of it, copying nothing;
  3. when the header's probe is 1, the delivery probe (`asyncrl.weights.probe`): the
     learner's log-probs of fixed ids under this version and their tolerance, in the one
     float32 [PROBE_LEN] of `DeliveryProbe.to_wire`; the receiver hands the engine the
     `DeliveryProbe` back, which it checks after applying the version;
  4. the acknowledgement: an all-reduce of one element, which completes on the learner only
     once the receiver holds the whole version (a send completes as soon as the bytes are in
     the kernel's buffers, so without it a stopped receiver would go unnoticed; for a staged
     member, the learner comes to it only once the slot is written and, on a GPU, synchronized).
Learner rank 0 starts each collective on every member's group before it waits on any, so the
members receive concurrently. A member whose collective fails (its process died: the connection
is reset) or does not complete within its group's timeout (hung, SIGSTOPped) is aborted and left
out of the rest of the version; the others still get it, and its slot is freed.

Both sides derive the bucket plan from their own view of the model (names, shapes and dtypes in
state-dict order) and the header's bucket size; the layout hash makes a mismatch fail loudly
instead of loading garbage (`asyncrl.weights.layout`; its `specs_of` and `weights_checksum`, and
the probe's `probe_ids`, are importable from here too). A receiver holds a whole version before
it hands it to the engine, so a version is applied entirely or not at all. Staging memory is
allocated once and reused on both sides (the sender double-buffers so that packing a bucket
overlaps sending the previous one; a receiver reuses a version's staging once it is released; a
staged member's slot is one version, written again only after the claim).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast, overload

import torch
import torch.distributed as dist

from asyncrl.weights.group import SyncGroup
from asyncrl.weights.layout import Bucket, ParamSpec, layout_hash, plan_buckets, tensor_views
from asyncrl.weights.layout import specs_of as specs_of
from asyncrl.weights.layout import weights_checksum as weights_checksum
from asyncrl.weights.probe import DeliveryProbe
from asyncrl.weights.probe import probe_ids as probe_ids
from asyncrl.weights.transports import (
    STAGED,
    CudaSlot,
    HostSlot,
    bucket_view,
    make_slot,
    slot_offsets,
    staged_header,
)

log = logging.getLogger("asyncrl.weights.sync")

SHUTDOWN = -1
GIVE_UP_POLL_S = 1.0
"""How often a waiting broadcast asks its owner which members to give up (`_Fanout`)."""
K = TypeVar("K", bound=Hashable)
"""How a broadcaster's owner keys its members (`learner.sync_fleet`: (server id, epoch))."""


class GaveUp(RuntimeError):
    """The broadcaster's owner gave up on a member it was waiting for (`_Fanout`)."""


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

    def start(self, op: Op[K], keys: Iterable[K] | None = None) -> list[tuple[K, dist.Work]]:
        """Start `op` on the group of every live member (of `keys`, when given)."""
        started: list[tuple[K, dist.Work]] = []
        for key in list(self.live if keys is None else keys):
            if key not in self.live:
                continue
            try:
                started.append((key, op(key, self.live[key])))
            except Exception as e:  # a member's failure is its own (module docstring)
                self.fail(key, e)
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
                self.fail(key, e)

    def run(self, op: Op[K], keys: Iterable[K] | None = None) -> None:
        self.finish(self.start(op, keys))

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

    def fail(self, key: K, error: BaseException) -> None:
        self.failed[key] = error
        self.live.pop(key).abort()


@dataclass(frozen=True)
class Plan:
    """How one layout of versions is sent (`WeightBroadcaster.plan`)."""

    specs: list[ParamSpec]
    digest: int  # `layout_hash(specs)`
    buckets: list[Bucket]  # `plan_buckets`
    offsets: list[int]  # each bucket's byte offset in a slot (`slot_offsets`)
    slot_bytes: int  # a slot's size


class WeightBroadcaster(Generic[K]):
    """Learner rank 0's side: streams full tensors into buckets and delivers each to every
    member, concurrently: a collective per bucket on a wire member's group (`nccl`, `gloo`), a
    copy into a staged member's slot (`cuda_ipc`, `shm`).

    Two staging buffers per dtype and device live for the whole run (allocated at the first
    version): a bucket is packed into one while the previous one is still on the wire, so
    packing overlaps sending and no version pays for fresh memory. A bucket of one tensor (one
    larger than the bucket size, e.g. an embedding) already in the engine's dtype and on the
    group's device is sent as it is, uncopied. A staged member's slot is made at its first
    version and freed when the member goes."""

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
        """`device`: where the learner's weights are (default: the lone group's)."""
        # a lone group is member 0 (K is int then: the first overload)
        keyed = members if isinstance(members, dict) else {0: members}
        self.members = cast("dict[K, SyncGroup]", keyed)
        """The groups a version goes to, by key (the owner may add and remove some between
        versions); a member that fails is removed."""
        self.bucket_bytes = bucket_bytes
        self.device = device or next(iter(self.members.values())).weights_device
        self._staging: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        self._slots: dict[K, HostSlot | CudaSlot] = {}
        self._views: dict[K, tuple[Slot, list[Bucket], list[list[torch.Tensor]]]] = {}
        self._plan: Plan | None = None
        self._retired: dict[Hashable, Slot] = {}  # server -> a dead epoch's CUDA slot
        self.give_up: Callable[[], dict[K, str]] | None = None
        """Asked while a wait lasts, which members to stop waiting for (`_Fanout`); None: a
        member is waited for up to its group's timeout."""
        self._abandoned: list[tuple[SyncGroup, list[dist.Work]]] = []

    def broadcast(
        self,
        specs: list[ParamSpec],
        tensors: Iterator[torch.Tensor],
        version: int,
        probe: DeliveryProbe | None = None,
        only: Iterable[K] | None = None,
    ) -> dict[K, BaseException]:
        """Send one version to every member (`only`: to these alone, a restart brought to the
        version the others hold); returns the members that failed (aborted and removed from
        `members`) with their errors. `tensors` yields the full tensors in `specs` order (it
        may gather them lazily: one bucket's full tensors are alive at a time; it is consumed
        whole even with no member left); a floating-point tensor is cast to its spec's dtype as
        it is packed (the engine's dtype, one pass). `probe`: the delivery probe, last."""
        self._abandoned = [(g, w) for g, w in self._abandoned if not all_ended(w)]
        self.close_slots(keep=self.members)
        chosen = self.members if only is None else {k: self.members[k] for k in only}
        fan = _Fanout(dict(chosen), self.give_up)
        plan = self.plan(specs)
        buckets, offsets = plan.buckets, plan.offsets
        slots = self._slots_for(fan, self._staged_keys(fan), plan.slot_bytes)
        head = [version, len(specs), plan.digest, self.bucket_bytes, probe is not None]
        self._send_headers(fan, torch.tensor(head, dtype=torch.int64), slots)
        views = {k: self._views_of(k, s, buckets, offsets) for k, s in slots.items()}
        self._send_buckets(fan, buckets, tensors, views)
        if any(isinstance(slots[k], CudaSlot) for k in slots):  # (not run here: no GPU)
            torch.cuda.synchronize(self.device)  # written before the server reads it
        if probe is not None:
            fan.run(_on_device(probe.to_wire()))
        fan.run(lambda _, g: g.ack_async())
        for key in fan.failed:
            self.members.pop(key, None)
        self.close_slots(keep=self.members)
        self._abandoned += fan.abandoned
        return fan.failed

    def plan(self, specs: list[ParamSpec]) -> Plan:
        """The buckets of `specs` and where they lie in a slot, worked out once for the list
        the learner passes every version (another list: again)."""
        if self._plan is None or self._plan.specs is not specs:
            buckets = plan_buckets(specs, self.bucket_bytes)
            offsets, nbytes = slot_offsets(buckets)
            self._plan = Plan(specs, layout_hash(specs), buckets, offsets, nbytes)
        return self._plan

    def _send_headers(self, fan: _Fanout[K], head: torch.Tensor, slots: dict[K, Slot]) -> None:
        """The header: a broadcast to wire members; to staged members, with their slot's
        handle, an all-reduce that is also the claim (module docstring)."""
        wire = [k for k, g in fan.live.items() if g.transport not in STAGED]
        sent = {k: staged_header(head, slot.handle()) for k, slot in slots.items()}
        started = fan.start(_on_device(head), wire)  # every member's, before waiting on any
        started += fan.start(lambda k, g: g.all_reduce_async(sent[k]), sent)
        fan.finish(started)

    def _views_of(
        self, key: K, slot: Slot, buckets: list[Bucket], offsets: list[int]
    ) -> list[list[torch.Tensor]]:
        """Each bucket's tensors as views of the member's slot, made once per slot."""
        cached = self._views.get(key)
        if cached is not None and cached[0] is slot and cached[1] == buckets:
            return cached[2]
        views = []
        for bucket, offset in zip(buckets, offsets, strict=True):
            flat = bucket_view(slot.tensor, bucket, offset)
            views.append([view for _, view in tensor_views(bucket, flat)])
        self._views[key] = (slot, buckets, views)
        return views

    def _slots_for(self, fan: _Fanout[K], staged: list[K], nbytes: int) -> dict[K, Slot]:
        """The slot of every staged member still live, made (or remade, for another size) now;
        a member whose slot cannot be made (/dev/shm full) fails."""
        for key in staged:
            have = self._slots.get(key)
            if key not in fan.live or (have is not None and have.nbytes == nbytes):
                continue
            if have is not None:
                self._views.pop(key, None)
                self._slots.pop(key).close()
            spare = self._retired.pop(_as_tuple(key)[0], None)
            if spare is not None and spare.nbytes == nbytes:
                self._slots[key] = spare  # its last reader is gone: the server restarted
                continue
            try:
                tag = "-".join(str(part) for part in _as_tuple(key))
                self._slots[key] = make_slot(fan.live[key].transport, nbytes, self.device, tag)
            except Exception as e:  # its own failure
                fan.fail(key, RuntimeError(f"no staging slot of {nbytes} bytes: {e!r}"))
        return {k: self._slots[k] for k in staged if k in fan.live}

    def _send_buckets(
        self,
        fan: _Fanout[K],
        buckets: list[Bucket],
        tensors: Iterator[torch.Tensor],
        views: dict[K, list[list[torch.Tensor]]],
    ) -> None:
        in_flight: dict[int, list[tuple[K, dist.Work]]] = {}  # id of a staging buffer -> its sends
        sent_whole: list[tuple[torch.Tensor, list[tuple[K, dist.Work]]]] = []
        for i, bucket in enumerate(buckets):
            parts = [_checked(spec, next(tensors)) for spec in bucket.params]
            if not fan.live:
                continue  # nobody to send to: the tensors are still gathered (a collective)
            for key, slot_views in views.items():
                if key in fan.live:
                    copy_into(slot_views[i], parts)
            wire = [k for k, g in fan.live.items() if g.transport not in STAGED]
            for device in {fan.live[k].device for k in wire}:
                keys = [k for k in wire if fan.live[k].device == device]
                one = parts[0]
                if len(parts) == 1 and one.dtype == bucket.dtype and one.device == device:
                    flat = one.reshape(-1)  # one tensor already as the engine wants it: uncopied
                    sent_whole.append((flat, fan.start(_send(flat), keys)))
                    continue
                buffer = self._buffers(buckets, device)[bucket.dtype][i % 2]
                fan.finish(in_flight.pop(id(buffer), []))
                flat = buffer[: bucket.numel]
                _pack(flat, bucket, parts)
                in_flight[id(buffer)] = fan.start(_send(flat), keys)
        for started in [*in_flight.values(), *(w for _, w in sent_whole)]:
            fan.finish(started)

    def _buffers(self, buckets: list[Bucket], device: torch.device) -> dict[torch.dtype, list]:
        """The two staging buffers of each dtype on `device`, large enough for every bucket."""
        out = {}
        for dtype in {b.dtype for b in buckets}:
            need = max(b.numel for b in buckets if b.dtype == dtype)
            have = self._staging.get((device, dtype))
            if have is None or have[0].numel() < need:
                have = [torch.empty(need, dtype=dtype, device=device) for _ in "ab"]
                self._staging[(device, dtype)] = have
            out[dtype] = have
        return out

    @staticmethod
    def _staged_keys(fan: _Fanout[K]) -> list[K]:
        return [k for k, g in fan.live.items() if g.transport in STAGED]

    def close_slots(self, keep: Iterable[K] = (), keep_spares: bool = True) -> None:
        """Free the slot of every member not in `keep` (gone: failed, or removed by the
        owner); a CUDA one is kept for the same server's next epoch. Without `keep_spares`
        (at shutdown), every slot not kept goes."""
        for key in [k for k in self._slots if k not in set(keep)]:
            self._views.pop(key, None)
            slot = self._slots.pop(key)
            if isinstance(slot, CudaSlot) and keep_spares:
                # freed, torch would hold the block for good should the dead server have held
                # it open (an importer that never let go): its next epoch reuses it instead
                old = self._retired.pop(_as_tuple(key)[0], None)
                if old is not None:
                    old.close()
                self._retired[_as_tuple(key)[0]] = slot
            else:
                slot.close()
        if not keep_spares:
            for spare in self._retired.values():
                spare.close()
            self._retired.clear()

    def shutdown(self) -> dict[K, BaseException]:
        """Tell every receiver that no more versions will come, and free every slot; returns
        the members that failed to hear it."""
        fan = _Fanout(dict(self.members), self.give_up)  # a frozen member is given up here too
        head = torch.tensor([SHUTDOWN, 0, 0, 0, 0], dtype=torch.int64)
        fan.run(_on_device(head), [k for k, g in fan.live.items() if g.transport not in STAGED])
        staged = staged_header(head, None)
        fan.run(lambda _, g: g.all_reduce_async(staged.clone()), self._staged_keys(fan))
        self.close_slots(keep_spares=False)
        return fan.failed


Slot = HostSlot | CudaSlot
Op = Callable[[K, SyncGroup], dist.Work]
"""A collective started on one member's group (`_Fanout`), given its key and group."""


def _on_device(tensor: torch.Tensor) -> Op:
    """The op that broadcasts `tensor` (a small control tensor) on a member's group, moved to
    the group's device once per device."""
    copies: dict[torch.device, torch.Tensor] = {}

    def op(_, group: SyncGroup) -> dist.Work:
        if group.device not in copies:
            copies[group.device] = tensor.to(group.device)
        return group.broadcast_async(copies[group.device])

    return op


def _send(tensor: torch.Tensor) -> Op:
    """The op that starts broadcasting `tensor` on a member's group (bound now, not when the
    op runs)."""
    return lambda _, g: g.broadcast_async(tensor)


def _pack(flat: torch.Tensor, bucket: Bucket, parts: list[torch.Tensor]) -> None:
    """Copy a bucket's tensors into its flat buffer, each cast to its spec's dtype."""
    offset = 0
    for spec, t in zip(bucket.params, parts, strict=True):
        flat[offset : offset + spec.numel].copy_(t.reshape(-1))
        offset += spec.numel


BATCHED_BELOW = 1 << 20
"""Tensors smaller than this many bytes are copied into a slot by one batched kernel per bucket
(`copy_into`); larger ones one by one, at the device's copy speed."""


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


def _as_tuple(key: Hashable) -> tuple:
    return key if isinstance(key, tuple) else (key,)


def all_ended(works: list[dist.Work]) -> bool:
    """Whether every one of `works` has ended (completed or failed)."""
    return all(w.is_completed() for w in works)


def _checked(spec: ParamSpec, t: torch.Tensor) -> torch.Tensor:
    """`t` if it can be sent as `spec` (same shape; same dtype, or both floating point)."""
    cast = t.is_floating_point() and spec.dtype.is_floating_point
    if tuple(t.shape) != spec.shape or (t.dtype != spec.dtype and not cast):
        raise ValueError(f"{spec.name}: got {tuple(t.shape)} {t.dtype}, planned {spec}")
    return t
