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

Three modules do the learner's jobs, which `WeightBroadcaster` here wires into one version:
`asyncrl.weights.fanout` (each collective on every member's group at once, a member's failure its
own), `asyncrl.weights.staged_slots` (the staged members' slots, made, reused and freed) and
`asyncrl.weights.packing` (the bucket plan, and each bucket's tensors copied into a staging
buffer or a slot).

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

from collections.abc import Callable, Iterable, Iterator
from typing import Generic, cast, overload

import torch
import torch.distributed as dist

from asyncrl.weights.fanout import Fanout, K, all_ended, on_device, send
from asyncrl.weights.group import SyncGroup
from asyncrl.weights.layout import Bucket, ParamSpec
from asyncrl.weights.packing import Plan, StagingBuffers, checked, copy_into, make_plan, pack
from asyncrl.weights.probe import DeliveryProbe
from asyncrl.weights.staged_slots import Slot, StagedSlots
from asyncrl.weights.transports import CudaSlot, staged_header

SHUTDOWN = -1
"""The header's version when no more versions will come."""


class WeightBroadcaster(Generic[K]):
    """Learner rank 0's side: streams full tensors into buckets and delivers each to every
    member, concurrently: a collective per bucket on a wire member's group (`nccl`, `gloo`), a
    copy into a staged member's slot (`cuda_ipc`, `shm`).

    Two staging buffers per dtype and device live for the whole run (`StagingBuffers`): a
    bucket is packed into one while the previous one is still on the wire. A bucket of one
    tensor (one larger than the bucket size, e.g. an embedding) already in the engine's dtype
    and on the group's device is sent as it is, uncopied. A staged member's slot is made at its
    first version and freed when the member goes (`StagedSlots`)."""

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
        self.slots: StagedSlots[K] = StagedSlots(self.device)
        self._staging = StagingBuffers()
        self._plan: Plan | None = None
        self.give_up: Callable[[], dict[K, str]] | None = None
        """Asked while a wait lasts, which members to stop waiting for (`Fanout`); None: a
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
        self.slots.close(keep=self.members)
        chosen = self.members if only is None else {k: self.members[k] for k in only}
        fan = Fanout(dict(chosen), self.give_up)
        plan = self.plan(specs)
        buckets, offsets = plan.buckets, plan.offsets
        slots = self.slots.for_version(fan, plan.slot_bytes)
        head = [version, len(specs), plan.digest, self.bucket_bytes, probe is not None]
        self._send_headers(fan, torch.tensor(head, dtype=torch.int64), slots)
        views = {k: self.slots.views(k, s, buckets, offsets) for k, s in slots.items()}
        self._send_buckets(fan, buckets, tensors, views)
        if any(isinstance(slots[k], CudaSlot) for k in slots):  # (not run here: no GPU)
            torch.cuda.synchronize(self.device)  # written before the server reads it
        if probe is not None:
            fan.run(on_device(probe.to_wire()))
        fan.run(lambda _, g: g.ack_async())
        for key in fan.failed:
            self.members.pop(key, None)
        self.slots.close(keep=self.members)
        self._abandoned += fan.abandoned
        return fan.failed

    def plan(self, specs: list[ParamSpec]) -> Plan:
        """The buckets of `specs` and where they lie in a slot, worked out once for the list
        the learner passes every version (another list: again)."""
        if self._plan is None or self._plan.specs is not specs:
            self._plan = make_plan(specs, self.bucket_bytes)
        return self._plan

    def _send_headers(self, fan: Fanout[K], head: torch.Tensor, slots: dict[K, Slot]) -> None:
        """The header: a broadcast to wire members; to staged members, with their slot's
        handle, an all-reduce that is also the claim (module docstring)."""
        sent = {k: staged_header(head, slot.handle()) for k, slot in slots.items()}
        started = fan.start(on_device(head), fan.wire_keys())  # every member's, before waiting
        started += fan.start(lambda k, g: g.all_reduce_async(sent[k]), sent)
        fan.finish(started)

    def _send_buckets(
        self,
        fan: Fanout[K],
        buckets: list[Bucket],
        tensors: Iterator[torch.Tensor],
        views: dict[K, list[list[torch.Tensor]]],
    ) -> None:
        in_flight: dict[int, list[tuple[K, dist.Work]]] = {}  # id of a staging buffer -> its sends
        sent_whole: list[tuple[torch.Tensor, list[tuple[K, dist.Work]]]] = []
        for i, bucket in enumerate(buckets):
            parts = [checked(spec, next(tensors)) for spec in bucket.params]
            if not fan.live:
                continue  # nobody to send to: the tensors are still gathered (a collective)
            for key, slot_views in views.items():
                if key in fan.live:
                    copy_into(slot_views[i], parts)
            wire = fan.wire_keys()
            for device in {fan.live[k].device for k in wire}:
                keys = [k for k in wire if fan.live[k].device == device]
                one = parts[0]
                if len(parts) == 1 and one.dtype == bucket.dtype and one.device == device:
                    flat = one.reshape(-1)  # one tensor already as the engine wants it: uncopied
                    sent_whole.append((flat, fan.start(send(flat), keys)))
                    continue
                buffer = self._staging.pair(buckets, device)[bucket.dtype][i % 2]
                fan.finish(in_flight.pop(id(buffer), []))
                flat = buffer[: bucket.numel]
                pack(flat, bucket, parts)
                in_flight[id(buffer)] = fan.start(send(flat), keys)
        for started in [*in_flight.values(), *(w for _, w in sent_whole)]:
            fan.finish(started)

    def shutdown(self) -> dict[K, BaseException]:
        """Tell every receiver that no more versions will come, and free every slot; returns
        the members that failed to hear it."""
        fan = Fanout(dict(self.members), self.give_up)  # a frozen member is given up here too
        head = torch.tensor([SHUTDOWN, 0, 0, 0, 0], dtype=torch.int64)
        fan.run(on_device(head), fan.wire_keys())
        staged = staged_header(head, None)
        fan.run(lambda _, g: g.all_reduce_async(staged.clone()), fan.staged_keys())
        self.slots.close(keep_spares=False)
        return fan.failed
