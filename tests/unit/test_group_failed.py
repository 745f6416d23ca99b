"""A group a server cannot sample (a row naming an agent loop or interaction the server lacks,
a prompt too long for the model): the server reports it (`GroupFailed`) once its engine answers
a probe, and the replay ends the lease at once, leases the row again, and gives it up after
`replay.max_group_failures`, written down; a broken engine stops the server instead of
blaming rows."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter

import numpy as np
import pytest

from asyncrl.config import Config, load_config
from asyncrl.run_spec import RunSpec
from asyncrl.wire.protocol import ChatMessage, LeaseRequest, PromptItem
from asyncrl.wire.samples import Trajectory
from replay.admission import AdmissionController
from replay.buffer import GroupBuffer
from replay.eval_jobs import EvalJobs
from replay.leases import LeaseDesk, LeaseRules
from replay.prompts import setup_prompt_source
from replay.sample_checks import MalformedTrajectory
from rollout_servers import engine_probe
from rollout_servers.agents.base import AgentResult
from rollout_servers.engines.base import GenerationOutput
from rollout_servers.server import RolloutServer

N, B = 2, 2


def _desk(tmp_path, failures: int = 3, servers: int = 1) -> LeaseDesk:
    cfg = Config.model_validate(
        {
            "rollout": {"n": N, "max_concurrent_groups": 4, "num_servers": servers},
            "data": {"train_batch_size": B},
            "replay": {"max_staleness": 2, "max_group_failures": failures},
        }
    )
    buffer, jobs = GroupBuffer(), EvalJobs(60.0)
    rules, admission = LeaseRules.from_config(cfg), AdmissionController.from_config(cfg)
    return LeaseDesk(
        rules, admission, setup_prompt_source(cfg), buffer, jobs, Counter(), tmp_path / "f.jsonl"
    )


def _lease(desk: LeaseDesk, server_id: int = 0, k: int = 1) -> list[PromptItem]:
    return desk.grant(LeaseRequest(1, server_id, 0, k))


def _row(item: PromptItem) -> str:
    return item.group_id.rsplit("-", 1)[0]


def _traj(item: PromptItem, index: int, server_id: int = 0) -> Trajectory:
    return Trajectory(
        traj_id=f"{item.group_id}/{index}",
        attempt=0,
        group_id=item.group_id,
        sample_index=index,
        server_id=server_id,
        prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.array([3], np.int32),
        loss_mask=np.ones(1, np.uint8),
        behaviour_logprobs=np.array([-0.5], np.float32),
        versions=np.zeros(1, np.int32),
        reward=1.0,
        baseline_reward=float("nan"),
        finish_reason="stop",
        metrics={},
    )


def test_a_failing_row_is_leased_again_then_given_up_and_written_down(tmp_path):
    desk = _desk(tmp_path)
    (first,) = _lease(desk)
    issued = desk.admission.issued
    seen = [first]
    for attempt in (1, 2):
        error = "ValueError: unknown agent loop 'nope'"
        assert desk.fail(attempt - 1, seen[-1].group_id, error) == "retried"
        assert desk.buffer.in_flight_of(0) == 0 and desk.admission.issued == issued - 1
        (again,) = _lease(desk, server_id=attempt)  # the row again, first, to any server
        assert _row(again) == _row(first) and again.group_id != seen[-1].group_id
        assert again.failures == attempt
        issued = desk.admission.issued
        seen.append(again)
    assert desk.fail(2, seen[-1].group_id, "ValueError: unknown agent loop 'nope'") == "given_up"
    assert (desk.counters["groups_failed"], desk.counters["rows_given_up"]) == (3, 1)
    (record,) = [json.loads(line) for line in (tmp_path / "f.jsonl").read_text().splitlines()]
    assert record["group_id"] == seen[-1].group_id and record["failures"] == 3
    assert record["error"] == "ValueError: unknown agent loop 'nope'" and record["server_id"] == 2
    assert record["prompt"] == first.messages[-1].content
    (following,) = _lease(desk)  # the stream goes on with the next row; this one never returns
    assert _row(following) != _row(first) and following.failures == 0
    assert [_row(p) for p in desk.data_state(0).reissue] == [_row(following)]  # in flight


def test_only_the_server_holding_an_incomplete_lease_can_fail_it(tmp_path):
    desk = _desk(tmp_path)
    item, done = _lease(desk, k=2)
    assert desk.fail(1, item.group_id, "x") == "late"  # another server's lease
    assert desk.fail(0, "no-such-group", "x") == "late"
    for i in range(N):
        assert desk.buffer.add(_traj(done, i)) == "accepted"
    assert desk.fail(0, done.group_id, "x") == "late"  # complete: it is trained
    assert desk.buffer.in_flight_of(0) == 1 and desk.counters["groups_failed"] == 0
    assert desk.fail(0, item.group_id, "x") == "retried"
    assert desk.buffer.add(_traj(item, 0)) == "late"  # its samples after the report: dropped


def test_a_failed_row_goes_to_another_server_when_there_is_one(tmp_path):
    """An error of one server's (its device's memory, say) must not use up a row's failures:
    the row waits for another server, and the one that failed it gets a new row."""
    desk = _desk(tmp_path, servers=2)
    (item,) = _lease(desk, server_id=0)
    assert desk.fail(0, item.group_id, "CUDA out of memory") == "retried"
    (fresh,) = _lease(desk, server_id=0)
    assert _row(fresh) != _row(item) and fresh.failures == 0
    (again,) = _lease(desk, server_id=1)
    assert _row(again) == _row(item) and again.failures == 1
    assert desk.fail(1, again.group_id, "x") == "retried"
    (third,) = _lease(desk, server_id=0)  # failed last on server 1: server 0 may take it
    assert _row(third) == _row(item) and third.failures == 2


def test_an_evaluators_failure_count_is_not_taken(tmp_path):
    desk = _desk(tmp_path)
    forged = PromptItem("job/g", N, "src", [ChatMessage("user", "q")], "a", {}, eval_job="job")
    desk.eval_jobs.submit("job", [dataclasses.replace(forged, failures=2)], 0.0)
    (leased,) = [p for p in _lease(desk, k=2) if p.eval_job]
    assert leased.failures == 0 and desk.fail(0, leased.group_id, "x") == "retried"


def test_a_checkpoint_of_format_1_is_read_with_no_failures(tmp_path):
    """Format 1 (before `GroupFailed`) had no `PromptItem.failures`: it still resumes."""
    import msgpack

    from replay.checkpoint import decode_state, encode_state

    desk = _desk(tmp_path)
    (item,) = _lease(desk)
    doc = msgpack.unpackb(encode_state(desk.data_state(0)), raw=False)
    header = msgpack.unpackb(doc["reissue"][0], raw=False)
    for prompt in header["fields"]["prompts"]:
        del prompt["failures"]
    doc["reissue"][0] = msgpack.packb(header, use_bin_type=True)
    doc["format"] = 1
    (restored,) = decode_state(msgpack.packb(doc, use_bin_type=True)).reissue
    assert restored == item and restored.failures == 0
    doc["format"] = 2  # the same prompts under the new format are refused, naming the field
    with pytest.raises(ValueError, match="failures"):
        decode_state(msgpack.packb(doc, use_bin_type=True))


def test_the_failure_count_survives_a_checkpoint(tmp_path):
    desk = _desk(tmp_path)
    (item,) = _lease(desk)
    desk.fail(0, item.group_id, "x")
    state = desk.data_state(0)
    resumed = _desk(tmp_path)
    resumed.restore(state)
    (again,) = _lease(resumed)
    assert _row(again) == _row(item) and again.failures == 1


def test_an_evaluation_group_given_up_finishes_its_job_and_is_listed(tmp_path):
    desk = _desk(tmp_path, failures=2)
    job = [
        PromptItem(f"job/g{i}", N, "src", [ChatMessage("user", "q")], "a", {}, eval_job="job")
        for i in range(2)
    ]
    desk.eval_jobs.submit("job", job, 0.0)
    good, bad = [p for p in _lease(desk, k=4) if p.eval_job]  # evaluation takes half a grant
    assert desk.eval_jobs.add(_traj(good, 0), 0.0) == "accepted"
    assert desk.eval_jobs.add(_traj(good, 1), 0.0) == "accepted"
    assert desk.eval_jobs.add(_traj(bad, 0), 0.0) == "accepted"  # one slot filled, then it fails
    assert desk.fail(0, bad.group_id, "x") == "retried"
    (again,) = _lease(desk, server_id=1)
    assert again.group_id == bad.group_id and again.failures == 1
    assert desk.eval_jobs.add(_traj(bad, 1, server_id=0), 0.0) == "late"  # its failed attempt
    with pytest.raises(MalformedTrajectory, match="not leased to it"):  # never held it
        desk.eval_jobs.add(_traj(bad, 1, server_id=2), 0.0)
    assert desk.fail(1, bad.group_id, "x") == "given_up"
    results = desk.eval_jobs.results(1, "job", 0.0)
    assert results.failed_groups == [bad.group_id] and desk.counters["eval_groups_given_up"] == 1
    assert results.expected == 2 * N - 1 == len(results.scores)  # done: no sample awaited


# ---- the server's side ----------------------------------------------------------------------
class _Engine:
    on_batch = None
    version = 0

    def __init__(self, broken: bool = False) -> None:
        self.broken, self.probes = broken, 0

    async def generate(self, prompt_ids, params) -> GenerationOutput:
        self.probes += 1
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return GenerationOutput([5], [-0.1], 0, "length")


class _FailingLoop:
    """An agent loop that cannot run a prompt (as one naming an agent loop the server lacks)."""

    async def run(self, prompt, params=None) -> AgentResult:
        raise ValueError(f"unknown agent loop {prompt.agent_name!r}")


class _Loop:
    async def run(self, prompt, params=None) -> AgentResult:
        return AgentResult([1], [2], [1], [-0.5], [0], "answer", "stop")


class _Rewards:
    async def score(self, data_source, solution_str, ground_truth, extra_info):
        return 1.0, {}


class _Client:
    def __init__(self) -> None:
        self.sent, self.failed = [], []

    async def put(self, traj) -> None:
        self.sent.append(traj)

    async def group_failed(self, group_id: str, error: str) -> None:
        self.failed.append((group_id, error))


def _server(tmp_path, engine: _Engine, client: _Client) -> RolloutServer:
    cfg = load_config(None, ["rollout.max_concurrent_groups=2", "replay.max_group_failures=1"])
    spec = RunSpec(str(tmp_path), "unused", "tcp://127.0.0.1:1", "127.0.0.1", 0, 0, 1)
    return RolloutServer(cfg, spec, 0, engine, _FailingLoop(), client, _Rewards())  # type: ignore[arg-type]


BAD = PromptItem("g-1", 2, "src", [ChatMessage("user", "q")], "a", {}, agent_name="nope")


def test_a_failed_group_is_reported_and_the_server_goes_on_until_too_many_in_a_row(tmp_path):
    """A client's evaluation prompt naming an unknown agent loop stopped server_0, and with it
    the run (found by red-teaming); only a run of failures may stop it."""
    engine, client = _Engine(), _Client()
    server = _server(tmp_path, engine, client)
    for _ in range(6):  # 3 x max_concurrent_groups in a row: tolerated
        asyncio.run(server.run_group(BAD))
    assert server.counters["groups_failed"] == 6 and engine.probes == 6
    assert client.failed == [("g-1", "ValueError: unknown agent loop 'nope'")] * 6
    with pytest.raises(RuntimeError, match="7 groups failed in a row"):
        asyncio.run(server.run_group(BAD))
    server.agent_loop = _Loop()
    asyncio.run(server.run_group(BAD))  # a group that samples ends the run of failures
    assert server.counters["groups"] == 1 and server._failed_in_a_row == 0


def test_a_broken_engine_stops_the_server_and_blames_no_row(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_probe, "PROBE_PAUSE_S", 0.01)
    engine, client = _Engine(broken=True), _Client()
    server = _server(tmp_path, engine, client)
    with pytest.raises(RuntimeError, match="failed 3 one-token probes after group g-1 failed"):
        asyncio.run(server.run_group(BAD))
    assert client.failed == [] and engine.probes == 3


def test_a_probe_that_fails_with_the_bad_prompt_is_tried_again(tmp_path, monkeypatch):
    """A probe admitted in the same prefill as the failing prompt fails with it (out of device
    memory): one failed probe is not a broken engine."""
    monkeypatch.setattr(engine_probe, "PROBE_PAUSE_S", 0.01)
    engine, client = _Engine(broken=True), _Client()
    server = _server(tmp_path, engine, client)
    real = engine.generate

    async def once_broken(prompt_ids, params):
        engine.broken = engine.probes == 0
        return await real(prompt_ids, params)

    engine.generate = once_broken  # type: ignore[method-assign]
    asyncio.run(server.run_group(BAD))
    assert engine.probes == 2 and len(client.failed) == 1


def test_the_failures_in_a_row_that_stop_a_server_allow_for_retries(tmp_path):
    """Each bad row fails up to replay.max_group_failures times: the limit grows with it."""
    cfg = load_config(None, ["rollout.max_concurrent_groups=2", "replay.max_group_failures=3"])
    spec = RunSpec(str(tmp_path), "unused", "tcp://127.0.0.1:1", "127.0.0.1", 0, 0, 1)
    server = RolloutServer(cfg, spec, 0, _Engine(), _FailingLoop(), _Client(), _Rewards())  # type: ignore[arg-type]
    for _ in range(18):  # 3 x max_concurrent_groups x max_group_failures
        asyncio.run(server.run_group(BAD))
    with pytest.raises(RuntimeError, match="19 groups failed in a row"):
        asyncio.run(server.run_group(BAD))


def test_an_evaluation_leaves_out_a_prompt_given_up_and_counts_it():
    from asyncrl.evaluation import run_eval_job
    from asyncrl.wire.protocol import EvalResults

    class _Replay:
        def submit_eval(self, job_id, prompts) -> None:
            pass

        def poll_eval(self, job_id) -> EvalResults:  # g1 gave one sample, then was given up
            return EvalResults(
                1,
                job_id,
                3,
                ["g0", "g0", "g1"],
                ["src"] * 3,
                np.array([1.0, 0.0, 1.0], np.float32),
                np.array([4, 6, 50], np.int32),
                np.zeros(3, np.int32),
                failed_groups=["g1"],
            )

    summary = run_eval_job(_Replay(), [], "job", timeout_s=5)  # type: ignore[arg-type]
    assert summary["mean_score"] == 0.5 and summary["num_prompts"] == 1
    assert summary["num_samples"] == 2 and summary["response_len_mean"] == 5.0
    assert summary["num_failed_prompts"] == 1


def test_a_failed_groups_other_samples_are_cancelled_not_finished(tmp_path):
    """One sample of a group raising fails the group: its siblings would only be answered
    `late`, so they stop instead of holding the engine."""

    class _OneFails:
        def __init__(self) -> None:
            self.calls, self.cancelled = 0, 0

        async def run(self, prompt, params=None) -> AgentResult:
            self.calls += 1
            if self.calls == 1:
                raise ValueError("a tool call the sandbox cannot run")
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

    engine, client = _Engine(), _Client()
    server = _server(tmp_path, engine, client)

    async def main() -> int:
        group = PromptItem("g-2", 4, "src", [ChatMessage("user", "q")], "a", {})
        await server.run_group(group)
        await asyncio.sleep(0.01)  # the cancelled siblings run their handlers
        return loop.cancelled  # before asyncio.run cancels whatever is left at its end

    loop = server.agent_loop = _OneFails()
    assert asyncio.run(main()) == 3 and client.sent == []
    assert client.failed == [("g-2", "ValueError: a tool call the sandbox cannot run")]
