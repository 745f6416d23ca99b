"""One version's collectives on every member's group at once (learner rank 0's side of
`asyncrl.weights.sync`).

A collective is started on every member's group before any is waited on, so the members receive
concurrently. A member whose collective fails (its process died: the connection is reset) or does
not complete within its group's timeout (hung, SIGSTOPped) is aborted and left out of the rest of
the version (`Fanout.failed`): its failure is its own, and the others still get the version.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from asyncrl.weights.group import SyncGroup

GIVE_UP_POLL_S = 1.0
"""How often a waiting broadcast asks its owner which members to give up (`Fanout`)."""
K = TypeVar("K", bound=Hashable)
"""How a broadcaster's owner keys its members (`learner.sync_fleet`: (server id, epoch))."""
Op = Callable[[K, SyncGroup], dist.Work]
"""A collective started on one member's group (`Fanout`), given its key and group."""


class GaveUp(RuntimeError):
    """The broadcaster's owner gave up on a member it was waiting for (`Fanout`)."""


@dataclass
class Fanout(Generic[K]):
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

    def wire_keys(self) -> list[K]:
        """The live members whose versions go through their group's collectives."""
        return [k for k, g in self.live.items() if not g.staged]

    def staged_keys(self) -> list[K]:
        """The live members whose versions go through a slot they map."""
        return [k for k, g in self.live.items() if g.staged]

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


def on_device(tensor: torch.Tensor) -> Op:
    """The op that broadcasts `tensor` (a small control tensor) on a member's group, moved to
    the group's device once per device."""
    copies: dict[torch.device, torch.Tensor] = {}

    def op(_, group: SyncGroup) -> dist.Work:
        if group.device not in copies:
            copies[group.device] = tensor.to(group.device)
        return group.broadcast_async(copies[group.device])

    return op


def send(tensor: torch.Tensor) -> Op:
    """The op that starts broadcasting `tensor` on a member's group (bound now, not when the
    op runs)."""
    return lambda _, g: g.broadcast_async(tensor)


def all_ended(works: list[dist.Work]) -> bool:
    """Whether every one of `works` has ended (completed or failed)."""
    return all(w.is_completed() for w in works)
