"""Evaluation-job parts and polls belong to the sender of the job's first part, and a refused
part of a job refuses its later parts too (red-team finding 4 of issue 30)."""

from __future__ import annotations

import pytest

from asyncrl.wire.protocol import PromptItem
from replay.eval_jobs import EvalForbidden, EvalJobs

JOB = "eval-20260101-120000-4242"  # guessable: a time and a pid
OWNER, OTHER = ("client", b"victim"), ("client", b"attacker")


def prompts(job: str, tag: str, k: int) -> list[PromptItem]:
    return [PromptItem(f"{job}/{tag}{i}", 1, "math", [], "1", {}, eval_job=job) for i in range(k)]


def test_another_senders_part_is_refused_and_changes_nothing() -> None:
    jobs = EvalJobs(forget_after_s=600)
    jobs.submit(JOB, prompts(JOB, "a", 10), 0.0, more=True, owner=OWNER)
    with pytest.raises(EvalForbidden, match="another sender"):
        jobs.submit(JOB, prompts(JOB, "easy", 90), 1.0, more=True, owner=OTHER)
    with pytest.raises(EvalForbidden):  # a bad part of another sender does not free it either
        jobs.submit(JOB, prompts("other", "x", 1), 1.0, more=True, owner=OTHER)
    jobs.submit(JOB, prompts(JOB, "b", 2), 2.0, more=False, owner=OWNER)
    assert jobs.results(1, JOB, 3.0, owner=OWNER).expected == 12
    assert jobs.pending == 12


def test_another_sender_cannot_poll_the_job() -> None:
    jobs = EvalJobs(forget_after_s=600)
    jobs.submit(JOB, prompts(JOB, "a", 1), 0.0, owner=OWNER)
    with pytest.raises(EvalForbidden):
        jobs.results(1, JOB, 1.0, owner=OTHER)


def test_after_a_refused_part_later_parts_and_polls_are_refused() -> None:
    jobs = EvalJobs(forget_after_s=600)
    jobs.submit(JOB, prompts(JOB, "a", 10), 0.0, more=True, owner=OWNER)
    with pytest.raises(ValueError, match="not marked"):
        jobs.submit(JOB, prompts("other", "x", 1), 1.0, more=True, owner=OWNER)
    assert jobs.pending == 0  # the job is freed with its earlier parts
    with pytest.raises(EvalForbidden, match="was refused"):
        jobs.submit(JOB, prompts(JOB, "b", 2), 2.0, more=False, owner=OWNER)
    with pytest.raises(EvalForbidden, match="was refused"):
        jobs.results(1, JOB, 3.0, owner=OWNER)
    assert jobs.pending == 0
