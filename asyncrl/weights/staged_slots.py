"""The lifecycle of the staged members' slots on learner rank 0 (`asyncrl.weights.sync`).

A staged member (`cuda_ipc`, `shm`) receives each version through a slot of learner memory it
maps (`asyncrl.weights.transports`: `HostSlot`, `CudaSlot`). Its slot is made at its first
version (made again should a version need another size), written again only after the claim,
and freed when the member goes: failed, or removed by its owner. A CUDA slot is not freed but
kept for the same server's next epoch: torch would hold the block for good should the dead
server have held it open (an importer that never let go). At shutdown every slot goes.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic

import torch

from asyncrl.weights.fanout import Fanout, K
from asyncrl.weights.layout import Bucket, tensor_views
from asyncrl.weights.transports import CudaSlot, HostSlot, bucket_view, make_slot

Slot = HostSlot | CudaSlot


class StagedSlots(Generic[K]):
    """The slot of every staged member, by its key, and each bucket's views of it."""

    def __init__(self, device: torch.device) -> None:
        """`device`: learner rank 0's, where a CUDA slot is made."""
        self.device = device
        self._slots: dict[K, Slot] = {}
        self._views: dict[K, tuple[Slot, list[Bucket], list[list[torch.Tensor]]]] = {}
        self._retired: dict[Hashable, Slot] = {}  # server -> a dead epoch's CUDA slot

    def for_version(self, fan: Fanout[K], nbytes: int) -> dict[K, Slot]:
        """The slot of every staged member still live, made (or remade, for another size) now;
        a member whose slot cannot be made (/dev/shm full) fails."""
        staged = fan.staged_keys()
        for key in staged:
            have = self._slots.get(key)
            if key not in fan.live or (have is not None and have.nbytes == nbytes):
                continue
            if have is not None:
                self._views.pop(key, None)
                self._slots.pop(key).close()
            spare = self._retired.pop(_server_of(key), None)
            if spare is not None and spare.nbytes == nbytes:
                self._slots[key] = spare  # its last reader is gone: the server restarted
                continue
            try:
                tag = "-".join(str(part) for part in _as_tuple(key))
                self._slots[key] = make_slot(fan.live[key].transport, nbytes, self.device, tag)
            except Exception as e:  # its own failure
                fan.fail(key, RuntimeError(f"no staging slot of {nbytes} bytes: {e!r}"))
        return {k: self._slots[k] for k in staged if k in fan.live}

    def views(
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

    def close(self, keep: Iterable[K] = (), keep_spares: bool = True) -> None:
        """Free the slot of every member not in `keep` (gone: failed, or removed by the
        owner); a CUDA one is kept for the same server's next epoch (module docstring).
        Without `keep_spares` (at shutdown), every slot not kept goes."""
        for key in [k for k in self._slots if k not in set(keep)]:
            self._views.pop(key, None)
            slot = self._slots.pop(key)
            if isinstance(slot, CudaSlot) and keep_spares:
                old = self._retired.pop(_server_of(key), None)
                if old is not None:
                    old.close()
                self._retired[_server_of(key)] = slot
            else:
                slot.close()
        if not keep_spares:
            for spare in self._retired.values():
                spare.close()
            self._retired.clear()


def _as_tuple(key: Hashable) -> tuple:
    return key if isinstance(key, tuple) else (key,)


def _server_of(key: Hashable) -> Hashable:
    """The server a member's key names (its first part: (server id, epoch))."""
    return _as_tuple(key)[0]
