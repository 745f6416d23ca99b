"""A discrete-event model of the asyncrl pipeline (driven by `tools/simulate.py`, which also
calibrates it from `tools/bench_pipeline.py` runs; its inputs are `pipeline_inputs`).

It predicts throughput, idle ratios and staleness for fleets this machine cannot run. What it
models, each point mirroring the code (docs/simulator.md has the method and the figures):
1. Admission: `replay.admission.AdmissionController` itself, judged by the requesting server's
   engine version; held requests are answered in arrival order whenever anything changes, and
   empty after `replay.wait_timeout_s`.
2. A server keeps up to `rollout.max_concurrent_groups` groups, `rollout.n` sequences each, and
   has at most one lease request out, for the slots free when it asked, unless its engine moved
   to a new version (`RolloutServer.run`). Its engine samples what is queued as batches: `static`
   (the HF engine: a batch runs until its longest row ends, arrivals wait for the next) or
   `continuous` (vLLM-style: arrivals join at the next decode step). A decode step with b live
   rows costs `gen_step_s + gen_seq_step_s * b`.
3. Finished samples are scored by `reward.workers` workers per server; a group is done, frees
   its slot and goes to the replay when its last sample is scored.
4. A weight version applies between batches (static) or steps (continuous) and pauses the
   engine for `apply_s`; a sequence's version is the version its first token was sampled with.
5. The learner takes the oldest `data.train_batch_size` ready groups trainable at its version
   (stale ones are dropped, as the buffer does), trains for `train_step_s + train_token_s *
   tokens / (ranks * rank_efficiency)` (with `learner.packing=false`, tokens padded to the
   batch's longest sequence, as `learner.batch` pads), then broadcasts; a broadcast waits until
   every server has applied the previous version (a server's receiver thread is busy until
   then) and lasts `broadcast_s + broadcast_per_server_s * (servers - 1)`.
Not modelled: CPU sharing between processes (calibrate on a quiet machine), network
contention, lease expiry, evaluation jobs, multi-turn agent loops.

Points 2 to 4 are a server's, `asyncrl.analysis.pipeline_server.Server`; the rest, and the
event queue, are `Simulation`'s.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from asyncrl.analysis.pipeline_inputs import Costs, Fleet
from asyncrl.analysis.pipeline_server import Group, LeaseRequest, Server
from replay.admission import AdmissionController


@dataclass
class Result:
    samples_per_s: float
    step_time_s: float
    learner_idle: float
    """Fraction of the steady window the learner waited for a batch (fetch)."""
    server_idle: float
    """Fraction of the steady window an engine sampled nothing (mean over servers)."""
    server_pause: float
    """Fraction of the steady window an engine was paused applying weights."""
    staleness_hist: list[int]
    """Samples trained after the warm-up, per staleness (learner version - oldest token's
    version)."""
    stale_dropped: int
    spans: list[tuple[str, int, float, float]] = field(default_factory=list, repr=False)
    """(kind, server or -1, start, end): "generate", "apply", "train" (incl. the broadcast)."""

    @property
    def staleness_mean(self) -> float:
        total = sum(self.staleness_hist)
        return sum(i * c for i, c in enumerate(self.staleness_hist)) / max(total, 1)


class Simulation:
    """The replay (admission, buffer), M servers and the learner, on one event queue."""

    server_type: type[Server] = Server
    """What each server is (`tools/sim_weight_updates.py` supplies its own engine rules)."""

    def __init__(self, fleet: Fleet, costs: Costs, seed: int = 0):
        self.fleet, self.cfg, self.costs = fleet, fleet.cfg, costs
        self.rng = random.Random(seed)
        self.now = 0.0
        self._events: list[tuple[float, int, Any, tuple]] = []
        self._tie = itertools.count()
        self.admission = AdmissionController.from_config(self.cfg)
        self.servers = [self.server_type(self, i) for i in range(self.cfg.rollout.num_servers)]
        self.held_leases: list[LeaseRequest] = []  # in arrival order
        self.ready: list[tuple[int, Group]] = []  # sorted by issue index
        self.held = 0  # groups in flight plus ready (the buffer's length)
        self.issued_total = 0
        self.version = 0  # the learner's
        self.warmup = 1  # steps left out of the figures (set by `run`)
        self.fetching_since: float | None = None
        self.broadcast_due: list[Group] | None = None  # trained, waiting for the receivers
        self._train_start = 0.0
        self.step_ends: list[float] = []
        self.fetch_waits: list[float] = []
        self.staleness: Counter[int] = Counter()
        self.stale_dropped = 0
        self.spans: list[tuple[str, int, float, float]] = []

    def after(self, delay: float, fn, *args) -> None:
        heapq.heappush(self._events, (self.now + delay, next(self._tie), fn, args))

    def run(self, steps: int, warmup: int) -> Result:
        if not 1 <= warmup < steps:
            raise ValueError(f"need 1 <= warmup < steps, got warmup={warmup}, steps={steps}")
        self.warmup = warmup
        for s in self.servers:
            s.maybe_ask()
        self.fetching_since = 0.0
        while self._events and len(self.step_ends) < steps:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        if len(self.step_ends) < steps:
            raise RuntimeError(f"the pipeline stalled after {len(self.step_ends)} steps")
        return self._result(warmup)

    # ---- replay ---------------------------------------------------------------------------
    def on_lease_request(self, server: Server, version: int, wanted: int) -> None:
        """A request supersedes the server's held one (answered empty), is granted what
        admission allows, or is held until it can be, or until `wait_timeout_s`."""
        for held in [h for h in self.held_leases if h.server is server]:
            self.held_leases.remove(held)
            self._answer(server, [])
        request = LeaseRequest(server, version, wanted)
        if not self._maybe_grant(request):
            self.held_leases.append(request)
            self.after(self.cfg.replay.wait_timeout_s, self._lease_timeout, request)

    def _maybe_grant(self, request: LeaseRequest) -> bool:
        server = request.server
        k = self.admission.grantable(request.version, request.wanted, self.held)
        if k == 0:
            return False
        self.admission.on_issued(k)
        self.held += k
        n = self.cfg.rollout.n
        groups = [Group(self.issued_total + i, server, n) for i in range(k)]
        self.issued_total += k
        self._answer(server, groups)
        return True

    def _answer(self, server: Server, groups: list[Group]) -> None:
        self.after(self.costs.lease_s / 2, server.on_grant, groups)

    def _answer_held(self) -> None:
        self.held_leases = [h for h in self.held_leases if not self._maybe_grant(h)]

    def _lease_timeout(self, request: LeaseRequest) -> None:
        if request in self.held_leases:
            self.held_leases.remove(request)
            self._answer(request.server, [])

    def on_ready(self, group: Group) -> None:
        bisect.insort(self.ready, (group.index, group), key=lambda x: x[0])
        self._maybe_serve()
        self._answer_held()

    # ---- learner --------------------------------------------------------------------------
    def _maybe_serve(self) -> None:
        if self.fetching_since is None:
            return
        bound = self.cfg.replay.max_staleness
        stale = [x for x in self.ready if self.version - min(x[1].versions) > bound]
        if stale:
            self.ready = [x for x in self.ready if x not in stale]
            self.admission.on_never_trained(len(stale))
            self.held -= len(stale)
            self.stale_dropped += len(stale)
        b = self.cfg.data.train_batch_size
        if len(self.ready) < b:
            if stale:
                self._answer_held()
            return
        batch = [g for _, g in self.ready[:b]]
        del self.ready[:b]
        self.held -= b
        self.fetch_waits.append(self.now - self.fetching_since)
        self.fetching_since = None
        self._answer_held()
        self.after(self.costs.fetch_s + self._train_time(batch), self._trained, batch, self.now)

    def _train_time(self, batch: list[Group]) -> float:
        lengths = [x for g in batch for x in g.lengths]
        p, c, f = self.costs.prompt_tokens, self.costs, self.fleet
        longest = max(lengths) if f.padded_training else statistics.fmean(lengths)
        tokens = len(lengths) * (p + longest)
        ranks = self.cfg.learner.world_size * f.rank_efficiency
        return c.train_step_s + c.train_token_s * tokens / ranks

    def _trained(self, batch: list[Group], start: float) -> None:
        if len(self.step_ends) >= self.warmup:
            for g in batch:
                for v in g.versions:
                    self.staleness[self.version - v] += 1
        self.broadcast_due = batch
        self._train_start = start
        self._maybe_broadcast()

    def on_applied(self, server: Server) -> None:
        server.maybe_ask()  # a server asks again the moment its engine moves on
        self._maybe_broadcast()

    def _maybe_broadcast(self) -> None:
        if self.broadcast_due is None or any(s.staged is not None for s in self.servers):
            return
        self.broadcast_due = None
        c = self.costs
        self.after(c.broadcast_s + c.broadcast_per_server_s * (len(self.servers) - 1), self._sent)

    def _sent(self) -> None:
        self.spans.append(("train", -1, self._train_start, self.now))
        self.version += 1
        for s in self.servers:
            s.receive(self.version)
        self.step_ends.append(self.now)
        self.fetching_since = self.now
        self._maybe_serve()

    def _result(self, warmup: int) -> Result:
        lo, hi = self.step_ends[warmup - 1], self.step_ends[-1]
        steps = len(self.step_ends) - warmup
        window = hi - lo

        busy: defaultdict[tuple[str, int], float] = defaultdict(float)
        for kind, sid, start, end in self.spans:
            busy[kind, sid] += max(0.0, min(end, hi) - max(start, lo))
        gen = [busy["generate", s.sid] for s in self.servers]
        pause = [busy["apply", s.sid] for s in self.servers]
        hist = [self.staleness[i] for i in range(max(self.staleness, default=0) + 1)]
        return Result(
            samples_per_s=steps * self.cfg.data.train_batch_size * self.cfg.rollout.n / window,
            step_time_s=window / steps,
            learner_idle=sum(self.fetch_waits[warmup:]) / window,
            server_idle=1.0 - statistics.fmean(gen) / window,
            server_pause=statistics.fmean(pause) / window,
            staleness_hist=hist,
            stale_dropped=self.stale_dropped,
            spans=self.spans,
        )


def simulate(fleet: Fleet, costs: Costs, steps: int = 200, warmup: int = 20, seed: int = 0):
    """Run the model for `steps` learner steps; figures are over the steps after `warmup`."""
    return Simulation(fleet, costs, seed).run(steps, warmup)
