"""The replay service over real ZeroMQ sockets: bad input is rejected and counted while the
service keeps serving; held requests are answered when something changes."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from replay_peers import KEYRING, SECRET, ask, dealer, recv, running_replay, send
from replay_peers import trajectory as _traj

from asyncrl.config import Config
from asyncrl.wire.codec import encode
from asyncrl.wire.protocol import (
    Ack,
    CheckpointRequest,
    Error,
    LeaseGrant,
    LeaseRequest,
    PromptItem,
    Stats,
    StatsRequest,
    VersionUpdate,
)
from asyncrl.wire.samples import Acks, Batch, BatchRequest, Trajectories, Trajectory
from asyncrl.wire.sockets import free_port, tcp_address
from replay.checkpoint import read_state
from replay.counters import COUNTERS

pytestmark = pytest.mark.integration

N = 2  # samples per group
B = 2  # groups per batch
WAIT_S = 0.4  # replay.wait_timeout_s


def _config(**replay) -> Config:
    return Config.model_validate(
        {
            "rollout": {"n": N},
            "data": {"train_batch_size": B},
            "replay": {"max_staleness": 0, "wait_timeout_s": WAIT_S, **replay},
        }
    )


@pytest.fixture
def client() -> Iterator[zmq.Socket]:
    with running_replay(_config(max_message_mb=0.01)) as address, dealer(address) as sock:
        yield sock  # 10 KiB messages at most: easy to exceed


PATIENT_S = 5.0  # a wait no loaded machine outlasts: a test that a request is still held


@pytest.fixture
def patient() -> Iterator[zmq.Socket]:
    """A replay that holds requests PATIENT_S, for tests of what answers a held request (with
    WAIT_S, a 0.2 s stall of this process answered one empty first)."""
    with running_replay(_config(wait_timeout_s=PATIENT_S)) as address, dealer(address) as sock:
        yield sock


def _send_raw(sock: zmq.Socket, frames: list[bytes], role: str = "server_0") -> object:
    """Raw frames, signed (so they reach the decoder), and the reply."""
    return ask(sock, frames, role)


def _recv(sock: zmq.Socket, timeout_s: float = 3.0) -> object:
    return recv(sock, timeout_s)


def _ask(sock: zmq.Socket, msg: object) -> object:
    return ask(sock, msg)


def _stats(sock: zmq.Socket) -> dict[str, float]:
    reply = _ask(sock, StatsRequest(request_id=99))
    assert isinstance(reply, Stats)
    return reply.counters


def _lease(sock: zmq.Socket, request_id: int, version: int, max_groups: int) -> list[PromptItem]:
    grant = _ask(sock, LeaseRequest(request_id, 0, version, max_groups))
    assert isinstance(grant, LeaseGrant) and grant.request_id == request_id
    return grant.prompts


def _complete(sock: zmq.Socket, prompts: list[PromptItem], version: int = 0) -> None:
    for p in prompts:
        for i in range(p.n):
            ack = _ask(sock, _traj(p.group_id, i, version))
            assert isinstance(ack, Ack) and ack.status == "accepted"


def _tampered_dtype(traj: Trajectory) -> list[bytes]:
    frames = [bytes(f) for f in encode(traj)]
    header = msgpack.unpackb(frames[0])
    header["arrays"][0][1] = "<f8"  # prompt_ids claimed as float64
    return [msgpack.packb(header), *frames[1:]]


def test_every_counter_is_reported_from_the_start(client):
    stats = _stats(client)
    assert {k: stats[k] for k in COUNTERS} == dict.fromkeys(COUNTERS, 0.0)
    gauges = ("groups_ready", "groups_in_flight", "groups_issued", "learner_version")
    assert all(stats[k] == 0 for k in gauges)


def test_bad_messages_are_rejected_counted_and_the_service_keeps_serving(client):
    sock = client
    good = [bytes(f) for f in encode(_traj("g", 0))]
    bad_version = msgpack.unpackb(good[0])
    bad_version["v"] = 99
    unknown_type = msgpack.unpackb(good[0])
    unknown_type["type"] = "no_such_message"
    malformed = [
        [b"\x00garbage\xff\xc1"],  # not MessagePack
        [b""],  # an empty frame
        [b"", b""],
        [msgpack.packb(bad_version), *good[1:]],
        [msgpack.packb(unknown_type), *good[1:]],
        _tampered_dtype(_traj("g", 0)),
        [*good[:-1], good[-1][:-2]],  # short array frame
        good[:-1],  # an array frame missing
        [bytes(f) for f in encode(LeaseRequest(1, 0, 0, -1))],
        [bytes(f) for f in encode(BatchRequest(1, 0, 0))],
    ]
    for frames in malformed:
        assert isinstance(_send_raw(sock, frames), Error)
    # decodes, but cannot be trained on: acknowledged as rejected so the sender stops resending
    uneven = _traj("g", 0, versions=np.zeros(1, np.int32))
    reply = _send_raw(sock, [bytes(f) for f in encode(uneven)])
    assert isinstance(reply, Ack) and reply.status == "rejected" and reply.traj_id == uneven.traj_id
    huge = _traj("g", 0, prompt_ids=np.zeros(4_000, np.int32))  # 16 KB: over 10 KiB, under 2x
    reply = _ask(sock, huge)
    assert isinstance(reply, Error) and "oversized" in reply.reason
    reply = _ask(sock, Ack(request_id=1, traj_id="x", status="ok"))  # valid, but not for it
    assert isinstance(reply, Error) and "does not accept" in reply.reason

    stats = _stats(sock)
    assert stats["rejected_malformed"] == len(malformed)
    assert stats["rejected_invalid"] == 1  # the untrainable trajectory
    assert stats["rejected_oversized"] == 1
    assert stats["rejected_unexpected"] == 1
    assert stats["received"] == len(malformed) + 3

    # a full round trip still works: lease -> samples (one resent) -> batch
    prompts = _lease(sock, 1, version=0, max_groups=5)
    assert len(prompts) == B and all(p.n == N for p in prompts)  # max_staleness 0: one batch
    for p in prompts:  # embedded task rows, as a verl-schema dataset would give them
        extra = p.extra_info
        assert (
            p.messages[0].role == "user" and p.messages[0].content == f"{extra['a']}+{extra['b']}="
        )
        assert p.ground_truth == str(extra["a"] + extra["b"])
        assert p.group_id.startswith(f"{extra['index']}-")
    _complete(sock, prompts)
    resent = _ask(sock, _traj(prompts[0].group_id, 0, attempt=1))
    assert isinstance(resent, Ack) and resent.status == "duplicate"
    late = _ask(sock, _traj("never-leased", 0))
    assert isinstance(late, Ack) and late.status == "late"
    batch = _ask(sock, BatchRequest(request_id=7, learner_version=0, num_groups=B))
    assert isinstance(batch, Batch) and batch.request_id == 7
    assert batch.group_ids == [p.group_id for p in prompts for _ in range(N)]
    assert batch.response_offsets.tolist() == [0, 3, 6, 9, 12]
    stats = _stats(sock)
    assert (stats["accepted"], stats["duplicates"], stats["late"]) == (B * N, 1, 1)
    assert (stats["batches_served"], stats["samples_served"]) == (1, B * N)
    assert (stats["leases_granted"], stats["groups_ready"], stats["groups_in_flight"]) == (B, 0, 0)


def test_samples_sent_together_are_each_taken_as_if_alone(client):
    """One Trajectories message, one Acks: a status per sample in its order (accepted,
    duplicate, late, untrainable), and a batch as if they had come one by one."""
    sock = client
    prompts = _lease(sock, 1, version=0, max_groups=5)
    first, second = prompts
    sent = [
        _traj(first.group_id, 0),
        _traj(first.group_id, 0, attempt=1),  # the same sample again
        _traj("never-leased", 0),
        _traj(first.group_id, 1, reward=float("nan")),  # untrainable
        _traj(first.group_id, 1, metrics={f"m{i}": 0.0 for i in range(300)}),  # too many metrics
        _traj(first.group_id, 1),
        _traj(second.group_id, 0),
        _traj(second.group_id, 1, r=5),
    ]
    reply = _ask(sock, Trajectories.pack(sent))
    assert isinstance(reply, Acks) and reply.traj_ids == [t.traj_id for t in sent]
    assert reply.statuses == [
        "accepted", "duplicate", "late", "rejected", "rejected", "accepted", "accepted", "accepted"
    ]  # fmt: skip
    batch = _ask(sock, BatchRequest(request_id=7, learner_version=0, num_groups=B))
    assert isinstance(batch, Batch) and batch.response_offsets.tolist() == [0, 3, 6, 9, 14]
    stats = _stats(sock)
    assert (stats["accepted"], stats["duplicates"], stats["late"]) == (B * N, 1, 1)
    assert (stats["untrainable"], stats["handled"], stats["rejected_invalid"]) == (2, 3, 0)
    # a server speaks only for itself, in a batch too
    other = Trajectories.pack([_traj(first.group_id, 0, server_id=1)])
    reply = ask(sock, other, "server_0")
    assert isinstance(reply, Error) and "may not speak for server 1" in reply.reason


async def test_a_servers_samples_of_one_turn_leave_as_one_message_and_are_all_acknowledged():
    """The rollout server's client: samples put in one event-loop turn travel as one
    Trajectories message (one Acks back); one that cannot be packed (uneven arrays) goes alone
    and is answered `rejected`; nothing stays unacknowledged."""
    from rollout_servers.replay_client import AsyncReplayClient

    with running_replay(_config()) as address, dealer(address) as sock:
        prompts = _lease(sock, 1, version=0, max_groups=5)
        client = AsyncReplayClient(address, KEYRING.key("server_0"), ack_timeout_s=30.0)
        client.start()
        try:
            trajs = [_traj(p.group_id, i) for p in prompts for i in range(N)]
            uneven = _traj(prompts[0].group_id, 0, traj_id="uneven", versions=np.zeros(1, np.int32))
            await asyncio.gather(*(client.put(t) for t in [*trajs[:2], uneven, *trajs[2:]]))
            assert await client.drain(timeout_s=5.0) == 0
            assert (client.counters["ack_accepted"], client.counters["ack_rejected"]) == (B * N, 1)
            stats = _stats(sock)
            # the lease, one Trajectories, the lone Trajectory, and the client's heartbeats
            assert stats["received"] == 3 + stats["heartbeats"] >= 4
            assert (stats["accepted"], stats["untrainable"]) == (B * N, 1)
        finally:
            client.close()


async def test_a_putter_cancelled_in_its_turn_loses_nothing():
    """The client sends a turn's samples itself: cancelling the task that put the first of
    them neither stops the turn's message nor leaves samples for the resender."""
    from rollout_servers.replay_client import AsyncReplayClient

    with running_replay(_config()) as address, dealer(address) as sock:
        prompts = _lease(sock, 1, version=0, max_groups=5)
        client = AsyncReplayClient(address, KEYRING.key("server_0"), ack_timeout_s=30.0)
        client.start()
        try:
            puts = [
                asyncio.create_task(client.put(_traj(p.group_id, i)))
                for p in prompts
                for i in range(N)
            ]
            puts[0].cancel()
            await asyncio.gather(*puts, return_exceptions=True)
            assert await client.drain(timeout_s=5.0) == 0
            assert (client.counters["ack_accepted"], client.counters["resent"]) == (B * N - 1, 0)
            stats = _stats(sock)  # the lease and one Trajectories, and the heartbeats
            assert stats["received"] == 2 + stats["heartbeats"]
        finally:
            client.close()


async def test_a_turn_is_split_below_the_replays_limit_and_an_oversized_sample_is_no_key_error():
    """Samples of one turn that would exceed replay.max_message_mb together go in several
    messages; one sample over the limit on its own is refused (unsigned, before its signature
    is read) and that refusal does not fail the server's lease requests as a key error would."""
    from rollout_servers.replay_client import AsyncReplayClient

    limit = 50_000
    with running_replay(_config(max_message_mb=limit / 2**20)) as address, dealer(address) as sock:
        prompts = _lease(sock, 1, version=0, max_groups=5)
        client = AsyncReplayClient(
            address, KEYRING.key("server_0"), ack_timeout_s=30.0, max_message_bytes=limit
        )
        client.start()
        try:
            big = np.zeros(3_000, np.int32)  # 12 KB each: four of them exceed the limit
            trajs = [_traj(p.group_id, i, prompt_ids=big) for p in prompts for i in range(N)]
            await asyncio.gather(*(client.put(t) for t in trajs))
            assert await client.drain(timeout_s=5.0) == 0
            assert _stats(sock)["rejected_oversized"] == 0
            lease = asyncio.ensure_future(client.lease(0, 0, 1))  # held: no prompt is free
            await asyncio.sleep(0.2)
            await client.put(_traj("too-big", 0, prompt_ids=np.zeros(20_000, np.int32)))
            await asyncio.sleep(0.5)
            assert client.counters["bad_replies"] == 1
            assert await lease == []  # answered empty after the wait, not failed as a key error
        finally:
            client.close()


def test_held_batch_request_is_answered_when_the_groups_complete(patient):
    prompts = _lease(patient, 1, version=0, max_groups=B)
    _complete(patient, prompts[:1])
    send(patient, BatchRequest(5, 0, B))
    assert not patient.poll(100), "one group short: the request must wait"
    last = prompts[1]
    _ask(patient, _traj(last.group_id, 0))
    started = time.monotonic()
    send(patient, _traj(last.group_id, 1))
    replies = [_recv(patient), _recv(patient)]
    assert time.monotonic() - started < PATIENT_S  # answered by the completion, not the timeout
    batch = next(r for r in replies if isinstance(r, Batch))
    assert batch.request_id == 5 and len(batch.traj_ids) == B * N


def test_held_lease_request_is_superseded_by_one_at_the_new_version(patient):
    first = _lease(patient, 1, version=0, max_groups=4)
    assert len(first) == B
    send(patient, LeaseRequest(2, 0, 0, 4))
    assert not patient.poll(100), "admission is full at version 0: the request must wait"
    _complete(patient, first)
    assert isinstance(_ask(patient, BatchRequest(3, 0, B)), Batch)
    assert isinstance(_ask(patient, VersionUpdate(4, 1)), Ack)
    assert not patient.poll(100), "the server still holds version 0: admission must not grant"
    started = time.monotonic()
    # the server's engine moved to version 1: it asks again, which supersedes the held request
    send(patient, LeaseRequest(5, 0, 1, 4))
    replies = {r.request_id: r for r in (_recv(patient), _recv(patient))}
    assert time.monotonic() - started < PATIENT_S
    assert replies[2].prompts == [] and len(replies[5].prompts) == B


def test_held_requests_are_answered_empty_after_the_wait(client):
    _lease(client, 1, version=0, max_groups=B)
    started = time.monotonic()
    grant = _ask(client, LeaseRequest(2, 0, 0, 1))
    batch = _ask(client, BatchRequest(3, 0, B))
    assert isinstance(grant, LeaseGrant) and grant.prompts == []
    assert isinstance(batch, Batch) and batch.traj_ids == [] and batch.request_id == 3
    assert WAIT_S * 2 * 0.9 <= time.monotonic() - started < WAIT_S * 2 + 1.0
    stats = _stats(client)
    assert (stats["empty_grants"], stats["empty_batches"]) == (1, 1)


def test_stale_groups_are_dropped_and_reported_in_the_batch(client):
    prompts = _lease(client, 1, version=0, max_groups=B)
    _complete(client, prompts, version=0)
    _ask(client, VersionUpdate(2, 1))
    fresh = _lease(client, 3, version=1, max_groups=B)
    assert len(fresh) == B
    _complete(client, fresh, version=1)
    batch = _ask(client, BatchRequest(4, learner_version=1, num_groups=B))
    assert isinstance(batch, Batch) and batch.stale_dropped == B
    assert set(batch.group_ids) == {p.group_id for p in fresh}
    assert set(batch.versions.tolist()) == {1}
    assert _stats(client)["stale_dropped"] == B


def test_expired_leases_are_counted_and_reissued():
    with running_replay(_config(lease_timeout_s=0.2)) as address, dealer(address) as sock:
        first = _lease(sock, 1, version=0, max_groups=B)
        time.sleep(0.5)
        again = _lease(sock, 2, version=0, max_groups=B)
        assert _rows(again) == _rows(first)  # the same prompts, under new group ids
        assert not {p.group_id for p in again} & {p.group_id for p in first}
        late = _ask(sock, _traj(first[0].group_id, 0))
        assert isinstance(late, Ack) and late.status == "late"
        stats = _stats(sock)
        assert (stats["expired"], stats["leases_reissued"]) == (B, B)


def _rows(prompts: list[PromptItem]) -> list[str]:
    """The row index part of each group id."""
    return sorted(p.group_id.split("-")[0] for p in prompts)


def test_run_replay_writes_its_counters_on_sigterm(tmp_path: Path):
    address = tcp_address("127.0.0.1", free_port())
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO);"
        "from asyncrl.config import Config; from replay.service import run_replay;"
        "run_replay(Config(), sys.argv[1], sys.argv[2])"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "ASYNCRL_RUN_SECRET": SECRET.hex()}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, address, str(tmp_path)], env=env, stderr=subprocess.PIPE
    )
    try:
        with dealer(address) as sock:
            sock.send_multipart([b"garbage"])  # not even an authentication frame
            reply = _recv(sock, timeout_s=30)
            assert isinstance(reply, Error) and "authentication" in reply.reason
            assert isinstance(_send_raw(sock, [b"garbage"]), Error)  # signed, but not a message
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    stats = json.loads((tmp_path / "stats" / "replay.json").read_text())
    assert (stats["received"], stats["rejected_malformed"]) == (2, 1)
    assert stats["rejected_unauthenticated"] == 1
    assert "replay done" in err.decode()


def test_a_checkpoint_holds_the_replays_state_at_the_learners_version(tmp_path: Path):
    """The state is taken only at the version the learner last published (the version of the
    weights it saves), and holds the groups ready then, whole."""
    with running_replay(_config(), tmp_path) as address, dealer(address) as sock:
        ready = _lease(sock, 1, version=0, max_groups=B)
        _complete(sock, ready)
        assert isinstance(_ask(sock, VersionUpdate(2, 1)), Ack)
        wrong = _ask(sock, CheckpointRequest(3, str(tmp_path / "wrong.msgpack"), 2))
        assert isinstance(wrong, Error) and "the learner is at 1" in wrong.reason
        ok = _ask(sock, CheckpointRequest(4, str(tmp_path / "replay.msgpack"), 1))
        assert isinstance(ok, Ack)
    assert not (tmp_path / "wrong.msgpack").exists()
    state = read_state(tmp_path / "replay.msgpack")
    assert state.version == 1 and [g.item for g in state.ready] == ready
    assert [len(g.samples) for g in state.ready] == [N] * B
    assert state.counters["accepted"] == N * B and state.rows_drawn == B


def test_a_learner_waiting_past_its_bound_for_a_batch_fails_naming_the_replays_counts(caplog):
    """No server ever sends a trajectory: the learner's client reports the replay's counters
    while it waits, then gives up (`trainer.batch_wait_timeout_s`) instead of waiting forever."""
    from asyncrl.wire.auth import role_key
    from asyncrl.wire.replay_client import BatchWaitTimeout, ReplayClient

    with running_replay(_config()) as address:
        client = ReplayClient(address, role_key(SECRET, "learner"))
        started = time.monotonic()
        with (
            caplog.at_level("WARNING", "asyncrl.wire.replay_client"),
            pytest.raises(BatchWaitTimeout, match=r"no batch for version 0 .*batches_served=0"),
        ):
            client.fetch_batch(0, B, give_up_s=2.0, report_every_s=0.5)
        assert 2.0 <= time.monotonic() - started < 2.0 + 3 * WAIT_S + 5.0
        assert any(
            "waiting" in r.message and "leases_granted=0" in r.message for r in caplog.records
        )
        assert client.fetch_batch(0, B, should_stop=lambda: True) is None  # stopping still wins
