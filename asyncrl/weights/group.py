"""The process group of one weight-sync member, and how a rollout server joins it.

Each rollout server has a 2-member group of its own with learner rank 0: rank 0 is the learner,
rank 1 the server. Every group is built on the one TCPStore that learner rank 0 hosts on the sync
port, under a `torch.distributed.PrefixStore` named for the server and its epoch (`sync_prefix`:
`server_3/epoch_1` is server 3's second start), so a restarted server joins a fresh group
without the others stopping, and a member that dies or hangs fails only its own group
(`learner.sync_fleet` keeps the members). These groups stand apart from `init_process_group`,
because learner ranks already have a default group (the FSDP one) and a process can hold only
one. The store and the gloo/NCCL sockets listen on the sync host only (`asyncrl.wire.binds`).

Every entry under a member's prefix (its `ready`, the learner's `answer`, the rendezvous of its
group) is sealed with the member's sync key (`member_store`, `asyncrl.weights.sealed_store`): the store
takes any local connection, so a process without the run's keys could otherwise read the joins
and forge or pre-write their answers.

Joining (`join_sync_group`, a server's side): the server sets `ready` under its prefix to its
place (`asyncrl.weights.transports.SyncPlace`: machine, device, GPU) and waits for the learner's
`answer` (`SyncAnswer`): join over the transport the learner chose for it
(`choose_transport`), after which both build the group, or abandon (the learner stopped waiting
for it, or no transport can join them), after which the server fails and must restart to try
again.

The group's collectives run on NCCL for the `nccl` transport (on the GPUs) and on gloo (on the
CPU) for every other: the staged transports (`cuda_ipc`, `shm`) send only small control tensors
through it, so a server on the CPU and a learner on a GPU still speak one backend.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from typing import Protocol

import torch
import torch.distributed as dist

from asyncrl.config.weight_transport import Transport, is_staged
from asyncrl.weights.sealed_store import SealedStore
from asyncrl.weights.transports import SyncAnswer, SyncPlace, pack_message, place_of, unpack_message
from asyncrl.wire.auth import RoleKey, server_role, sync_key
from asyncrl.wire.binds import bind_collectives_to, setup_store

log = logging.getLogger("asyncrl.weights.sync")

REFRESH_S = 1.0
"""How often a joining server sets its `ready` again while it waits for the answer."""


def sync_prefix(server_id: int, epoch: int) -> str:
    """The store prefix of one server epoch's group with learner rank 0."""
    return f"server_{server_id}/epoch_{epoch}"


def member_store(
    store: dist.Store, server_id: int, epoch: int, key: bytes, timeout_s: float
) -> SealedStore:
    """One server epoch's entries of learner rank 0's `store`, sealed with its sync `key`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return SealedStore(store, sync_prefix(server_id, epoch), key, timeout)


def learner_member_store(
    store: dist.Store, learner: RoleKey, server_id: int, epoch: int, timeout_s: float
) -> SealedStore:
    """Learner rank 0's side of `member_store`: the member's sync key derived from its own."""
    key = sync_key(learner, server_role(server_id, epoch))
    return member_store(store, server_id, epoch, key, timeout_s)


class _Backend(Protocol):
    """The collectives of a gloo or NCCL backend used here (torch's stubs for its `Backend`
    omit `broadcast` and `allreduce`, which it has at runtime)."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work: ...
    def allreduce(self, tensor: torch.Tensor) -> dist.Work: ...
    def abort(self) -> None: ...
    def _set_default_timeout(self, timeout: datetime.timedelta) -> None: ...


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
        transport: Transport | None = None,
    ):
        """`device`: where this end's weights live. `transport`: how versions travel (module
        docstring; default: `nccl` on a GPU, `gloo` on the CPU, a plain group). `store`:
        rendezvous there (a server epoch's prefix of learner rank 0's store) instead of on a
        TCPStore of the group's own at host:port (rank 0 hosting it). `timeout_s` bounds the
        rendezvous and every collective (`wait`)."""
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self.transport: Transport = transport or ("nccl" if device.type == "cuda" else "gloo")
        self.weights_device = device
        """Where this end's weights live (a `cuda_ipc` slot is opened there)."""
        nccl = self.transport == "nccl"
        self.device = device if nccl else torch.device("cpu")
        """Where the group's collectives run (and a wire transport's buckets land)."""
        bind_collectives_to(host)
        if store is None:
            store = setup_store(host, port, world_size, rank == 0, self.timeout)
        self._store = store
        if nccl:  # (not run here: no GPU)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
            self._pg: _Backend = pg  # type: ignore[assignment]  # stubs lack its collectives
        else:
            gloo = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
            self._pg = gloo  # type: ignore[assignment]  # (as above)

    @property
    def staged(self) -> bool:
        """Whether versions reach this member through a slot it maps (`cuda_ipc`, `shm`),
        the group carrying only control tensors; else through the group's collectives."""
        return is_staged(self.transport)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` in place from rank 0."""
        self.wait(self._pg.broadcast(tensor, 0))

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work:
        """Start broadcasting `tensor` from rank 0; `wait` on the result before touching it."""
        return self._pg.broadcast(tensor, 0)

    def all_reduce_async(self, tensor: torch.Tensor) -> dist.Work:
        """Start summing `tensor` in place over both members (a staged version's header and
        claim: the receiver adds zeros)."""
        return self._pg.allreduce(tensor)

    def ack_async(self) -> dist.Work:
        """Start an all-reduce of one element: it completes on each side only once the other has
        come to it too (the acknowledgement that ends a version, and a staged version's claim:
        `asyncrl.weights.sync`)."""
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
    transport: Transport | None = None,
    key: bytes | None = None,
) -> SyncGroup:
    """A rollout server's side. With `server_id`: the 2-member group of this server epoch on
    learner rank 0's store, its entries sealed with `key` (the epoch's sync key, required); it
    joins as rank 1 of 2 over the transport the learner chooses (module docstring, joining)
    and waits up to `timeout_s` for the learner's answer. Without: a group of its own at
    host:port, as `rank` of `world_size`, over `transport` (tests and benches pair it with a
    plain `SyncGroup` of the same transport)."""
    if server_id is None:
        return SyncGroup(host, port, rank, world_size, device, timeout_s, transport=transport)
    if key is None:
        raise ValueError(f"server {server_id} joins the weight sync with its sync key, not None")
    timeout = datetime.timedelta(seconds=timeout_s)
    prefix = sync_prefix(server_id, epoch)
    tcp = dist.TCPStore(host, port, None, False, timeout)
    store = member_store(tcp, server_id, epoch, key, timeout_s)
    answer = unpack_message(_announce(store, pack_message(place_of(device)), timeout_s), SyncAnswer)
    if not answer.join:
        raise RuntimeError(
            f"the learner abandoned {prefix} before it joined the weight sync "
            f"({answer.reason}); this server must restart (a new epoch) to receive weights"
        )
    log.info("joined the weight sync as %s over %s (%s)", prefix, answer.transport, answer.reason)
    return SyncGroup(host, port, 1, 2, device, timeout_s, store=store, transport=answer.transport)


def _announce(store: SealedStore, place: bytes, timeout_s: float) -> bytes:
    """Set `ready` to `place` and wait up to `timeout_s` for the learner's `answer` (its sealed
    bytes), setting `ready` again every `REFRESH_S`: a process without the keys that overwrote
    it (it then reads as absent) costs the join a second, not the join (`asyncrl.weights.sealed_store`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        store.set("ready", place)
        try:
            return store.get_within("answer", min(REFRESH_S, max(deadline - time.monotonic(), 0)))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer to the join within {timeout_s:g} s") from None


def read_place(store: dist.Store) -> SyncPlace:
    """Learner side: the place a server epoch set as its `ready` (`ProtocolError` if garbled)."""
    return unpack_message(store.get("ready"), SyncPlace)


def answer(store: dist.Store, join: bool, transport: Transport, reason: str) -> None:
    """Learner side: answer a server epoch's join."""
    msg = SyncAnswer(join=join, transport=transport, reason=reason[:1000])
    store.set("answer", pack_message(msg))  # type: ignore[arg-type]  # bytes work
