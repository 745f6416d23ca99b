"""Dynamic sampling (DAPO; the `filter_groups` option of verl's algorithm section), done in the
replay: a group whose metric is the same for all its samples (all rewards 0, or all 1) gives
every sample the same advantage under GRPO, so it carries no signal and never takes a slot in a
batch.

When a training group completes (its last sample accepted), `GroupFilter.maybe_drop` looks at
its `replay.filter_groups.metric` over its n samples; with zero variance (std == 0) the group
is dropped from the buffer there and then, counted (`groups_filtered`, `samples_filtered`), and
reported to admission as never trained, so its slot is free at once and leasing goes on until
the batch is full.

Invariants (tested in tests/unit/test_group_filter.py):
- No zero-variance group enters a batch while the step's bound is not hit: it leaves the
  buffer the moment it becomes ready, before any batch request can see it.
- A filtered group costs nothing against the other groups' staleness budget: admission counts
  it as never issued (`AdmissionController.on_never_trained`), exactly as a stale or expired
  one, so it neither moves the window nor waits in the buffer in front of a ready group.
- A group of one sample (n = 1) is kept: its std says nothing (verl keeps it too).

Departures from verl:
1. verl regenerates whole generation batches until enough groups qualify; here groups are
   judged one by one as they complete, and the fleet never stops generating.
2. The bound (`max_filtered_per_step`, in groups; verl's `max_num_gen_batches` counts
   generation batches) does not fail the run as verl's does: past it, the step's batch takes
   the next ready groups unfiltered, with a warning and `filter_bound_hit` in its record. A
   fleet that generates continuously reaches the bound when the policy has solved (or cannot
   solve) nearly every prompt, typically late in a long run; there a zero-variance group is
   harmless (zero advantage, no gradient), and killing a run hours in would lose more than
   the wasted step costs. The metric and the log line say the data no longer teaches.
3. A group whose samples lack the metric (a metric name no reward function returns) is kept
   and counted (`filter_metric_missing`) rather than failing the replay.

Wiring: built by `replay.components.setup_replay_components` over the buffer, the admission
controller and the counters; the service asks it after every accepted training sample, and
the batch desk takes each step's metrics from it (`for_batch`).
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from asyncrl.config.replay import FilterGroupsConfig
from replay.admission import AdmissionController
from replay.buffer import Group, GroupBuffer

log = logging.getLogger("asyncrl.replay")

SEQ_REWARD = "seq_reward"
"""The metric that is each sample's reward (`Trajectory.reward`), as in verl."""


def group_metric(group: Group, metric: str) -> list[float] | None:
    """The metric of each of a complete group's samples (None: a sample lacks it)."""
    samples = group.complete_samples()
    if metric == SEQ_REWARD:
        return [s.reward for s in samples]
    values = [s.metrics.get(metric) for s in samples]
    return None if any(v is None for v in values) else [float(v) for v in values]  # type: ignore[arg-type]


class GroupFilter:
    """Drops zero-variance groups as they complete (see the module docstring)."""

    def __init__(
        self,
        cfg: FilterGroupsConfig,
        buffer: GroupBuffer,
        admission: AdmissionController,
        counters: Counter[str],
    ) -> None:
        self.cfg = cfg
        self.buffer = buffer
        self.admission = admission
        self.counters = counters
        self._step_groups = 0  # groups dropped since the last batch was served
        self._step_samples = 0
        self._bound_hit = False  # the step's bound was reached: groups pass unfiltered

    def maybe_drop(self, group_id: str) -> bool:
        """After a training sample of `group_id` was accepted: drop its group if it is now
        complete and its metric does not vary (True), else leave it (False)."""
        group = self.buffer.ready_group(group_id) if self.cfg.enable else None
        if group is None or len(group.samples) < 2:
            return False
        values = group_metric(group, self.cfg.metric)
        if values is None:
            self.counters["filter_metric_missing"] += 1
            if self.counters["filter_metric_missing"] == 1:
                log.warning(
                    "replay.filter_groups.metric=%r: group %s has a sample without it; groups "
                    "without it are kept (counted in filter_metric_missing)",
                    self.cfg.metric,
                    group_id,
                )
            return False
        if float(np.std(values)) > 0:
            return False
        bound = self.cfg.max_filtered_per_step
        if bound and self._step_groups >= bound:
            self._on_bound_hit()
            return False
        self.buffer.drop_ready(group_id)
        self.admission.on_never_trained(1)
        self.counters["groups_filtered"] += 1
        self.counters["samples_filtered"] += len(values)
        self._step_groups += 1
        self._step_samples += len(values)
        return True

    def _on_bound_hit(self) -> None:
        self.counters["filter_groups_passed"] += 1
        if self._bound_hit:
            return
        self._bound_hit = True
        self.counters["filter_bound_hits"] += 1
        log.warning(
            "replay.filter_groups: %d groups filtered for this step (max_filtered_per_step=%d): "
            "the step takes the next ready groups unfiltered; nearly every prompt gives its "
            "samples equal %s (the data no longer teaches this policy)",
            self._step_groups,
            self.cfg.max_filtered_per_step,
            self.cfg.metric,
        )

    def for_batch(self, groups: int, samples: int) -> dict[str, float]:
        """The filter's metrics for a step whose batch holds `groups` groups of `samples`
        samples (nothing when the filter is off); the next step's count starts from 0."""
        if not self.cfg.enable:
            return {}
        stats = {
            "filter_groups_dropped": float(self._step_groups),
            "filter_groups_frac": self._step_groups / max(1, self._step_groups + groups),
            "filter_extra_samples_per_trained": self._step_samples / max(1, samples),
            "filter_bound_hit": float(self._bound_hit),
        }
        self._step_groups = self._step_samples = 0
        self._bound_hit = False
        return stats
