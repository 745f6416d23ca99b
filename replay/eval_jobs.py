"""Evaluation jobs: prompts that rollout servers sample but the learner never trains on.

An evaluator (`asyncrl eval`, or the learner's validation) submits a job of prompts; the replay
leases them before any training prompt, outside admission control (they cannot go stale: they
are never trained), and collects each returned sample's score instead of buffering it.
Invariant: an evaluation sample never reaches a training batch, and each is counted once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from asyncrl.protocol import EvalResults, PromptItem, Trajectory


@dataclass
class _Job:
    expected: int
    seen: set[str] = field(default_factory=set)
    group_ids: list[str] = field(default_factory=list)
    data_sources: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class EvalJobs:
    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._pending: deque[PromptItem] = deque()
        self._group_job: dict[str, tuple[str, str]] = {}  # group_id -> (job_id, data_source)

    def submit(self, job_id: str, prompts: list[PromptItem]) -> None:
        if job_id in self._jobs:
            raise ValueError(f"evaluation job {job_id!r} already exists")
        self._jobs[job_id] = _Job(expected=sum(p.n for p in prompts))
        for p in prompts:
            if p.eval_job != job_id:
                raise ValueError(f"prompt {p.group_id!r} is not marked for job {job_id!r}")
            self._group_job[p.group_id] = (job_id, p.data_source)
        self._pending.extend(prompts)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def take(self, k: int) -> list[PromptItem]:
        """Up to k prompts to lease, in submission order."""
        return [self._pending.popleft() for _ in range(min(k, len(self._pending)))]

    def owns(self, group_id: str) -> bool:
        return group_id in self._group_job

    def add(self, traj: Trajectory) -> Literal["accepted", "duplicate"]:
        job_id, source = self._group_job[traj.group_id]
        job = self._jobs[job_id]
        if traj.traj_id in job.seen:
            return "duplicate"
        job.seen.add(traj.traj_id)
        sampled = traj.versions[traj.loss_mask == 1]
        job.group_ids.append(traj.group_id)
        job.data_sources.append(source)
        job.scores.append(float(traj.reward))
        job.lengths.append(int(len(traj.response_ids)))
        job.versions.append(int(sampled.min()) if len(sampled) else -1)
        return "accepted"

    def results(self, request_id: int, job_id: str) -> EvalResults:
        job = self._jobs.get(job_id)
        if job is None:
            raise KeyError(job_id)
        return EvalResults(
            request_id=request_id,
            job_id=job_id,
            expected=job.expected,
            group_ids=job.group_ids,
            data_sources=job.data_sources,
            scores=np.asarray(job.scores, np.float32),
            response_lengths=np.asarray(job.lengths, np.int32),
            versions=np.asarray(job.versions, np.int32),
        )
