"""Which rollout servers are alive: heartbeats, epochs, and deaths declared by silence.

Each server's replay client sends a `Heartbeat` every `launch.heartbeat_s` with its id and its
epoch (its restart count, which the launcher sets). `FleetHealth` keeps, per server id, the
latest epoch heard from and when, and says what each heartbeat means:

    alive      the epoch it knows (or a first one): the server is alive
    replaced   a newer epoch of the server (restarted): the older epoch's leases must go
    refused    an older epoch, or one already declared dead: a process that the launcher has
               replaced or is about to kill; it is told so (`Ack(rejected)`) and stops

Every other message a server sends (lease requests, samples: `touch`) counts as a sign of life
too, so a server whose heartbeats are delayed but which keeps working is not declared dead.
Those messages carry its server id (its own, `replay.access`) but no epoch, so they refresh
only the epoch the replay believes alive: never a declared-dead one, and never one not heard
from yet (only a heartbeat tells its epoch). A server silent for `launch.server_timeout_s`
(dead, hung, stopped) is declared dead by `declare_silent`; only a newer epoch of it is alive
again. Learner rank 0 declares an epoch dead sooner (`declare`, on its `DeclareDead`) when it
stopped waiting for it in a weight sync: the server had been silent for
`launch.sync_give_up_s` while the whole learner waited on it (`learner.sync_fleet`). Whoever
drives this (`ReplayService`) re-issues the incomplete leases of a dead or replaced epoch at
once (`LeaseDesk.reissue_server`); its samples that arrive later are answered `late` and never
trained, because their groups are gone and the re-issued prompts get new group ids.

Only servers heard from are tracked: one that dies or hangs before its first heartbeat (while it
loads its model) is the launcher's to notice, by its child's end or by its epoch missing from
`report` for `launch.startup_timeout_s` (`asyncrl.launch.restarts.ServerRestarts`). The state is
bounded by the number of servers (a heartbeat's server_id must be its sender's own).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from asyncrl.wire.protocol import ServerHealth

HEALTH_COUNTERS = (
    "heartbeats",  # heartbeats taken (refused ones are `rejected_invalid`)
    "servers_declared_dead",  # epochs declared dead after server_timeout_s of silence
    "servers_declared_dead_by_learner",  # epochs the learner gave up on in a weight sync
    "server_epochs_replaced",  # epochs replaced by a newer one (the server restarted)
    "dead_server_leases",  # incomplete leases taken back from dead or replaced epochs
)
"""The replay's health counters (present as 0 from the start)."""

Verdict = Literal["alive", "replaced", "refused"]


@dataclass
class _Seen:
    epoch: int
    last_at: float  # monotonic time of its latest heartbeat or other message
    alive: bool = True


class FleetHealth:
    """Per server id: its latest epoch, when it was last heard from, whether it is alive."""

    def __init__(self, timeout_s: float, counters: Counter[str]) -> None:
        self.timeout_s = timeout_s
        self.counters = counters
        for name in HEALTH_COUNTERS:
            counters[name] += 0
        self._servers: dict[int, _Seen] = {}

    def observe(self, server_id: int, epoch: int, now: float) -> tuple[Verdict, str]:
        """A heartbeat of `server_id` at `epoch`: what it means (see the module docstring) and,
        when refused or replacing, why in words."""
        seen = self._servers.get(server_id)
        name = f"server_{server_id}"
        if seen is not None and (epoch < seen.epoch or (epoch == seen.epoch and not seen.alive)):
            state = "alive" if seen.alive else "declared dead"
            why = f"{name} epoch {epoch} is over: the replay knows epoch {seen.epoch} ({state})"
            return "refused", why
        self.counters["heartbeats"] += 1
        self._servers[server_id] = _Seen(epoch, now)
        if seen is None or epoch == seen.epoch:
            return "alive", ""
        self.counters["server_epochs_replaced"] += 1
        return "replaced", f"{name} epoch {seen.epoch} was replaced by epoch {epoch}"

    def touch(self, server_id: int, now: float) -> None:
        """Another message of `server_id` (a lease request, samples) at `now`: a sign of life of
        the epoch believed alive, if any (the message carries no epoch; see the module
        docstring). Counts nothing and creates no entry."""
        seen = self._servers.get(server_id)
        if seen is not None and seen.alive:
            seen.last_at = max(seen.last_at, now)

    def declare_silent(self, now: float) -> list[int]:
        """Declare dead every alive server silent for longer than `timeout_s`; their ids."""
        dead = [
            sid
            for sid, seen in self._servers.items()
            if seen.alive and now - seen.last_at > self.timeout_s
        ]
        for sid in dead:
            self._servers[sid].alive = False
            self.counters["servers_declared_dead"] += 1
        return dead

    def declare(self, server_id: int, epoch: int) -> bool:
        """Declare `epoch` of `server_id` dead now (the learner's `DeclareDead`); whether it was
        the epoch alive (an epoch already dead or replaced, or not heard from, is left alone)."""
        seen = self._servers.get(server_id)
        if seen is None or seen.epoch != epoch or not seen.alive:
            return False
        seen.alive = False
        self.counters["servers_declared_dead_by_learner"] += 1
        return True

    def epochs(self) -> dict[int, int]:
        """server id -> epoch, of the servers alive now (declared-dead ones left out)."""
        return {sid: seen.epoch for sid, seen in self._servers.items() if seen.alive}

    def report(self, now: float, in_flight: Callable[[int], int]) -> list[ServerHealth]:
        """Every server heard from, by id, with its incomplete leases (`in_flight(id)`): the
        `Stats` reply's `servers` (`silent_s`: since its latest heartbeat or other message)."""
        return [
            ServerHealth(sid, seen.epoch, seen.alive, round(now - seen.last_at, 3), in_flight(sid))
            for sid, seen in sorted(self._servers.items())
        ]
