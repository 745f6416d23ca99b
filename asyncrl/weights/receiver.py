"""A rollout server's side of the weight sync: one whole version at a time, in the order
`asyncrl.weights.sync` describes (header; the buckets, or the claim and the slot's handle for a
staged transport; the probe; the acknowledgement).

A version is held whole before the engine gets it, so it is applied entirely or not at all. A
wire transport's buckets land in staging of the receiver's own, reused once released; a staged
transport's are views of the learner's slot (`ReceivedVersion.borrowed`), which the learner
writes again only after the receiver has claimed the next version, so a version still held when
`receive` is called again is copied out first and never overwritten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncrl.weights.group import SyncGroup
from asyncrl.weights.layout import Bucket, ParamSpec, layout_hash, plan_buckets, tensor_views
from asyncrl.weights.probe import PROBE_LEN, DeliveryProbe
from asyncrl.weights.sync import SHUTDOWN
from asyncrl.weights.transports import (
    HANDLE_FRAME,
    HEADER,
    SlotHandle,
    bucket_view,
    open_slot,
    read_staged_header,
    slot_offsets,
)
from asyncrl.wire.validation import ProtocolError


@dataclass
class ReceivedVersion:
    version: int
    buckets: list[list[tuple[str, torch.Tensor]]]
    """(name, tensor) pairs grouped as they were sent; the tensors are views of one flat buffer
    per bucket: this receiver's staging, or a staged transport's slot."""
    release: Callable[[], None] = lambda: None
    """Call once the weights are applied: the receiver may then reuse the staging memory for
    the next version (without it, the next version gets fresh memory)."""
    probe: DeliveryProbe | None = None
    """The version's delivery probe, when the learner sent one (`asyncrl.weights.probe`)."""
    borrowed: bool = False
    """The tensors are views of memory the learner owns (a staged transport's slot): read them
    before the next `receive` (which copies them out first should they still be held), and
    copy them to keep them or hand them to another process."""

    @property
    def weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every (name, tensor) in state-dict order."""
        return [pair for bucket in self.buckets for pair in bucket]


class WeightReceiver:
    """A rollout server's side: receives one whole version, into staging memory of its own
    (wire transports) or as views of the learner's slot (staged transports)."""

    def __init__(self, group: SyncGroup, specs: list[ParamSpec]):
        self.group, self.specs = group, specs
        self._hash = layout_hash(specs)
        self._free: list[torch.Tensor] | None = None  # released staging, one buffer per bucket
        # the slot mapped here and its views, for (its handle, the bucket size)
        self._slot: tuple[tuple[SlotHandle, int], list[list[tuple]]] | None = None
        self._held: ReceivedVersion | None = None  # the last staged version, until released

    def receive(self) -> ReceivedVersion | None:
        """Block until the next version arrives; None when the learner shuts the group down."""
        if self.group.staged:
            return self._receive_staged()
        header = torch.zeros(HEADER, dtype=torch.int64, device=self.group.device)
        self.group.broadcast(header)
        fields = [int(x) for x in header.cpu()]
        if fields[0] == SHUTDOWN:
            return None
        plan = self._plan(fields)
        staging, self._free = self._free, None
        if staging is None or [t.numel() for t in staging] != [b.numel for b in plan]:
            staging = [torch.empty(b.numel, dtype=b.dtype, device=self.group.device) for b in plan]
        buckets = []
        for bucket, flat in zip(plan, staging, strict=True):
            self.group.broadcast(flat)
            buckets.append(tensor_views(bucket, flat))
        release = lambda: setattr(self, "_free", staging)  # noqa: E731
        return self._finish(ReceivedVersion(fields[0], buckets, release), fields[4])

    def _receive_staged(self) -> ReceivedVersion | None:
        """A version in the learner's slot: a version still held is copied out first; then the
        header with the slot's handle, whose all-reduce is the claim (the learner writes the
        slot only after it); the views of the slot, mapped and laid out once."""
        held, self._held = self._held, None
        if held is not None:
            for pairs in held.buckets:
                pairs[:] = [(name, t.clone()) for name, t in pairs]
            held.borrowed = False
        device = self.group.weights_device
        if self.group.transport == "cuda_ipc":  # (not run here: no GPU)
            # every read of the slot queued on this GPU (the engine's loads, on any thread and
            # stream; the copy-out above) ends before the claim lets the learner write it
            torch.cuda.synchronize(device)
        got = torch.zeros(HEADER + HANDLE_FRAME // 8, dtype=torch.int64)
        self.group.wait(self.group.all_reduce_async(got))
        fields, handle = read_staged_header(got)
        if fields[0] == SHUTDOWN:
            return None
        plan = self._plan(fields)
        if handle is None:
            raise ProtocolError(f"version {fields[0]} came without its slot's handle")
        key = (handle, fields[3])
        if self._slot is None or self._slot[0] != key:
            self._slot = (key, self._slot_views(handle, plan))
        buckets = [list(pairs) for pairs in self._slot[1]]  # fresh lists of the same views
        got_version = ReceivedVersion(fields[0], buckets, borrowed=True)
        got_version.release = lambda: setattr(self, "_held", None)
        self._held = got_version
        return self._finish(got_version, fields[4])

    def _slot_views(self, handle: SlotHandle, plan: list[Bucket]) -> list[list[tuple]]:
        offsets, nbytes = slot_offsets(plan)
        if handle.nbytes < nbytes:
            raise RuntimeError(f"the learner's slot holds {handle.nbytes} bytes, not {nbytes}")
        slot = open_slot(handle, self.group.weights_device)
        return [
            tensor_views(b, bucket_view(slot, b, o)) for b, o in zip(plan, offsets, strict=True)
        ]

    def _plan(self, fields: list[int]) -> list[Bucket]:
        """The header's bucket plan, once its layout is checked against this engine's."""
        version, num_params, digest, bucket_bytes, _ = fields
        if num_params != len(self.specs) or digest != self._hash:
            raise RuntimeError(
                f"weight layout mismatch at version {version}: learner sends {num_params} params "
                f"(hash {digest}), this engine has {len(self.specs)} (hash {self._hash}); "
                "learner and servers must load the same model architecture"
            )
        return plan_buckets(self.specs, bucket_bytes)

    def _finish(self, got: ReceivedVersion, has_probe: int) -> ReceivedVersion:
        """The probe (when the header says one follows), then the acknowledgement."""
        if has_probe:
            wire = torch.zeros(PROBE_LEN, dtype=torch.float32, device=self.group.device)
            self.group.broadcast(wire)
            got.probe = DeliveryProbe.from_wire(wire)
        self.group.wait(self.group.ack_async())
        return got
