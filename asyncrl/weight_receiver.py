"""A rollout server's side of the weight sync: one whole version at a time, in the order
`asyncrl.weight_sync` describes (header; the buckets, or the claim and the slot's handle for a
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

from asyncrl.delivery_probe import PROBE_LEN, DeliveryProbe
from asyncrl.sync_group import SyncGroup
from asyncrl.weight_layout import Bucket, ParamSpec, layout_hash, plan_buckets
from asyncrl.weight_sync import SHUTDOWN
from asyncrl.weight_transport import (
    HANDLE_FRAME,
    STAGED,
    SlotHandle,
    bucket_view,
    open_slot,
    read_handle_frame,
    slot_offsets,
)


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
    """The version's delivery probe, when the learner sent one (`asyncrl.delivery_probe`)."""
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
        self._slot: tuple[SlotHandle, torch.Tensor] | None = None  # the slot, mapped here
        self._held: ReceivedVersion | None = None  # the last staged version, until released

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
        if self.group.transport in STAGED:
            got = ReceivedVersion(version, self._receive_staged(plan), borrowed=True)
            got.release = lambda: setattr(self, "_held", None)
            self._held = got
        else:
            got = self._receive_wire(version, plan)
        if has_probe:
            wire = torch.zeros(PROBE_LEN, dtype=torch.float32, device=self.group.device)
            self.group.broadcast(wire)
            got.probe = DeliveryProbe.from_wire(wire)
        self.group.wait(self.group.ack_async())
        return got

    def _receive_wire(self, version: int, plan: list[Bucket]) -> ReceivedVersion:
        """Each bucket by a collective, into staging of this receiver's own."""
        staging, self._free = self._free, None
        if staging is None or [t.numel() for t in staging] != [b.numel for b in plan]:
            staging = [torch.empty(b.numel, dtype=b.dtype, device=self.group.device) for b in plan]
        buckets = []
        for bucket, flat in zip(plan, staging, strict=True):
            self.group.broadcast(flat)
            buckets.append(_views(bucket, flat))
        release = lambda: setattr(self, "_free", staging)  # noqa: E731
        return ReceivedVersion(version, buckets, release)

    def _receive_staged(self, plan: list[Bucket]) -> list[list[tuple[str, torch.Tensor]]]:
        """Claim the slot (the learner writes it only after this), then take the views of the
        version it wrote there."""
        held = self._held
        if held is not None:  # still held: copied out before the learner may overwrite it
            for pairs in held.buckets:
                pairs[:] = [(name, t.clone()) for name, t in pairs]
            held.borrowed, self._held = False, None
        self.group.wait(self.group.ack_async())
        frame = torch.zeros(HANDLE_FRAME, dtype=torch.uint8)
        self.group.broadcast(frame)
        handle = read_handle_frame(frame)
        if self._slot is None or self._slot[0] != handle:
            self._slot = (handle, open_slot(handle, self.group.weights_device))
        offsets, nbytes = slot_offsets(plan)
        if handle.nbytes < nbytes:
            raise RuntimeError(f"the learner's slot holds {handle.nbytes} bytes, not {nbytes}")
        slot = self._slot[1]
        return [_views(b, bucket_view(slot, b, o)) for b, o in zip(plan, offsets, strict=True)]


def _views(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of each tensor of a bucket in its flat buffer."""
    offset, pairs = 0, []
    for spec in bucket.params:
        pairs.append((spec.name, flat[offset : offset + spec.numel].view(spec.shape)))
        offset += spec.numel
    return pairs
