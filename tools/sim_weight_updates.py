"""`rollout.weight_update_mode` in the pipeline model: `drain` vs `inflight` weight updates.

Extends `asyncrl.analysis.pipeline_model` (whose engine applies a version between static
batches, or between decode steps of a continuous one, without any other cost) with the two
modes of the rollout servers (docs/pipeline.md, "When a version reaches a busy engine"):
1. The engine's rows decode in steps costing `gen_step_s + gen_seq_step_s * live rows`;
   `static` admits queued rows only into an empty batch (the HF engine's batches), `continuous`
   at every step while fewer than `max_batch_size` rows are live; admitting costs one
   `gen_batch_s` (prefill).
2. `drain`: a received version stops admission; the live rows decode to their ends, then the
   version applies (`apply_s`) and admission resumes. The stall of a sync is from the version's
   arrival until it is applied (what the server's `apply_s` measures in drain mode).
3. `inflight`: the version applies at the next step boundary (`apply_s`, the stall), then the
   live rows' KV cache is rebuilt under it (`rollout.inflight_kv=recompute`): one forward over
   every live row's prompt and tokens so far, costing `recompute_s + recompute_token_s *
   tokens` of busy time, not stall (as the HF engine counts it). A row live across an apply
   spans two versions (`multi_version_frac`); staleness is still judged by its first token.
Not modelled: the KV cache's memory, attention's growth with the prefix length.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal

from asyncrl.analysis import pipeline_model as pm


@dataclass(frozen=True)
class WeightUpdate:
    """How a version reaches a busy engine, and what the in-flight recompute costs."""

    mode: Literal["drain", "inflight"] = "drain"
    recompute_s: float = 0.0
    """Per recompute (a forward over the live rows), whatever their tokens."""
    recompute_token_s: float = 0.0
    """Per token (prompt and sampled) of the live rows, in one recompute."""


@dataclass
class ModeResult(pm.Result):
    stall_per_sync_s: float = 0.0
    """Mean over the versions applied in the steady window of what each one held back
    generation (drain: arrival to applied; inflight: the apply itself)."""
    multi_version_frac: float = 0.0
    """Share of the samples finished in the steady window whose tokens span versions."""
    syncs: int = 0


@dataclass(eq=False)
class _Seq(pm._Seq):
    length: int = 0  # tokens in all
    versions: int = 1  # versions its tokens span so far


class _ModeServer(pm._Server):
    """A server whose engine follows `sim.update.mode` (the module docstring's points)."""

    def __init__(self, sim: _ModeSimulation, sid: int):
        super().__init__(sim, sid)
        self.staged_at = 0.0
        self.recompute_due = False

    def on_grant(self, groups: list[pm._Group]) -> None:
        self.asking -= 1
        self.active += len(groups)
        fleet = self.sim.fleet
        for g in groups:
            g.lengths = [fleet.lengths.sample(self.sim.rng) for _ in range(fleet.n)]
            self.queue.extend(_Seq(g, length, length) for length in g.lengths)
        self.maybe_ask()
        self.kick()

    def receive(self, version: int) -> None:
        self.staged_at = self.sim.now
        super().receive(version)

    def _inflight(self) -> bool:
        return self.sim.update.mode == "inflight"

    def _may_admit(self) -> bool:
        if self.staged is not None and not self._inflight():
            return False  # drain: no new rows until the version is applied
        if self.sim.fleet.engine == "static":
            return not self.live
        return len(self.live) < self.sim.fleet.max_batch_size

    def _apply_due(self) -> bool:
        return self.staged is not None and (self._inflight() or not self.live)

    def kick(self) -> None:
        if self.state == "decode":
            if (self.staged is not None and self._inflight()) or (self.queue and self._may_admit()):
                self._interrupt()
            return
        if self.state != "idle":
            return
        if self._apply_due():
            self.state = "apply"
            self.sim.after(self.sim.costs.apply_s, self._applied, self.sim.now)
        elif self.queue or self.live:
            self.state, self.busy_since = "decode", self.sim.now
            self._segment()

    def _applied(self, start: float) -> None:
        sim = self.sim
        sim.spans.append(("apply", self.sid, start, sim.now))
        sim.stalls.append((sim.now, sim.now - (start if self._inflight() else self.staged_at)))
        for s in self.live:
            s.versions += 1
        self.recompute_due = bool(self.live)
        self.version, self.staged, self.state = self.staged, None, "idle"
        sim.on_applied(self)
        self.kick()

    def _segment(self) -> None:
        c, u = self.sim.costs, self.sim.update
        prefill = 0.0
        if self.recompute_due:  # inflight: rebuild the live rows' cache under the new version
            tokens = sum(c.prompt_tokens + s.length - s.left for s in self.live)
            prefill += u.recompute_s + u.recompute_token_s * tokens
            self.recompute_due = False
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
        prefill += c.gen_batch_s if admitted else 0.0
        self.seg_start = self.sim.now + prefill
        self.seg_cost = c.gen_step_s + c.gen_seq_step_s * len(self.live)
        self.seg_steps = min(s.left for s in self.live)
        self.epoch += 1
        self.sim.after(prefill + self.seg_steps * self.seg_cost, self._segment_end, self.epoch)

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
            self.kick()  # applies; the `kick` after the apply resumes decoding
        else:
            self._segment()

    def _finish(self, seqs: list[_Seq]) -> None:
        self.sim.finished += [(self.sim.now, s.versions) for s in seqs]
        super()._finish(seqs)


class _ModeSimulation(pm.Simulation):
    def __init__(self, fleet: pm.Fleet, costs: pm.Costs, update: WeightUpdate, seed: int):
        super().__init__(fleet, costs, seed)
        self.update = update
        self.servers = [_ModeServer(self, i) for i in range(fleet.servers)]
        self.stalls: list[tuple[float, float]] = []  # (applied at, stall)
        self.finished: list[tuple[float, int]] = []  # (finished at, versions spanned)

    def run(self, steps: int, warmup: int) -> ModeResult:
        base = super().run(steps, warmup)
        lo, hi = self.step_ends[warmup - 1], self.step_ends[-1]
        stalls = [s for t, s in self.stalls if lo <= t <= hi]
        spans = [v for t, v in self.finished if lo <= t <= hi]
        return ModeResult(
            **vars(base),
            stall_per_sync_s=statistics.fmean(stalls) if stalls else 0.0,
            multi_version_frac=sum(v > 1 for v in spans) / max(1, len(spans)),
            syncs=len(stalls),
        )


def simulate_mode(
    fleet: pm.Fleet,
    costs: pm.Costs,
    update: WeightUpdate,
    steps: int = 200,
    warmup: int = 20,
    seed: int = 0,
) -> ModeResult:
    """The pipeline model with `update`'s weight-update mode (see the module docstring)."""
    return _ModeSimulation(fleet, costs, update, seed).run(steps, warmup)


@dataclass
class ModeMeans:
    """Means of `ModeResult`s over seeds."""

    samples_per_s: float
    server_idle: float
    stall_per_sync_s: float
    multi_version_frac: float
    runs: list[ModeResult] = field(default_factory=list, repr=False)


def mean_mode(
    fleet: pm.Fleet, costs: pm.Costs, update: WeightUpdate, steps: int, warmup: int, seeds: int
) -> ModeMeans:
    runs = [simulate_mode(fleet, costs, update, steps, warmup, seed) for seed in range(seeds)]
    return ModeMeans(
        samples_per_s=statistics.fmean(r.samples_per_s for r in runs),
        server_idle=statistics.fmean(r.server_idle for r in runs),
        stall_per_sync_s=statistics.fmean(r.stall_per_sync_s for r in runs),
        multi_version_frac=statistics.fmean(r.multi_version_frac for r in runs),
        runs=runs,
    )
