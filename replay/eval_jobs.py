"""Evaluation jobs: prompts that rollout servers sample but the learner never trains on.

An evaluator (`asyncrl eval`, or the learner's validation) submits a job of prompts; the replay
leases them before any training prompt, outside admission control (they cannot go stale: they
are never trained), and collects each returned sample's score instead of buffering it.
Invariant: an evaluation sample never reaches a training batch, and each is counted once: a
group's sample slot (its sample_index, below the prompt's n) is filled once, so no group gives
more than its n samples whatever ids they carry.

A large job arrives in parts (`EvalSubmit.more`: more parts follow), each under the sender's
size limit, so no one message takes the replay's loop for long; the job's prompts are leased as
its parts come, and it is not finished before its last part. A job belongs to the sender of its
first part (`owner`: its role and ZeroMQ identity): another sender's part or poll of it is refused
(`EvalForbidden`) and changes nothing. A part of its owner that is refused ends the job: it is
freed with the parts before it, and its id is remembered (the last MAX_REFUSED ids) so that any
later part or poll of it is refused too, naming why, instead of starting a smaller job.

Bounds: at most MAX_OPEN_JOBS unfinished jobs and MAX_JOB_SAMPLES samples per job, and at most
`max_bytes` (`replay.eval_jobs_mb`) of memory held by all the jobs kept (over any of them:
`EvalQuotaExceeded`, naming the bound). A job's memory is charged as it is submitted, by
`job_charge`: the wire bytes of its parts plus PROMPT_BYTES per prompt and SAMPLE_BYTES per
expected sample (what the decoded objects and the score records add to the wire bytes, measured
by tests/unit/test_eval_memory.py), and is given back when the job is freed. MAX_JOBS are kept
in all; a new job frees the oldest finished ones it needs room (or memory) for; a finished job is
freed FINISHED_KEEP_S after its last poll, and any job nobody has polled for `forget_after_s` is
freed with its unleased prompts (samples of a freed job arriving later are answered `late`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from asyncrl.wire.codec import MAX_HEADER_DEPTH, count_nodes
from asyncrl.wire.protocol import EvalResults, PromptItem
from asyncrl.wire.samples import Trajectory
from replay.buffer import AddStatus
from replay.sample_checks import MalformedTrajectory

MAX_OPEN_JOBS = 16
MAX_JOBS = 64  # open and finished: the oldest finished job makes room for a new one
MAX_JOB_SAMPLES = 1 << 20
FINISHED_KEEP_S = 60.0
PROMPT_BYTES = 2048
"""Memory a decoded prompt holds beyond its wire bytes (its objects, its copy in the queue, its
group's entries), charged per prompt: small prompts decode to about 1 KB more than they weigh
on the wire (tests/unit/test_eval_memory.py holds the charge above what is measured)."""
SAMPLE_BYTES = 256
NODE_BYTES = 100
"""Memory one decoded JSON value of a prompt's free-form fields (extra_info, tools_kwargs,
interaction_kwargs) holds beyond its wire bytes: an empty list weighs 1 byte on the wire and
~64 in memory (tests/unit/test_eval_memory.py)."""
MAX_REFUSED = 4 * MAX_JOBS
"""Memory one expected sample's score record and slot take (`_Job`), charged per sample."""


def job_charge(wire_bytes: int, prompts: int, samples: int, nodes: int = 0) -> int:
    """The memory a part of `prompts` prompts (`samples` samples in all, `nodes` values in
    their free-form JSON fields, `json_nodes`) that weighed `wire_bytes` on the wire is charged
    (see the module docstring)."""
    return wire_bytes + PROMPT_BYTES * prompts + SAMPLE_BYTES * samples + NODE_BYTES * nodes


def json_nodes(prompts: list[PromptItem]) -> int:
    """How many values the free-form JSON fields of `prompts` hold (their depth was checked
    when they were decoded)."""
    return sum(
        count_nodes([p.extra_info, p.tools_kwargs, p.interaction_kwargs], MAX_HEADER_DEPTH)
        for p in prompts
    )


class EvalQuotaExceeded(ValueError):
    """An evaluation job over the replay's bounds (too many open jobs, too many samples)."""


class EvalForbidden(ValueError):
    """A part or a poll of an evaluation job by a sender that does not own it."""


@dataclass
class _Job:
    expected: int
    touched: float  # monotonic time of submission, of the last poll or sample
    owner: object = None  # who submitted its first part (the replay: role and identity)
    charge: int = 0  # memory charged to it (`job_charge` of its parts)
    receiving: bool = False  # more parts of it are to come (not finished before the last)
    seen: set[tuple[str, int]] = field(default_factory=set)  # (group_id, sample_index) filled
    group_ids: list[str] = field(default_factory=list)
    data_sources: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    failed_groups: list[str] = field(default_factory=list)  # given up (`fail`)


class EvalJobs:
    def __init__(self, forget_after_s: float, max_bytes: int = 1 << 30) -> None:
        self._jobs: dict[str, _Job] = {}
        self._pending: deque[PromptItem] = deque()
        # group_id -> (job_id, data_source, n)
        self._group_job: dict[str, tuple[str, str, int]] = {}
        self._leased_to: dict[str, int] = {}  # group_id -> the server it was leased to
        self._leased: dict[str, PromptItem] = {}  # leased groups not yet complete
        self._held_by: dict[str, set[int]] = {}  # group_id -> every server it was leased to
        self.forget_after_s = forget_after_s
        self.max_bytes = max_bytes
        self.freed = 0
        self._refused: dict[str, str] = {}  # job id -> why a part of it was refused (MAX_REFUSED)

    @property
    def held_bytes(self) -> int:
        """The memory charged to the jobs kept now (`job_charge`), at most `max_bytes`."""
        return sum(job.charge for job in self._jobs.values())

    def submit(
        self,
        job_id: str,
        prompts: list[PromptItem],
        now: float,
        more: bool = False,
        wire_bytes: int = 0,
        owner: object = None,
    ) -> None:
        """Queue a job, or the next part of one still receiving (`more`: parts follow), that
        weighed `wire_bytes` on the wire, from `owner`. EvalForbidden (nothing changes) if the
        job is another owner's; ValueError (or its EvalQuotaExceeded) if it cannot be, and then
        nothing of the job is kept, its earlier parts included, and its later parts are refused."""
        job = self._jobs.get(job_id)
        self._check_owner(job_id, job, owner)
        nodes = json_nodes(prompts)
        try:
            self._check(job_id, job, prompts, wire_bytes, nodes)
        except ValueError as e:
            if job is not None and job.receiving:
                self._free({job_id})
                self._refuse(job_id, str(e))
            raise
        if job is None:
            job = self._jobs[job_id] = _Job(expected=0, touched=now, owner=owner)
        job.expected += sum(p.n for p in prompts)
        job.charge += job_charge(wire_bytes, len(prompts), sum(p.n for p in prompts), nodes)
        job.touched, job.receiving = now, more
        for p in prompts:
            self._group_job[p.group_id] = (job_id, p.data_source, p.n)
        self._pending.extend(dataclasses.replace(p, failures=0) for p in prompts)  # ours to count

    def _check_owner(self, job_id: str, job: _Job | None, owner: object) -> None:
        """EvalForbidden unless `owner` may send a part or poll of `job_id` (`job`, None if
        not kept): the job is its own, and no part of it was refused."""
        if job_id in self._refused:
            raise EvalForbidden(
                f"evaluation job {job_id!r} was freed when a part of it was refused "
                f"({self._refused[job_id][:200]}); submit it again under a new id"
            )
        if job is not None and job.owner != owner:
            raise EvalForbidden(f"evaluation job {job_id!r} was submitted by another sender")

    def _refuse(self, job_id: str, why: str) -> None:
        self._refused[job_id] = why
        while len(self._refused) > MAX_REFUSED:
            del self._refused[next(iter(self._refused))]  # the oldest: dicts keep order

    def _check(
        self, job_id: str, job: _Job | None, prompts: list[PromptItem], size: int, nodes: int
    ) -> None:
        """Raise unless the part `prompts` can join `job` (None: a new job `job_id`), freeing
        the finished jobs that it needs room or memory for."""
        if job is not None and not job.receiving:
            raise ValueError(f"evaluation job {job_id!r} already exists")
        if job is None:
            open_jobs = sum(1 for j in self._jobs if not self._finished(j))
            if open_jobs >= MAX_OPEN_JOBS:
                raise EvalQuotaExceeded(
                    f"{open_jobs} evaluation jobs are open (at most {MAX_OPEN_JOBS})"
                )
        samples = sum(p.n for p in prompts)
        expected = samples + (0 if job is None else job.expected)
        if expected > MAX_JOB_SAMPLES:
            raise EvalQuotaExceeded(f"{expected} samples in one job (at most {MAX_JOB_SAMPLES})")
        groups = {p.group_id for p in prompts}
        if len(groups) != len(prompts) or any(g in self._group_job for g in groups):
            raise ValueError(f"job {job_id!r}: group ids must be unique and new")
        for p in prompts:
            if p.eval_job != job_id:
                raise ValueError(f"prompt {p.group_id!r} is not marked for job {job_id!r}")
        charge = job_charge(size, len(prompts), samples, nodes)
        self._make_room(charge, new_job=job is None)
        if self.held_bytes + charge > self.max_bytes:
            raise EvalQuotaExceeded(
                f"evaluation jobs would hold {(self.held_bytes + charge) / 2**20:.1f} MiB, over "
                f"the replay's cap replay.eval_jobs_mb={self.max_bytes / 2**20:g} (held by the "
                "jobs open now: wait for them, or raise the cap)"
            )

    def _make_room(self, charge: int, new_job: bool) -> None:
        """Free the oldest finished jobs while MAX_JOBS are kept (for a new job) or `charge`
        more bytes would pass `max_bytes`, as long as finished ones are left (fewer than
        MAX_OPEN_JOBS are open when a new job comes, so for MAX_JOBS one always is)."""
        while (new_job and len(self._jobs) >= MAX_JOBS) or (
            self.held_bytes + charge > self.max_bytes
        ):
            finished = [j for j in self._jobs if self._finished(j)]
            if not finished:
                return
            self._free({min(finished, key=lambda j: self._jobs[j].touched)})

    def _finished(self, job_id: str) -> bool:
        job = self._jobs[job_id]
        return not job.receiving and len(job.seen) >= job.expected

    def expire(self, now: float) -> None:
        """Free finished jobs polled FINISHED_KEEP_S ago and any job untouched for
        `forget_after_s` (its submitter is gone), with the prompts not leased yet."""
        gone = {
            job_id
            for job_id, job in self._jobs.items()
            if now - job.touched
            > (FINISHED_KEEP_S if self._finished(job_id) else self.forget_after_s)
        }
        if gone:
            self._free(gone)

    def _free(self, gone: set[str]) -> None:
        for job_id in gone:
            del self._jobs[job_id]
        self._group_job = {g: v for g, v in self._group_job.items() if v[0] not in gone}
        self._leased_to = {g: s for g, s in self._leased_to.items() if g in self._group_job}
        self._leased = {g: p for g, p in self._leased.items() if g in self._group_job}
        self._held_by = {g: s for g, s in self._held_by.items() if g in self._group_job}
        self._pending = deque(p for p in self._pending if p.eval_job not in gone)
        self.freed += len(gone)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def take(self, k: int, server_id: int) -> list[PromptItem]:
        """Up to k prompts to lease to `server_id`, in submission order; only that server may
        send their samples."""
        taken = [self._pending.popleft() for _ in range(min(k, len(self._pending)))]
        for p in taken:
            self._leased_to[p.group_id] = server_id
            self._leased[p.group_id] = p
            self._held_by.setdefault(p.group_id, set()).add(server_id)
        return taken

    def reissue_server(self, server_id: int) -> int:
        """A dead (or replaced) server's incomplete groups go back to the front of the queue, for
        any server to lease again (their filled slots stay filled: a second sample of a slot is
        a duplicate). Returns how many groups went back."""
        back = [p for g, p in self._leased.items() if self._leased_to.get(g) == server_id]
        for p in reversed(back):
            self._pending.appendleft(p)
            del self._leased_to[p.group_id], self._leased[p.group_id]
        return len(back)

    def fail(self, group_id: str, server_id: int, give_up_at: int) -> PromptItem | None:
        """`server_id` could not sample the evaluation group `group_id` leased to it: the group
        goes back to the end of the queue with one failure more, or, at `give_up_at` failures,
        is given up: listed in its job's `failed_groups`, and the samples of its slots still
        empty are no longer expected (so the job finishes). Returns the prompt as it was
        leased, or None when no such group is leased to that server (complete, or taken
        back)."""
        if self._leased_to.get(group_id) != server_id or group_id not in self._leased:
            return None
        item = self._leased.pop(group_id)
        del self._leased_to[group_id]
        if item.failures + 1 < give_up_at:
            self._pending.append(dataclasses.replace(item, failures=item.failures + 1))
            return item
        job = self._jobs[item.eval_job]
        job.failed_groups.append(group_id)
        job.expected -= sum((group_id, i) not in job.seen for i in range(item.n))
        return item

    def owns(self, group_id: str) -> bool:
        return group_id in self._group_job

    def add(self, traj: Trajectory, now: float) -> AddStatus:
        """Score one sample of an owned group (`owns`); the caller checked it is well formed.
        `late`: its sender held the group before but not now (the sender died or could not
        sample it, and the group went back to the queue), as for a training group.
        MalformedTrajectory when its sample_index is not one of the group's, or its sender
        never held it."""
        job_id, source, n = self._group_job[traj.group_id]
        if traj.sample_index >= n:  # each group gives exactly its n samples, no more
            raise MalformedTrajectory(f"sample_index {traj.sample_index} outside 0..{n - 1}")
        if self._leased_to.get(traj.group_id) != traj.server_id:
            if traj.server_id in self._held_by.get(traj.group_id, ()):
                return "late"
            raise MalformedTrajectory(f"evaluation group {traj.group_id!r} is not leased to it")
        job = self._jobs[job_id]
        slot = (traj.group_id, traj.sample_index)
        if slot in job.seen:
            return "duplicate"
        job.touched = now
        job.seen.add(slot)
        if all((traj.group_id, i) in job.seen for i in range(n)):
            self._leased.pop(traj.group_id, None)  # complete: nothing left to re-issue
        sampled = traj.versions[traj.loss_mask == 1]
        job.group_ids.append(traj.group_id)
        job.data_sources.append(source)
        job.scores.append(float(traj.reward))
        job.lengths.append(int(len(traj.response_ids)))
        job.versions.append(int(sampled.min()) if len(sampled) else -1)
        return "accepted"

    def results(
        self, request_id: int, job_id: str, now: float, owner: object = None
    ) -> EvalResults:
        """The job's scores so far: KeyError if it is not kept, EvalForbidden if it is not
        `owner`'s or a part of it was refused."""
        job = self._jobs.get(job_id)
        self._check_owner(job_id, job, owner)
        if job is None:
            raise KeyError(job_id)
        job.touched = now
        return EvalResults(
            request_id=request_id,
            job_id=job_id,
            expected=job.expected,
            group_ids=job.group_ids,
            data_sources=job.data_sources,
            scores=np.asarray(job.scores, np.float32),
            response_lengths=np.asarray(job.lengths, np.int32),
            versions=np.asarray(job.versions, np.int32),
            failed_groups=list(job.failed_groups),
        )
