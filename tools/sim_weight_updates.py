"""`rollout.weight_update_mode` in the pipeline model: `drain` vs `inflight` weight updates.

Extends `asyncrl.analysis.pipeline_model` (whose engine applies a version between static
batches, or between decode steps of a continuous one, without any other cost) with the two
modes of the rollout servers (docs/pipeline.md, "When a version reaches a busy engine"), read
from the fleet's `rollout.weight_update_mode`; it supplies the model's engine-rule hooks:
1. The engine's rows decode in steps costing `gen_step_s + gen_seq_step_s * live rows`;
   `static` admits queued rows only into an empty batch (the HF engine's batches), `continuous`
   at every step while fewer than `rollout.hf.max_batch_size` rows are live; admitting costs one
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
from typing import cast

from asyncrl.analysis import pipeline_model as pm
from asyncrl.analysis import pipeline_server as ps
from asyncrl.analysis.pipeline_inputs import Costs, Fleet


@dataclass(frozen=True)
class RecomputeCosts:
    """What rebuilding the live rows' KV cache after an in-flight apply costs."""

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
class _Seq(ps.Seq):
    length: int = 0  # tokens in all
    versions: int = 1  # versions its tokens span so far


class _ModeServer(ps.Server):
    """A server whose engine follows `rollout.weight_update_mode` (the module docstring's
    points), through the model's engine-rule hooks. Its rows are this module's `_Seq`s."""

    sim: _ModeSimulation

    def __init__(self, sim: _ModeSimulation, sid: int):
        super().__init__(sim, sid)
        self.staged_at = 0.0
        self.recompute_due = False

    def _new_seq(self, group: ps.Group, length: int) -> _Seq:
        return _Seq(group, length, length)

    def _inflight(self) -> bool:
        return self.sim.cfg.rollout.weight_update_mode == "inflight"

    def _samples_whole_batches(self) -> bool:
        return False  # static batches too decode step by step: an inflight apply stops them

    def _may_admit(self) -> bool:
        if self.staged is not None and not self._inflight():
            return False  # drain: no new rows until the version is applied
        if self.sim.fleet.static_batches:
            return not self.live
        return len(self.live) < self.sim.cfg.rollout.hf.max_batch_size

    def _apply_due(self) -> bool:
        return self.staged is not None and (self._inflight() or not self.live)

    def _resume_cost_s(self) -> float:
        """inflight: rebuild the live rows' cache under the version just applied."""
        if not self.recompute_due:
            return 0.0
        self.recompute_due = False
        c, r = self.sim.costs, self.sim.recompute
        tokens = sum(c.prompt_tokens + s.length - s.left for s in _rows(self.live))
        return r.recompute_s + r.recompute_token_s * tokens

    def receive(self, version: int) -> None:
        self.staged_at = self.sim.now
        super().receive(version)

    def _applied(self, version: int, start: float) -> None:
        sim = self.sim
        sim.stalls.append((sim.now, sim.now - (start if self._inflight() else self.staged_at)))
        for s in _rows(self.live):
            s.versions += 1
        self.recompute_due = bool(self.live)
        super()._applied(version, start)

    def _finish(self, seqs: list[ps.Seq]) -> None:
        self.sim.finished += [(self.sim.now, s.versions) for s in _rows(seqs)]
        super()._finish(seqs)


def _rows(seqs: list[ps.Seq]) -> list[_Seq]:
    """`seqs` as this module's rows: a `_ModeServer` makes every one of them (`_new_seq`)."""
    return cast(list[_Seq], seqs)


class _ModeSimulation(pm.Simulation):
    server_type = _ModeServer

    def __init__(self, fleet: Fleet, costs: Costs, recompute: RecomputeCosts, seed: int):
        super().__init__(fleet, costs, seed)
        self.recompute = recompute
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
    fleet: Fleet,
    costs: Costs,
    recompute: RecomputeCosts,
    steps: int = 200,
    warmup: int = 20,
    seed: int = 0,
) -> ModeResult:
    """The pipeline model with the fleet's `rollout.weight_update_mode` (the module docstring)."""
    return _ModeSimulation(fleet, costs, recompute, seed).run(steps, warmup)


@dataclass
class ModeMeans:
    """Means of `ModeResult`s over seeds."""

    samples_per_s: float
    server_idle: float
    stall_per_sync_s: float
    multi_version_frac: float
    runs: list[ModeResult] = field(default_factory=list, repr=False)


def mean_mode(
    fleet: Fleet, costs: Costs, recompute: RecomputeCosts, steps: int, warmup: int, seeds: int
) -> ModeMeans:
    runs = [simulate_mode(fleet, costs, recompute, steps, warmup, seed) for seed in range(seeds)]
    return ModeMeans(
        samples_per_s=statistics.fmean(r.samples_per_s for r in runs),
        server_idle=statistics.fmean(r.server_idle for r in runs),
        stall_per_sync_s=statistics.fmean(r.stall_per_sync_s for r in runs),
        multi_version_frac=statistics.fmean(r.multi_version_frac for r in runs),
        runs=runs,
    )
