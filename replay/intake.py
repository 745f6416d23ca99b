"""The sample intake: where one arriving sample goes, and the status it is acknowledged with.

A sample of an evaluation group goes to its job (`replay.eval_jobs`), checked first
(`replay.sample_checks`); any other goes to the buffer (`replay.buffer`, which checks it), and
a group it completes is shown to the group filter (`replay.group_filter`), which may drop it at
once. Each sample ends in exactly one counter: `accepted`, `duplicates`, `late`,
`eval_samples` or `untrainable`. An untrainable sample is acknowledged `rejected`, with why;
a sample of a `Trajectories` message is validated here on its own, so a bad one fails alone.

Wiring: built by `replay.components.setup_replay_components` over the buffer, the evaluation
jobs, the group filter and the counters; the service hands it every sample it receives.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Literal

from asyncrl.wire.samples import Trajectory
from asyncrl.wire.validation import ProtocolError, short_repr
from replay.buffer import AddStatus, GroupBuffer
from replay.eval_jobs import EvalJobs
from replay.group_filter import GroupFilter
from replay.sample_checks import MalformedTrajectory, check_trajectory

SampleStatus = Literal[AddStatus, "rejected"]
"""A sample's Ack status: where it went, or `rejected` (untrainable)."""
_ACK_COUNTERS = {"accepted": "accepted", "duplicate": "duplicates", "late": "late"}
_EVAL_COUNTERS = {"accepted": "eval_samples"}


class SampleIntake:
    """One sample into its group or evaluation job (see the module docstring)."""

    def __init__(
        self,
        buffer: GroupBuffer,
        eval_jobs: EvalJobs,
        group_filter: GroupFilter,
        counters: Counter[str],
    ) -> None:
        self.buffer = buffer
        self.eval_jobs = eval_jobs
        self.group_filter = group_filter
        self.counters = counters

    def take(self, traj: Trajectory, alone: bool = True) -> tuple[SampleStatus, str]:
        """(Ack status, why it is untrainable or ""). `alone`: the sample was its message, so
        the codec validated it already; a sample of a batch is validated here."""
        try:
            if not alone:
                traj.validate()
            if self.eval_jobs.owns(traj.group_id):
                check_trajectory(traj, self.buffer.limits)
                status = self.eval_jobs.add(traj, time.monotonic())
                self.counters[_EVAL_COUNTERS.get(status, _ACK_COUNTERS[status])] += 1
            else:
                status = self.buffer.add(traj)
                self.counters[_ACK_COUNTERS[status]] += 1
                if status == "accepted":  # its group may now be complete, and teach nothing
                    self.group_filter.maybe_drop(traj.group_id)
        except (MalformedTrajectory, ProtocolError) as e:
            self.counters["untrainable"] += 1
            return "rejected", f"trajectory {short_repr(traj.traj_id)}: {e}"
        return status, ""
