"""Requests the replay could not answer yet, one typed queue per request kind.

A lease request with nothing to grant, or a batch request with no batch ready, is held: it is
answered as soon as something changes that may let it be answered (`Changes`), or answered
empty once `replay.wait_timeout_s` has passed, so its client simply asks again. Each queue
knows its request kind's three ways out:

- superseded: a newer request replaces the held one, which is answered empty. A lease request
  supersedes any held one from the same identity or for the same server (one held per server,
  whatever identity asks: held leases stay at most `rollout.num_servers`); a batch request, any
  held one from the same identity.
- timed out: answered empty at its deadline (`time_out`), or when the service closes.
- answered: in arrival order, with what its desk has now: `HeldLeases.answer` grants what the
  lease desk (`replay.leases`) allows, `HeldBatches.answer` serves the batches the batch desk
  (`replay.batches`) has ready.

An empty answer is counted (`empty_grants`, `empty_batches`). The queues read no clock: the
service passes `now`, so one clock rules every deadline.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from asyncrl.wire.protocol import LeaseGrant, LeaseRequest
from asyncrl.wire.router import Peer
from asyncrl.wire.samples import BatchRequest
from replay.batches import BatchDesk
from replay.buffer import to_batch
from replay.leases import LeaseDesk

Send = Callable[[Peer, Any], None]
"""How a queue answers: the service's signed reply to one peer."""

UNBLOCKING_EVENTS = (
    "accepted",  # a training sample taken: its group may be complete
    "eval_samples",  # an evaluation sample taken: its group may be complete
    "version_updates",  # the learner moved on: another batch is trainable, the window moved
    "eval_jobs",  # evaluation prompts to lease
    "groups_failed",  # a lease ended early: a slot and capacity were freed
    "expired",  # leases expired: slots and capacity were freed
    "stale_dropped",  # groups dropped as stale: slots and capacity were freed
    "groups_filtered",  # groups dropped by the filter (no signal): slots and capacity freed
    "batches_served",  # groups consumed: capacity was freed
    "server_epochs_replaced",  # a replaced epoch's leases were taken back
    "servers_declared_dead",  # a silent server's leases were taken back
    "servers_declared_dead_by_learner",  # the same, on the learner's word
)
"""The counters whose moving may let a held request be answered: every event that completes a
group, moves the learner on, brings evaluation prompts or frees admission slots or capacity."""


class Changes:
    """Whether something happened, since the last look, that may let a held request be
    answered: one of the `UNBLOCKING_EVENTS` counters moved. The events are counted where they
    happen anyway, so no handler has to remember to say so."""

    def __init__(self, counters: Counter[str]) -> None:
        self._counters = counters
        self._seen = self._now()

    def _now(self) -> tuple[int, ...]:
        return tuple(self._counters[name] for name in UNBLOCKING_EVENTS)

    def since_last_look(self) -> bool:
        """Whether any of them moved since the previous call (or since the start)."""
        now = self._now()
        changed, self._seen = now != self._seen, now
        return changed


@dataclass
class HeldLease:
    """A lease request held: nothing could be granted to its server yet."""

    peer: Peer
    request: LeaseRequest
    deadline: float  # monotonic time of the empty answer


@dataclass
class HeldBatch:
    """A batch request held: no batch was ready yet."""

    peer: Peer
    request: BatchRequest
    deadline: float  # monotonic time of the empty answer
    stale_dropped: int = 0  # groups dropped as stale while it waited (told in its answer)


Held = TypeVar("Held", HeldLease, HeldBatch)


class _Queue(ABC, Generic[Held]):
    """The held requests of one kind, in arrival order; what both kinds share."""

    def __init__(self, send: Send, counters: Counter[str], wait_s: float) -> None:
        self._send = send
        self._counters = counters
        self.wait_s = wait_s
        self._held: list[Held] = []

    def __len__(self) -> int:
        return len(self._held)

    def earliest_deadline(self) -> float:
        """When the first held request is due to be answered empty (inf: none is held)."""
        return min((held.deadline for held in self._held), default=float("inf"))

    def time_out(self, now: float) -> None:
        """Answer empty every request whose wait is over at `now`."""
        over = [held for held in self._held if held.deadline <= now]
        self._held = [held for held in self._held if held.deadline > now]
        self._answer_empty(over)

    def close(self) -> None:
        """Answer every held request empty (the service is closing: no client waits)."""
        held, self._held = self._held, []
        self._answer_empty(held)

    def _supersede(self, replaced: Callable[[Held], bool]) -> None:
        """Answer empty the held requests `replaced` picks; keep the others."""
        self._answer_empty([held for held in self._held if replaced(held)])
        self._held = [held for held in self._held if not replaced(held)]

    @abstractmethod
    def _answer_empty(self, held: Iterable[Held]) -> None:
        """Answer each of `held` empty, in its kind's message, and count it."""


class HeldLeases(_Queue[HeldLease]):
    """Held lease requests, at most one per server (see the module docstring)."""

    def supersede(self, server_id: int, identity: bytes | None = None) -> None:
        """Answer empty the request held for `server_id` or from `identity`: a newer request
        replaces it (it carries the server's current version and free slots), or the server's
        epoch is over (`identity` None)."""
        self._supersede(
            lambda held: held.request.server_id == server_id or held.peer.identity == identity
        )

    def grant_or_hold(self, peer: Peer, request: LeaseRequest, desk: LeaseDesk, now: float) -> None:
        """A new request (after `supersede`): granted at once what `desk` allows, the requester
        counted among the servers asking; held if nothing can be granted (a request for 0
        groups is answered at once, empty)."""
        prompts = desk.grant(request, 1 + self.asking(desk))
        if prompts or request.max_groups == 0:
            self._send(peer, LeaseGrant(request.request_id, prompts))
        else:
            self._held.append(HeldLease(peer, request, now + self.wait_s))

    def asking(self, desk: LeaseDesk) -> int:
        """Servers with a request held that could take work now (`replay.admission`'s
        "asking")."""
        return sum(1 for held in self._held if desk.wanted(held.request) > 0)

    def answer(self, desk: LeaseDesk) -> None:
        """Grant each held request what `desk` allows now, in arrival order; the servers asking
        are counted once, before any is answered, so an early grant never widens the shares of
        the later ones in the same pass."""
        asking = self.asking(desk)
        waiting = []
        for held in self._held:
            prompts = desk.grant(held.request, asking)
            if prompts:
                self._send(held.peer, LeaseGrant(held.request.request_id, prompts))
            else:
                waiting.append(held)
        self._held = waiting

    def _answer_empty(self, held: Iterable[HeldLease]) -> None:
        for h in held:
            self._counters["empty_grants"] += 1
            self._send(h.peer, LeaseGrant(h.request.request_id, []))


class HeldBatches(_Queue[HeldBatch]):
    """Held batch requests (see the module docstring)."""

    def supersede(self, identity: bytes) -> None:
        """Answer empty the request held from `identity`: its newer request replaces it."""
        self._supersede(lambda held: held.peer.identity == identity)

    def serve_or_hold(self, peer: Peer, request: BatchRequest, desk: BatchDesk, now: float) -> None:
        """A new request (after `supersede`): served at once if `desk` has a batch, else held."""
        held = HeldBatch(peer, request, now + self.wait_s)
        if not self._serve(held, desk):
            self._held.append(held)

    def answer(self, desk: BatchDesk) -> None:
        """Serve each held request, in arrival order, that `desk` has a batch for."""
        self._held = [held for held in self._held if not self._serve(held, desk)]

    def _serve(self, held: HeldBatch, desk: BatchDesk) -> bool:
        """Answer `held` with a batch if one is ready (True); else count what was dropped as
        stale for it meanwhile, to be told in its answer (False)."""
        batch, stale = desk.serve(held.request, held.stale_dropped)
        held.stale_dropped += stale
        if batch is None:
            return False
        self._send(held.peer, batch)
        return True

    def _answer_empty(self, held: Iterable[HeldBatch]) -> None:
        for h in held:
            self._counters["empty_batches"] += 1
            self._send(h.peer, to_batch(h.request.request_id, [], h.stale_dropped))
