"""Evaluation jobs' bounds (`replay.eval_jobs`): parts, the memory cap, and a charge that covers
what a job really holds."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from asyncrl.config import Config
from asyncrl.wire.auth import MAX_AUTH_FRAME
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.protocol import ChatMessage, PromptItem
from asyncrl.wire.replay_client import EVAL_PART_BYTES, eval_parts
from asyncrl.wire.samples import Trajectory
from replay.eval_jobs import EvalForbidden, EvalJobs, EvalQuotaExceeded, job_charge, json_nodes


def _prompts(job: str, k: int, start: int = 0, text: str = "x") -> list[PromptItem]:
    return [
        PromptItem(f"{job}/g{i}", 1, "d", [ChatMessage("user", text)], "1", {"i": i}, eval_job=job)
        for i in range(start, start + k)
    ]


@pytest.mark.parametrize("shape", ["small prompts", "empty lists"])
def test_the_charge_covers_what_a_decoded_job_holds(shape: str) -> None:
    """The worst cases per wire byte: many tiny prompts, and one prompt whose extra_info is
    thousands of empty lists (1 wire byte each). What decoding and queueing one part allocates
    (tracemalloc) stays under `job_charge` of its wire size and JSON values."""
    if shape == "small prompts":
        part = eval_parts("j", _prompts("j", 3000), EVAL_PART_BYTES)[0]
    else:
        lists = PromptItem(
            "j/g0", 1, "d", [], "1", {"a": [[] for _ in range(25_000)]}, eval_job="j"
        )
        part = eval_parts("j", [lists], EVAL_PART_BYTES)[0]
    frames = [bytes(f) for f in encode(part)]
    wire = sum(len(f) for f in frames)
    jobs = EvalJobs(600.0)
    gc.collect()
    tracemalloc.start()
    try:
        msg = decode(frames)
        jobs.submit("j", msg.prompts, 0.0, msg.more, wire)
        del msg
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    n = len(part.prompts)
    charge = job_charge(wire, n, n, json_nodes(part.prompts))
    assert jobs.held_bytes == charge
    assert held < charge, f"{held} bytes held, {charge} charged for {n} prompts"


def test_a_job_in_parts_is_open_until_its_last_part_and_a_refused_part_ends_it():
    jobs = EvalJobs(600.0)
    jobs.submit("j", _prompts("j", 2), 0.0, more=True, wire_bytes=100)
    assert jobs.pending == 2
    taken = jobs.take(2, server_id=0)  # its prompts are leased as its parts come
    assert [p.group_id for p in taken] == ["j/g0", "j/g1"]
    jobs.submit("j", _prompts("j", 1, start=2), 1.0, more=False, wire_bytes=50)
    assert jobs.results(1, "j", 1.0).expected == 3
    with pytest.raises(ValueError, match="already exists"):  # complete: no part joins it now
        jobs.submit("j", _prompts("j", 1, start=3), 2.0)
    jobs.submit("k", _prompts("k", 1), 0.0, more=True, wire_bytes=10)
    with pytest.raises(ValueError, match="unique and new"):
        jobs.submit("k", _prompts("k", 1), 0.0, more=True, wire_bytes=10)
    with pytest.raises(EvalForbidden, match="was refused"):  # it ended its job, earlier parts
        jobs.results(2, "k", 3.0)  # and all, and is named when asked about
    assert jobs.pending == 1  # j's last part only


def test_a_job_over_the_memory_cap_is_refused_naming_it_and_finished_jobs_make_room():
    one = job_charge(1000, 1, 1, json_nodes(_prompts("a", 1)))
    cap = 3 * one
    jobs = EvalJobs(600.0, max_bytes=cap)
    jobs.submit("a", _prompts("a", 1), 0.0, wire_bytes=1000)
    jobs.submit("b", _prompts("b", 1), 0.0, more=True, wire_bytes=1000)
    jobs.submit("b", _prompts("b", 1, start=1), 0.0, more=True, wire_bytes=1000)
    with pytest.raises(EvalQuotaExceeded, match=r"replay\.eval_jobs_mb=") as refused:
        jobs.submit("c", _prompts("c", 1), 0.0, wire_bytes=1000)
    assert "would hold" in str(refused.value)
    assert jobs.held_bytes == cap
    with pytest.raises(EvalQuotaExceeded):  # b's next part too: and b is gone with it
        jobs.submit("b", _prompts("b", 1, start=2), 0.0, wire_bytes=1000)
    assert jobs.held_bytes == one
    (a,) = jobs.take(1, server_id=0)
    assert jobs.add(_sample(a.group_id), 1.0) == "accepted"  # a is finished, not yet freed
    jobs.submit("e", _prompts("e", 1), 2.0, wire_bytes=1000)  # b's id stays refused
    jobs.submit("c", _prompts("c", 1), 2.0, wire_bytes=1000)
    assert jobs.results(3, "a", 3.0).scores.tolist() == [1.0]  # kept while there is room
    jobs.submit("d", _prompts("d", 1), 2.0, wire_bytes=1000)  # the finished job made room
    with pytest.raises(KeyError):
        jobs.results(4, "a", 3.0)
    assert jobs.held_bytes == cap


def _sample(group_id: str) -> Trajectory:
    r = 2
    return Trajectory(
        traj_id=f"{group_id}/0",
        attempt=0,
        group_id=group_id,
        sample_index=0,
        server_id=0,
        prompt_ids=np.array([1], np.int32),
        response_ids=np.arange(r, dtype=np.int32),
        loss_mask=np.ones(r, np.uint8),
        behaviour_logprobs=np.full(r, -0.5, np.float32),
        versions=np.zeros(r, np.int32),
        reward=1.0,
        finish_reason="stop",
        baseline_reward=float("nan"),
        metrics={},
    )


def test_a_job_is_split_into_parts_under_the_clients_default_limit():
    """`eval_parts` keeps every part (with its authentication frame) under the replay's default
    limit for a client, and together they are the job; a prompt too large alone is named."""
    limit = int(Config().replay.max_client_message_mb * 2**20)
    assert limit >= EVAL_PART_BYTES + MAX_AUTH_FRAME
    prompts = _prompts("j", 400, text="y" * 1000)
    parts = eval_parts("j", prompts, EVAL_PART_BYTES)
    assert len(parts) > 1 and [p.more for p in parts] == [True] * (len(parts) - 1) + [False]
    assert all(sum(len(f) for f in encode(p)) <= EVAL_PART_BYTES for p in parts)
    assert [q for p in parts for q in p.prompts] == prompts
    with pytest.raises(ValueError, match="'j/g0' alone weighs"):
        eval_parts("j", _prompts("j", 1, text="z" * 5000), 4096)
