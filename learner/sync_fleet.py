"""Learner rank 0's side of the weight sync: who receives each version.

Every rollout server epoch (its n-th start, counted from 0 by the launcher) is a member with a
2-member group of its own (`asyncrl.weights.sync`), keyed (server id, epoch). Why one group per
server and not one group of all: a group re-formed under a new epoch needs every live member to
stop and rendezvous again, and one hung member blocks a collective for all; separate groups keep
a death or a hang to its own group. The price: rank 0 sends one copy per server.

Before each version `SyncFleet.broadcast` asks the replay which epoch of each server is alive
(`server_epochs`) and joins every epoch newer than the one it has (or has tried) for that
server: it waits for the epoch's `ready` key, answers `join` and builds the group. A server not
ready within the bound is answered `abandon` and left out (it fails; the launcher restarts it
as the next epoch, which is joined then). The first version joins epoch 0 of every configured
server (or a newer epoch the replay lists), waiting up to `launch.startup_timeout_s` (servers
still loading their model); later joins wait up to `launch.server_timeout_s`. A new member
receives that version in full (every version is the full weights), then every later one.

A server may also restart while the learner waits for a batch, and with one server (the
default) no batch comes until it has weights: the restarted epoch takes no lease before its
first version (`rollout_servers.server`), and the replay would grant none to its stale weights
anyway. So while it waits, learner rank 0 asks `joins_waiting` (about once a second): an epoch
the replay lists and has not been tried, whose `ready` is set, stops the wait, and every rank
gathers the current version for `catch_up`, which joins it and sends that version to it alone
(the other members hold it already). An epoch listed for the join bound without its `ready`
is answered `abandon` there (it fails; the launcher restarts it or, its restarts used up,
drops it and, with no server left, ends the run naming it and why: `asyncrl.launch.restarts`).

A member whose collective fails (its process died: noticed at once) or does not complete
within `launch.startup_timeout_s` is dropped for good. A hung or SIGSTOPped server is dropped
much sooner: while a wait on it lasts, the broadcast asks the replay every second how long it
has been silent (`server_health`), and gives up on it once that reaches `launch.sync_give_up_s`
(10 s, capped at `server_timeout_s`; a healthy server's event loop heartbeats every 2 s even
while it drains or receives), or once the replay has declared it dead. The op bound is long on
purpose: in drain mode a healthy server takes the next version only once its responses in
flight end, which can take longer than `server_timeout_s`; silence, not slowness, is what
gives a member up. The version still reaches the other members and training goes on. Every
dropped member is declared dead at the replay (`declare_dead`), so its leases are re-issued and
the launcher restarts it at once (a frozen one would otherwise hold them until
`server_timeout_s`). A newer epoch of the same server replaces it. Each join and drop is a line
in the learner's log and a record of `run_dir/sync_members.jsonl`: {time, event (joined |
dropped | not_joined), server, epoch, version, reason}.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.config import Config
from asyncrl.config.weight_transport import TransportChoice
from asyncrl.metrics import JsonlWriter
from asyncrl.run_spec import RunSpec
from asyncrl.weights.group import SyncGroup, answer, learner_member_store, read_place
from asyncrl.weights.layout import ParamSpec
from asyncrl.weights.probe import DeliveryProbe
from asyncrl.weights.sealed_store import SealedStore
from asyncrl.weights.shm import shm_free_bytes, sweep_dead_segments
from asyncrl.weights.sync import WeightBroadcaster
from asyncrl.weights.transports import choose_transport, place_of
from asyncrl.wire.auth import RoleKey, key_from_env
from asyncrl.wire.binds import bind_collectives_to, setup_store
from asyncrl.wire.protocol import ServerHealth

log = logging.getLogger("asyncrl.learner")

POLL_S = 0.05
"""How often a join looks for `ready` keys."""
EPOCHS_POLL_S = 1.0
"""How often a join asks the replay again (a server restarted while it waited)."""


@dataclass(frozen=True, kw_only=True)
class SyncFleetSpec:
    """What learner rank 0's weight sync is told, read once (`from_config`)."""

    host: str  # the sync host: the store and every member's group listen there
    port: int  # the store's port, on which each server epoch joins
    num_servers: int  # rollout.num_servers: the first version joins epoch 0 of each
    device: torch.device  # where learner rank 0's weights are
    bucket_bytes: int  # learner.bucket_mb, in bytes: the size of a bucket
    timeout_s: float  # a later join waits this long (launch.server_timeout_s)
    first_join_s: float  # the first version's join waits this long (launch.startup_timeout_s)
    op_timeout_s: float | None = None  # a member's collective may take this long (None: timeout_s)
    give_up_s: float = float("inf")  # a member silent this long in the replay's report is given up
    transport: TransportChoice = "auto"  # launch.weight_transport (each member's: `_join`)

    @classmethod
    def from_config(cls, cfg: Config, spec: RunSpec, device: torch.device) -> SyncFleetSpec:
        """Learner rank 0's for a run: the sync port of `spec`, the launch section's timeouts."""
        return cls(
            host=spec.sync_host,
            port=spec.sync_port,
            num_servers=cfg.rollout.num_servers,
            device=device,
            bucket_bytes=int(cfg.learner.bucket_mb * 2**20),
            timeout_s=cfg.launch.server_timeout_s,
            first_join_s=cfg.launch.startup_timeout_s,
            op_timeout_s=max(cfg.launch.server_timeout_s, cfg.launch.startup_timeout_s),
            give_up_s=min(cfg.launch.sync_give_up_s, cfg.launch.server_timeout_s),
            transport=cfg.launch.weight_transport,
        )


class SyncFleet:
    """The members of the weight sync and the broadcast of each version to them."""

    def __init__(
        self,
        *,
        spec: SyncFleetSpec,
        server_epochs: Callable[[], dict[int, int]],
        learner_key: RoleKey,
        events: JsonlWriter | None = None,
        health: Callable[[], list[ServerHealth]] | None = None,
        declare_dead: Callable[[int, int, str], None] | None = None,
    ):
        """`server_epochs`: server id -> epoch of each server alive now (the replay's view).
        `learner_key`: the learner's role key, from which each member's sync key is derived:
        every entry of a join is sealed with it (`asyncrl.weights.sealed_store`: a process
        without the run's keys can neither read nor forge one). `events`: the record of joins
        and drops. `health`: the replay's report of every server (`ReplayClient.server_health`),
        asked while a wait lasts (None: a member is waited for up to the op bound).
        `declare_dead(server, epoch, reason)`: told of every member dropped."""
        self.spec, self.timeout_s = spec, spec.timeout_s
        self.op_timeout_s = spec.op_timeout_s or spec.timeout_s
        self.server_epochs, self.events = server_epochs, events
        self.health, self.declare_dead = health, declare_dead
        self.place, self.learner_key = place_of(spec.device), learner_key
        sweep_dead_segments()  # what a SIGKILLed learner before this one left in /dev/shm
        self._version_bytes = 0  # of the version being sent (whether /dev/shm can hold one)
        self._promised_shm = 0  # bytes of /dev/shm slots promised at joins, not yet made
        bind_collectives_to(spec.host)
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        self.store = setup_store(spec.host, spec.port, None, True, timeout)
        self.broadcaster = WeightBroadcaster[tuple[int, int]]({}, spec.bucket_bytes, spec.device)
        if health is not None:
            self.broadcaster.give_up = self._silent_members
        self._tried: dict[int, int] = {}  # server id -> newest epoch asked to join
        self._first = True
        self._listed_at: dict[tuple[int, int], float] = {}  # epochs waited for, since when
        self._next_look = 0.0  # when `joins_waiting` asks the replay again

    @property
    def members(self) -> dict[int, int]:
        """server id -> epoch of every member."""
        return dict(self.broadcaster.members.keys())  # keys: (server id, epoch)

    def broadcast(
        self,
        specs: list[ParamSpec],
        tensors: Iterator[torch.Tensor],
        version: int,
        probe: DeliveryProbe | None = None,
    ) -> dict[int, int]:
        """Join new server epochs, then send `version` to every member (`WeightBroadcaster`);
        returns the members that have it (server id -> epoch)."""
        self._version_bytes = self.broadcaster.plan(specs).slot_bytes
        self._promised_shm = 0  # every slot made so far is in /dev/shm's free space already
        self.maybe_join(version)
        self._drop(self.broadcaster.broadcast(specs, tensors, version, probe), version)
        return self.members

    def joins_waiting(self, version: int) -> bool:
        """Whether a server epoch waits to join now: listed by the replay, newer than the one
        held or tried for its server, its `ready` set (module docstring); asked while the
        learner waits for a batch at `version`, at most every `EPOCHS_POLL_S` (False between).
        Before the first version only restarted epochs count (the first broadcast joins every
        epoch 0). An epoch listed for `timeout_s` without its `ready` is abandoned here."""
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + EPOCHS_POLL_S
        try:
            listed = self.server_epochs()
        except Exception as e:  # no news: the batch wait goes on, and asks again
            log.warning("weight sync: could not ask the replay which servers are alive: %s", e)
            return False
        waiting = False
        for server, epoch in listed.items():
            if epoch <= self._tried.get(server, -1) or (self._first and epoch == 0):
                continue
            if self._member_store(server, epoch).check(["ready"]):
                waiting = True
                continue
            since = self._listed_at.setdefault((server, epoch), now)
            if now - since >= self.timeout_s:
                self._replace(server, epoch, version)
                self._abandon(server, epoch, version, f"not ready within {self.timeout_s:g} s")
        return waiting

    def catch_up(
        self,
        specs: list[ParamSpec],
        tensors: Iterator[torch.Tensor],
        version: int,
        probe: DeliveryProbe | None = None,
    ) -> dict[int, int]:
        """Join the server epochs waiting (`joins_waiting`) and send `version`, the one every
        other member holds already, to them alone; returns the members that joined and have it
        (server id -> epoch). `tensors` is drained whole whatever happens (a collective)."""
        self._version_bytes = self.broadcaster.plan(specs).slot_bytes
        self._promised_shm = 0
        before = set(self.broadcaster.members)
        self.maybe_join(version)
        new = [key for key in self.broadcaster.members if key not in before]
        failed = self.broadcaster.broadcast(specs, tensors, version, probe, only=new)
        self._drop(failed, version)
        return {server: epoch for server, epoch in new if (server, epoch) not in failed}

    def _drop(self, failed: dict[tuple[int, int], BaseException], version: int) -> None:
        """Record every member that failed a version, and have the replay declare it dead."""
        for (server, epoch), error in failed.items():
            reason = _reason(error, self.op_timeout_s)
            self._event("dropped", server, epoch, version, reason)
            if self.declare_dead is not None:
                try:
                    self.declare_dead(server, epoch, f"dropped from the weight sync: {reason}")
                except Exception as e:  # the replay's own silence rule still applies
                    log.warning("could not declare server %d epoch %d dead: %s", server, epoch, e)

    def _silent_members(self) -> dict[tuple[int, int], str]:
        """The members to stop waiting for, with why: silent for `give_up_s`, declared dead or
        replaced, in the replay's report. A member whose epoch the replay has not heard from
        yet is no news (nor is a replay that does not answer: the op timeout still bounds it)."""
        assert self.health is not None
        try:
            report = {s.server_id: s for s in self.health()}
        except Exception as e:
            log.warning("weight sync: could not ask the replay which servers are silent: %s", e)
            return {}
        out = {}
        for server, epoch in self.broadcaster.members:
            seen = report.get(server)
            if seen is None or seen.epoch < epoch:
                continue
            if seen.epoch > epoch:
                out[(server, epoch)] = f"epoch {seen.epoch} replaces it"
            elif not seen.alive:
                out[(server, epoch)] = "the replay declared it dead"
            elif seen.silent_s >= self.spec.give_up_s:
                bound = self.spec.give_up_s
                why = f"silent for {seen.silent_s:.1f} s (launch.sync_give_up_s {bound:g})"
                out[(server, epoch)] = why
        return out

    def maybe_join(self, version: int) -> None:
        """Join every server epoch newer than the one held, each waited for up to the bound
        (module docstring); all of them at once."""
        bound = self.spec.first_join_s if self._first else self.timeout_s
        waiting = self._wanted(version, first=self._first)
        self._first = False
        deadline = time.monotonic() + bound
        asked = time.monotonic()
        while waiting:
            for server, epoch in list(waiting.items()):
                store = self._member_store(server, epoch)
                if store.check(["ready"]):
                    del waiting[server]
                    self._join(server, epoch, store, version)
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
            if time.monotonic() - asked >= EPOCHS_POLL_S:  # restarted while we waited?
                asked = time.monotonic()
                for server, epoch in self._wanted(version, first=False).items():
                    if server in waiting:
                        self._abandon(server, waiting[server], version, f"epoch {epoch} is up")
                    waiting[server] = epoch
        for server, epoch in waiting.items():
            self._abandon(server, epoch, version, f"not ready within {bound:g} s")

    def shutdown(self) -> None:
        """Tell every member that no more versions will come."""
        for (server, epoch), error in self.broadcaster.shutdown().items():
            log.info("server %d epoch %d did not hear the shutdown: %s", server, epoch, error)

    def _wanted(self, version: int, first: bool) -> dict[int, int]:
        """Server epochs to join now: each newer than the one held or tried (the first time,
        epoch 0 of every configured server unless a newer one is listed). A member replaced
        by a newer epoch is dropped."""
        listed = self.server_epochs()
        if first:
            listed = {server: 0 for server in range(self.spec.num_servers)} | listed
        wanted = {s: e for s, e in listed.items() if e > self._tried.get(s, -1)}
        for server, epoch in wanted.items():
            self._replace(server, epoch, version)
        return wanted

    def _replace(self, server: int, epoch: int, version: int) -> None:
        """`epoch` is the newest of `server` tried from now on; a member of an older epoch of
        it is dropped."""
        self._tried[server] = epoch
        self._listed_at = {k: t for k, t in self._listed_at.items() if k[0] != server}
        for member in [m for m in self.broadcaster.members if m[0] == server]:
            self.broadcaster.members.pop(member).abort()
            self._event("dropped", server, member[1], version, f"epoch {epoch} replaces it")

    def _join(self, server: int, epoch: int, store: dist.Store, version: int) -> None:
        """Choose the member's transport from its place and answer; a place that cannot be
        read, or a forced transport that cannot join it, abandons it (its own failure)."""
        try:
            place = read_place(store)
            # /dev/shm as it is now, less the slots promised to members joined since the last
            # version (made at the next one): N servers need N versions of room
            free = shm_free_bytes()
            free = None if free is None else free - self._promised_shm
            here = dataclasses.replace(self.place, shm_free=free)
            wanted = self.spec.transport
            transport, why = choose_transport(here, place, wanted, self._version_bytes)
        except ValueError as e:  # a garbled place (ProtocolError), or no transport
            self._abandon(server, epoch, version, str(e))
            return
        answer(store, True, transport, why)
        if transport == "shm":
            self._promised_shm += self._version_bytes
        try:
            # connecting is bounded by the join bound: a server that died between `ready` and
            # the rendezvous must not hold the learner for the long op bound
            host, device = self.spec.host, self.spec.device
            group = SyncGroup(
                host, 0, 0, 2, device, self.timeout_s, store=store, transport=transport
            )
        except Exception as e:  # it left between `ready` and the rendezvous: its own failure
            self._event("not_joined", server, epoch, version, _reason(e, self.timeout_s))
            return
        group.set_op_timeout(self.op_timeout_s)
        self.broadcaster.members[(server, epoch)] = group
        self._event("joined", server, epoch, version, f"over {transport}: {why}", transport)

    def _member_store(self, server: int, epoch: int) -> SealedStore:
        """Server epoch (server, epoch)'s entries of the store, sealed with its sync key."""
        return learner_member_store(self.store, self.learner_key, server, epoch, self.timeout_s)

    def _abandon(self, server: int, epoch: int, version: int, reason: str) -> None:
        """Answer abandon, so that the server fails at once should it come later."""
        answer(self._member_store(server, epoch), False, "gloo", reason)
        self._event("not_joined", server, epoch, version, reason)

    def _event(
        self, event: str, server: int, epoch: int, version: int, reason: str, transport: str = ""
    ) -> None:
        """Log a join or a drop, and record it in `events` (module docstring)."""
        level = logging.INFO if event == "joined" else logging.WARNING
        why = f": {reason}" if reason else ""
        line = "weight sync: server %d epoch %d %s at version %d%s"
        log.log(level, line, server, epoch, event, version, why)
        if self.events is not None:
            record = dict(time=time.time(), event=event, server=server, epoch=epoch)
            self.events.write(record | dict(version=version, reason=reason, transport=transport))


def _reason(error: BaseException, timeout_s: float) -> str:
    """One line: gloo's message without its source location ("[.../pair.cc:537] ")."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", text)[:200]
    if "timed out" in text.lower() or "timeout" in text.lower():
        return f"no answer within {timeout_s:g} s ({text})"
    return text


def setup_sync_fleet(cfg: Config, spec: RunSpec, device: torch.device, replay) -> SyncFleet:
    """Learner rank 0's fleet for a run (`SyncFleetSpec.from_config`), asking `replay` which
    servers are alive and telling it which are dropped."""
    return SyncFleet(
        spec=SyncFleetSpec.from_config(cfg, spec, device),
        server_epochs=replay.server_epochs,
        learner_key=key_from_env("learner"),
        events=JsonlWriter(Path(spec.run_dir) / "sync_members.jsonl"),
        health=replay.server_health,
        declare_dead=replay.declare_dead,
    )


def as_sent(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A full tensor as the servers receive it (floating point in the engine's dtype)."""
    return t.to(dtype) if t.is_floating_point() else t


def sent_tensors(
    specs: list[ParamSpec],
    named: Iterable[tuple[str, torch.Tensor]],
    hashed: list | None = None,
) -> Iterator[torch.Tensor]:
    """The full tensors of one version in `specs` order (`named`: `learner.fsdp.sync_tensors`,
    a collective every learner rank drains in step), each cast to its spec's dtype later, while
    packed. With `hashed`, each is also appended to it as (name, copy as the servers receive
    it), for `weights_checksum`."""
    for spec, (name, t) in zip(specs, named, strict=True):
        if hashed is not None:
            hashed.append((name, as_sent(t, spec.dtype).cpu().clone()))
        yield t
