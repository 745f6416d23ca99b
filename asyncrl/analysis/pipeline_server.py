"""One rollout server of the pipeline model (`asyncrl.analysis.pipeline_model`, points 2 to 4
of its docstring): its engine's queue, live rows, reward workers and weight version, driven by
the model's `Simulation` through its event queue (what a server sees of it: `Pipeline`).

A server's engine rules are hooks (`Server._may_admit`, `_apply_due`, `_samples_whole_batches`,
`_resume_cost_s`, `_new_seq`) that `tools/sim_weight_updates.py` overrides to model
`rollout.weight_update_mode`.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.analysis.pipeline_inputs import Costs, Fleet
from asyncrl.config import Config


@dataclass(eq=False)
class Group:
    index: int  # issue order: the buffer hands out the oldest lease first
    server: Server
    left: int  # samples not yet scored
    versions: list[int] = field(default_factory=list)  # each sequence's first-token version
    lengths: list[int] = field(default_factory=list)


@dataclass(eq=False)
class LeaseRequest:
    server: Server
    version: int  # the server's engine version when it asked
    wanted: int


@dataclass(eq=False)
class Seq:
    group: Group
    left: int  # tokens still to sample


class Pipeline(Protocol):
    """What a server sees of the simulation that drives it (`pipeline_model.Simulation`): the
    clock, the event queue and the replay's and learner's entry points."""

    fleet: Fleet
    cfg: Config
    costs: Costs
    rng: random.Random
    now: float
    spans: list[tuple[str, int, float, float]]

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None: ...
    def on_lease_request(self, server: Server, version: int, wanted: int) -> None: ...
    def on_ready(self, group: Group) -> None: ...
    def on_applied(self, server: Server) -> None: ...


class Server:
    """One rollout server: its engine's queue, live rows and weight version. The engine's rules
    are the hooks below (this model's engine; `tools/sim_weight_updates.py` overrides them)."""

    def __init__(self, sim: Pipeline, sid: int):
        self.sim, self.sid = sim, sid
        self.version = 0
        self.staged: int | None = None  # received, not yet applied
        self.active = 0  # groups in flight here
        self.asking = 0  # lease requests not yet answered
        self.asked_version = -1
        self.scorers = [0.0] * sim.cfg.reward.workers  # when each reward worker is free
        self.queue: deque[Seq] = deque()
        self.live: list[Seq] = []
        self.state = "idle"  # idle | batch | decode | apply
        self.busy_since = 0.0
        self.epoch = 0  # invalidates a continuous segment's scheduled end
        self.seg_start = self.seg_cost = 0.0
        self.seg_steps = 0

    # ---- the engine's rules (hooks) -------------------------------------------------------
    def _new_seq(self, group: Group, length: int) -> Seq:
        """A sequence of `group` that will sample `length` tokens."""
        return Seq(group, length)

    def _samples_whole_batches(self) -> bool:
        """Whether queued rows run as one batch that ends with its longest row (static)."""
        return self.sim.fleet.static_batches

    def _may_admit(self) -> bool:
        """Whether queued rows may join the live ones at the next decode step."""
        return len(self.live) < self.sim.cfg.rollout.hf.max_batch_size

    def _apply_due(self) -> bool:
        """Whether the staged version applies at the next batch or step boundary."""
        return self.staged is not None

    def _resume_cost_s(self) -> float:
        """Busy time before a decode segment's steps, besides the prefill of admitted rows."""
        return 0.0

    # ---- leases and sampling --------------------------------------------------------------
    def maybe_ask(self) -> None:
        """Ask for leases when there is room and no request out, or the engine moved on (the
        rule of `RolloutServer.run`; a request asks for the slots free when it is sent)."""
        free = self.sim.cfg.rollout.max_concurrent_groups - self.active
        if free > 0 and (self.asking == 0 or self.asked_version != self.version):
            self.asking += 1
            self.asked_version = self.version
            delay = self.sim.costs.lease_s / 2
            self.sim.after(delay, self.sim.on_lease_request, self, self.version, free)

    def on_grant(self, groups: list[Group]) -> None:
        self.asking -= 1
        self.active += len(groups)
        rollout, sample = self.sim.cfg.rollout, self.sim.fleet.lengths.sample
        for g in groups:
            g.lengths = [sample(self.sim.rng, rollout.max_new_tokens) for _ in range(rollout.n)]
            self.queue.extend(self._new_seq(g, length) for length in g.lengths)
        self.maybe_ask()
        self.kick()

    def receive(self, version: int) -> None:
        self.staged = version
        self.kick()

    def kick(self) -> None:
        """Start whatever the engine can start now: weights first, then sampling."""
        if self.state == "decode":
            if self._apply_due() or (self.queue and self._may_admit()):
                self._interrupt()
            return
        if self.state != "idle":
            return
        if self._apply_due():
            self.state = "apply"
            self.sim.after(self.sim.costs.apply_s, self._applied, self.staged, self.sim.now)
        elif self.queue and self._samples_whole_batches():
            batch = [self.queue.popleft() for _ in range(min(len(self.queue), self._room()))]
            for s in batch:
                s.group.versions.append(self.version)
            c = self.sim.costs
            dur = (
                c.gen_batch_s
                + c.gen_step_s * max(s.left for s in batch)
                + c.gen_seq_step_s * sum(s.left for s in batch)
            )
            self.state = "batch"
            self.sim.after(dur, self._batch_done, batch, self.sim.now)
        elif self.queue or self.live:  # continuous: live rows resume after an apply
            self.state, self.busy_since = "decode", self.sim.now
            self._segment()

    def _room(self) -> int:
        return self.sim.cfg.rollout.hf.max_batch_size - len(self.live)

    def _applied(self, version: int, start: float) -> None:
        """`version` is applied (no newer one arrives meanwhile: a broadcast waits for it)."""
        self.sim.spans.append(("apply", self.sid, start, self.sim.now))
        self.version, self.staged, self.state = version, None, "idle"
        self.sim.on_applied(self)
        self.kick()

    def _batch_done(self, batch: list[Seq], start: float) -> None:
        self.sim.spans.append(("generate", self.sid, start, self.sim.now))
        self.state = "idle"
        self._finish(batch)
        self.kick()

    def _finish(self, seqs: list[Seq]) -> None:
        """Finished samples queue for the reward workers, in order."""
        for s in seqs:
            i = min(range(len(self.scorers)), key=self.scorers.__getitem__)
            self.scorers[i] = max(self.scorers[i], self.sim.now) + self.sim.costs.score_s
            self.sim.after(self.scorers[i] - self.sim.now, self._scored, s.group)

    def _scored(self, group: Group) -> None:
        group.left -= 1
        if group.left == 0:
            self.active -= 1
            self.sim.after(self.sim.costs.deliver_s, self.sim.on_ready, group)
            self.maybe_ask()

    # continuous batching: the live rows decode in segments that end when the first row ends
    def _segment(self) -> None:
        prefill = self._resume_cost_s()
        admitted = []
        if self._may_admit():
            admitted = [self.queue.popleft() for _ in range(min(len(self.queue), self._room()))]
        for s in admitted:
            s.group.versions.append(self.version)
        self.live += admitted
        if not self.live:
            self.sim.spans.append(("generate", self.sid, self.busy_since, self.sim.now))
            self.state = "idle"
            return
        c = self.sim.costs
        prefill += c.gen_batch_s if admitted else 0.0
        self.seg_start = self.sim.now + prefill
        self.seg_cost = c.gen_step_s + c.gen_seq_step_s * len(self.live)
        self.seg_steps = min(s.left for s in self.live)
        self.epoch += 1
        self.sim.after(prefill + self.seg_steps * self.seg_cost, self._segment_end, self.epoch)

    def _interrupt(self) -> None:
        """End the running segment at the next step boundary (new rows or weights wait)."""
        if self.seg_cost <= 0:
            return  # the segment ends now anyway
        done = math.floor(max(0.0, self.sim.now - self.seg_start) / self.seg_cost)
        steps = min(self.seg_steps, done + 1)
        if steps < self.seg_steps:
            self.seg_steps = steps
            self.epoch += 1
            at = self.seg_start + steps * self.seg_cost
            self.sim.after(at - self.sim.now, self._segment_end, self.epoch)

    def _segment_end(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        for s in self.live:
            s.left -= self.seg_steps
        finished = [s for s in self.live if s.left <= 0]
        self.live = [s for s in self.live if s.left > 0]
        self._finish(finished)
        if self._apply_due():
            self.sim.spans.append(("generate", self.sid, self.busy_since, self.sim.now))
            self.state = "idle"
            self.kick()  # applies; `kick` after the apply resumes decoding
        else:
            self._segment()
