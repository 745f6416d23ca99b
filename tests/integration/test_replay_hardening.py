"""Issue 13's cases against a live replay: each message that once crashed it or steered a run,
and the rules that now stop it (authentication, roles, confinement, quotas, numbers)."""

import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from replay_peers import SECRET, ask, dealer, running_replay, send, signed
from replay_peers import trajectory as _traj

from asyncrl.config import Config
from asyncrl.wire.auth import role_key
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.protocol import (
    Ack,
    ChatMessage,
    CheckpointRequest,
    DeclareDead,
    Error,
    EvalPoll,
    EvalResults,
    EvalSubmit,
    GroupFailed,
    LeaseGrant,
    LeaseRequest,
    PromptItem,
    Stats,
    StatsRequest,
    VersionUpdate,
)
from asyncrl.wire.router import accounted
from asyncrl.wire.samples import Batch, BatchRequest
from asyncrl.wire.sockets import free_port, tcp_address
from replay.eval_jobs import MAX_OPEN_JOBS
from replay.service import setup_replay_service

pytestmark = pytest.mark.integration

N, B = 2, 2


def _config(**sections) -> Config:
    base = {
        "rollout": {"n": N, "num_servers": 2, "max_concurrent_groups": 4},
        "data": {"train_batch_size": B},
        "replay": {"max_staleness": 4, "wait_timeout_s": 0.3, "capacity_groups": 64},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return Config.model_validate(base)


def _stats(sock: zmq.Socket) -> dict[str, float]:
    reply = ask(sock, StatsRequest(99), "client")
    assert isinstance(reply, Stats)
    return reply.counters


def _round_trip(sock: zmq.Socket, version: int = 0) -> Batch:
    """lease -> trajectories -> batch: the replay still does its job."""
    grant = ask(sock, LeaseRequest(1, 0, version, B))
    assert isinstance(grant, LeaseGrant) and len(grant.prompts) == B
    for p in grant.prompts:
        for i in range(p.n):
            ack = ask(sock, _traj(p.group_id, i, versions=np.full(3, version, np.int32)))
            assert isinstance(ack, Ack) and ack.status == "accepted"
    batch = ask(sock, BatchRequest(2, version, B))
    assert isinstance(batch, Batch) and len(batch.traj_ids) == B * N
    return batch


@pytest.fixture
def sock():
    with running_replay(_config()) as address, dealer(address) as s:
        yield s


def test_a_trajectory_naming_an_array_with_a_list_is_rejected_and_the_run_goes_on(sock):
    frames = [bytes(f) for f in encode(_traj("g", 0))]
    assert len(frames) == 6  # the six-frame Trajectory that stopped a 600-step run at step 59
    header = msgpack.unpackb(frames[0])
    header["arrays"][0][0] = ["prompt_ids"]
    reply = ask(sock, [msgpack.packb(header), *frames[1:]], "server_0")
    assert isinstance(reply, Error) and "array descriptor" in reply.reason
    _round_trip(sock)
    stats = _stats(sock)
    assert stats["rejected_malformed"] == 1 and stats["handler_errors"] == 0 and accounted(stats)


def test_rewards_and_metrics_must_stay_finite_and_in_range(sock):
    grant = ask(sock, LeaseRequest(1, 0, 0, 1))
    g = grant.prompts[0].group_id
    for bad in (
        _traj(g, 0, reward=1e39),  # finite in float64, +inf in the float32 batch
        _traj(g, 0, reward=float("-inf")),
        _traj(g, 0, baseline_reward=1e39),
        _traj(g, 0, metrics={"tool_reward": 1e39}),
        _traj(g, 0, behaviour_logprobs=np.array([-0.5, np.inf, -0.5], np.float32)),
        _traj(g, 0, reward=3e38),  # finite in float32, but two of them overflow a group's std
    ):
        reply = ask(sock, bad)
        assert isinstance(reply, Ack) and reply.status == "rejected"
    assert ask(sock, _traj(g, 0, reward=-1e6)).status == "accepted"  # MAX_ABS_REWARD passes
    assert _stats(sock)["rejected_invalid"] == 6


def test_an_evaluation_trajectory_is_checked_like_a_training_one(sock):
    item = PromptItem("e1", 1, "src", [ChatMessage("user", "q")], "1", {}, eval_job="job")
    assert isinstance(ask(sock, EvalSubmit(1, "job", [item]), "client"), Ack)
    grant = ask(sock, LeaseRequest(2, 0, 0, 1))
    assert [p.group_id for p in grant.prompts] == ["e1"]
    uneven = _traj("e1", 0, versions=np.zeros(1, np.int32))
    reply = ask(sock, uneven)
    assert isinstance(reply, Ack) and reply.status == "rejected"
    assert ask(sock, _traj("e1", 0, reward=0.5)).status == "accepted"
    results = ask(sock, EvalPoll(3, "job"), "client")
    assert isinstance(results, EvalResults) and results.scores.tolist() == [0.5]
    assert _stats(sock)["handler_errors"] == 0


def test_checkpoints_are_written_only_inside_the_run_directory(tmp_path: Path):
    run_dir = tmp_path / "run"
    (run_dir / "ckpt").mkdir(parents=True)
    (run_dir / "a_file").write_text("x")
    (run_dir / "escape").symlink_to(tmp_path)
    with running_replay(_config(), run_dir) as address, dealer(address) as s:
        for path, reason in [
            (str(run_dir / "a_file" / "replay.json"), "cannot write checkpoint"),
            (str(tmp_path / "outside.json"), "outside the run directory"),
            (str(run_dir / ".." / "outside.json"), "outside the run directory"),
            (str(run_dir / "escape" / "outside.json"), "outside the run directory"),
            ("/etc/passwd", "outside the run directory"),
            (str(run_dir), "outside the run directory"),
        ]:
            reply = ask(s, CheckpointRequest(1, path, 0))
            assert isinstance(reply, Error) and reason in reply.reason, (path, reply)
        assert not (tmp_path / "outside.json").exists()
        ok = ask(s, CheckpointRequest(2, str(run_dir / "ckpt" / "replay.json"), 0))
        assert isinstance(ok, Ack) and (run_dir / "ckpt" / "replay.json").is_file()
        stats = _stats(s)
        assert (stats["rejected_invalid"], stats["rejected_forbidden"]) == (1, 5)


_EVERY_REQUEST = [
    LeaseRequest(1, 0, 0, 4),
    _traj("g", 0),
    BatchRequest(1, 0, B),
    VersionUpdate(1, 10**9),
    StatsRequest(1),
    EvalSubmit(1, "job", []),
    EvalPoll(1, "job"),
    CheckpointRequest(1, "replay.json", 0),
    DeclareDead(1, 0, 0, "chaos"),
]


def test_a_peer_without_the_secret_can_neither_read_nor_change_anything(sock):
    wrong = role_key(b"another run's secret, 32 bytes!", "learner")
    for msg in _EVERY_REQUEST:
        frames = [bytes(f) for f in encode(msg)]
        for attempt in (
            [b"", *frames],  # no authentication
            [wrong.sign(frames), *frames],  # another run's key
            [signed(frames, "learner")[0], *frames[:-1], frames[-1] + b"x"],  # changed after
            [signed([*frames, b"x"], "learner")[0], *frames],  # a frame dropped after
            [b"learner:" + b"\0" * 32, *frames],  # a guessed signature
            [b"x" * 1000, *frames],
        ):
            sock.send_multipart(attempt)
            reply = sock.recv_multipart() if sock.poll(3000) else None
            assert reply is not None and reply[0] == b"", "answered with no signature"
            error = decode(reply[1:])
            assert isinstance(error, Error) and "authenticat" in error.reason
    stats = _stats(sock)
    assert stats["rejected_unauthenticated"] == 6 * len(_EVERY_REQUEST)
    assert stats["received"] == stats["rejected_unauthenticated"]
    assert (stats["learner_version"], stats["leases_granted"], stats["eval_jobs"]) == (0, 0, 0)


@pytest.mark.parametrize(
    "role, forbidden",
    [
        ("server_0", [BatchRequest(1, 0, B), VersionUpdate(1, 5), CheckpointRequest(1, "r", 0)]),
        ("server_1", [EvalSubmit(1, "job", []), EvalPoll(1, "job"), DeclareDead(1, 0, 0, "x")]),
        ("client", [LeaseRequest(1, 0, 0, 4), _traj("g", 0), BatchRequest(1, 0, B)]),
        ("client", [VersionUpdate(1, 5), CheckpointRequest(1, "r", 0), DeclareDead(1, 1, 0, "")]),
        ("learner", [LeaseRequest(1, 0, 0, 4), _traj("g", 0), GroupFailed(1, 0, "g", "x")]),
        ("client", [GroupFailed(1, 0, "g", "x")]),
    ],
)
def test_each_role_may_send_only_its_own_messages(sock, role, forbidden):
    for msg in forbidden:
        reply = ask(sock, msg, role)
        kind = role.partition("_")[0]
        assert isinstance(reply, Error) and f"a {kind} may not send" in reply.reason
    stats = _stats(sock)
    assert stats["rejected_forbidden"] == len(forbidden)
    assert (stats["learner_version"], stats["leases_granted"], stats["batch_requests"]) == (0,) * 3


def test_one_server_cannot_take_all_capacity_nor_fill_another_servers_groups(sock):
    grant = ask(sock, LeaseRequest(1, 0, 0, 2**31 - 1))  # today: all 64 groups for 600 s
    assert isinstance(grant, LeaseGrant) and len(grant.prompts) == 4  # max_concurrent_groups
    again = ask(sock, LeaseRequest(2, 0, 0, 4))  # held, then answered empty: quota spent
    assert isinstance(again, LeaseGrant) and again.prompts == []
    other = ask(sock, LeaseRequest(3, 1, 0, 4))  # the other server still gets its share
    assert len(other.prompts) == 4
    theirs = _traj(other.prompts[0].group_id, 0)  # server 0 writing into server 1's group
    reply = ask(sock, theirs)
    assert isinstance(reply, Ack) and reply.status == "rejected"
    for server, signer in [(1, "server_0"), (7, "server_0")]:  # speaking for another server
        reply = ask(sock, LeaseRequest(4, server, 0, 4), signer)
        assert isinstance(reply, Error) and f"may not speak for server {server}" in reply.reason
    reply = ask(sock, GroupFailed(5, 1, other.prompts[0].group_id, "x"), "server_0")
    assert isinstance(reply, Error) and "may not speak for server 1" in reply.reason
    reply = ask(sock, GroupFailed(5, 0, other.prompts[0].group_id, "x"), "server_0")
    assert isinstance(reply, Ack) and reply.status == "late"  # not its lease: nothing ends
    assert _stats(sock)["groups_failed"] == 0
    reply = ask(sock, LeaseRequest(4, 2, 0, 4), "server_2")  # rollout.num_servers=2: no key
    assert isinstance(reply, Error) and "authenticat" in reply.reason


def test_evaluation_jobs_are_bounded_and_their_state_is_freed(sock):
    def job(i: int, n: int = 1) -> EvalSubmit:
        item = PromptItem(f"j{i}", n, "s", [ChatMessage("user", "q")], "1", {}, eval_job=f"j{i}")
        return EvalSubmit(i, f"j{i}", [item])

    frames = [bytes(f) for f in encode(job(0))]
    header = msgpack.unpackb(frames[0])
    header["fields"]["prompts"][0]["n"] = 10**12  # today: passed on to the servers
    reply = ask(sock, [msgpack.packb(header)], "client")
    assert isinstance(reply, Error) and "PromptItem.n" in reply.reason
    replies = [ask(sock, job(i), "client") for i in range(1, 2 * MAX_OPEN_JOBS)]
    assert sum(isinstance(r, Ack) for r in replies) == MAX_OPEN_JOBS
    assert all("evaluation jobs are open" in r.reason for r in replies if isinstance(r, Error))
    assert _stats(sock)["rejected_quota"] == MAX_OPEN_JOBS - 1


def test_eval_jobs_nobody_polls_are_freed_with_their_prompts():
    from replay.eval_jobs import FINISHED_KEEP_S, EvalJobs

    jobs = EvalJobs(forget_after_s=10.0)
    item = PromptItem("g1", 1, "s", [ChatMessage("user", "q")], "1", {}, eval_job="a")
    done = PromptItem("g2", 1, "s", [ChatMessage("user", "q")], "1", {}, eval_job="b")
    jobs.submit("a", [item], now=0.0)
    jobs.submit("b", [done], now=0.0)
    assert jobs.take(1, server_id=0) == [item]
    jobs.add(_traj("g1", 0), now=1.0)  # job a finished; job b never leased, never polled
    jobs.results(1, "a", now=2.0)
    jobs.expire(now=9.0)
    assert jobs.owns("g1") and jobs.owns("g2")
    jobs.expire(now=11.0)  # b: nobody asked for 11 s
    assert not jobs.owns("g2") and jobs.pending == 0 and jobs.freed == 1
    jobs.expire(now=2.0 + FINISHED_KEEP_S + 1)  # a: finished and fetched
    assert not jobs.owns("g1") and jobs.freed == 2


def test_silent_servers_are_forgotten():
    from replay.fleet_stats import FleetStats

    fleet = FleetStats()
    fleet.report(0, 1.0, 0.0, 2.0, now=0.0)
    fleet.report(1, 1.0, 0.0, 2.0, now=5.0)
    fleet.forget_silent(now=8.0, silent_s=6.0)
    assert fleet.forgotten == 1 and set(fleet.for_batch([], 0, 0)) >= {"server_idle_ratio"}


def test_an_exception_in_a_handler_is_counted_and_the_loop_goes_on():
    cfg = _config()
    address = tcp_address("127.0.0.1", free_port())
    service = setup_replay_service(cfg, address, None, secret=SECRET)

    def broken(peer, msg):
        raise KeyError("a bug")

    service._handlers[VersionUpdate] = broken
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    try:
        with dealer(address) as s:
            reply = ask(s, VersionUpdate(1, 3))
            assert (
                isinstance(reply, Error)
                and "internal error handling version_update" in reply.reason
            )
            _round_trip(s)
            stats = _stats(s)
            assert stats["handler_errors"] == 1 and accounted(stats)
    finally:
        stop.set()
        thread.join(timeout=5)
        service.close()
    assert not thread.is_alive()


def test_replies_are_signed_for_the_role_that_asked(sock):
    send(sock, StatsRequest(5), "client")
    assert sock.poll(3000)
    frames = sock.recv_multipart()
    role_key(SECRET, "client").check(frames[0], frames[1:])
    with pytest.raises(ValueError):
        role_key(SECRET, "learner").check(frames[0], frames[1:])
    assert isinstance(decode(frames[1:]), Stats)


def test_a_client_with_the_wrong_secret_is_told_at_once(sock):
    from asyncrl.wire.auth import AuthError, new_secret
    from asyncrl.wire.replay_client import ReplayClient

    address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    client = ReplayClient(address, role_key(new_secret(), "client"), reply_timeout_s=30)
    try:
        with pytest.raises(AuthError, match="refused this process's client key"):
            client.stats()
    finally:
        client.close()
    assert (
        ReplayClient(address, role_key(SECRET, "client")).stats()["rejected_unauthenticated"] == 1
    )


def test_finished_evaluation_jobs_make_room_for_new_ones():
    from replay.eval_jobs import MAX_JOBS, EvalJobs

    jobs = EvalJobs(forget_after_s=600.0)
    for i in range(3 * MAX_JOBS):  # each finished at once: only the open ones are a quota
        item = PromptItem(f"g{i}", 1, "s", [ChatMessage("user", "q")], "1", {}, eval_job=f"j{i}")
        jobs.submit(f"j{i}", [item], now=float(i))
        assert jobs.take(1, 0) == [item] and jobs.add(_traj(f"g{i}", 0), now=float(i)) == "accepted"
    assert len(jobs._jobs) == MAX_JOBS and jobs.freed == 2 * MAX_JOBS
    assert jobs.owns(f"g{3 * MAX_JOBS - 1}") and not jobs.owns("g0")


def test_samples_must_fit_the_model(tmp_path):
    """Token ids outside the vocabulary, or more tokens than the model's context, crashed the
    learner's embedding (found by red-teaming)."""
    from replay.sample_checks import TokenLimits

    (tmp_path / "config.json").write_text('{"vocab_size": 100, "max_position_embeddings": 64}')
    limits = TokenLimits.of_model(str(tmp_path))
    assert limits == TokenLimits(100, 64)
    cfg = _config()
    address = tcp_address("127.0.0.1", free_port())
    service = setup_replay_service(cfg, address, None, str(tmp_path), secret=SECRET)
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    try:
        with dealer(address) as s:
            g = ask(s, LeaseRequest(1, 0, 0, 1)).prompts[0].group_id
            for bad in (
                _traj(g, 0, prompt_ids=np.array([1, -7], np.int32)),
                _traj(g, 0, response_ids=np.array([1, 2, 100], np.int32)),
                _traj(g, 0, prompt_ids=np.ones(62, np.int32)),  # 62 + 3 > 64
            ):
                reply = ask(s, bad)
                assert isinstance(reply, Ack) and reply.status == "rejected"
            assert ask(s, _traj(g, 0, prompt_ids=np.ones(61, np.int32))).status == "accepted"
    finally:
        stop.set()
        thread.join(timeout=5)
        service.close()


def test_held_leases_stay_one_per_server_whatever_the_identities():
    # held 10 s: none is answered by its wait running out while the test looks
    with (
        running_replay(_config(replay={"wait_timeout_s": 10.0})) as address,
        dealer(address) as sock,
    ):
        assert len(ask(sock, LeaseRequest(1, 0, 0, 4)).prompts) == 4  # server 0's quota is spent
        peers = [zmq.Context.instance().socket(zmq.DEALER) for _ in range(50)]
        try:
            for p in peers:
                p.connect(address)
                send(p, LeaseRequest(2, 0, 0, 4))  # held: each supersedes the one before
            deadline = time.monotonic() + 10
            while (stats := _stats(sock))["lease_requests"] < 51 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert stats["lease_requests"] == 51 and stats["held_lease_requests"] == 1
            assert stats["empty_grants"] == 49  # the superseded ones
        finally:
            for p in peers:
                p.close(linger=0)


def test_evaluation_takes_at_most_half_a_grant_while_training_can_use_the_rest(sock):
    items = [
        PromptItem(f"e{i}", 1, "s", [ChatMessage("user", "q")], "1", {}, eval_job="big")
        for i in range(100)
    ]
    assert isinstance(ask(sock, EvalSubmit(1, "big", items), "client"), Ack)
    grant = ask(sock, LeaseRequest(2, 0, 0, 4))
    assert sorted(bool(p.eval_job) for p in grant.prompts) == [False, False, True, True]


def test_an_evaluation_group_gives_exactly_its_n_samples_from_its_server(sock):
    item = PromptItem("e1", 2, "src", [ChatMessage("user", "q")], "1", {}, eval_job="job")
    assert isinstance(ask(sock, EvalSubmit(1, "job", [item]), "client"), Ack)
    assert [p.group_id for p in ask(sock, LeaseRequest(2, 0, 0, 1)).prompts] == ["e1"]
    statuses = [
        ask(sock, _traj("e1", 0, traj_id="a")).status,
        ask(sock, _traj("e1", 0, traj_id="b")).status,  # the same slot under another id
        ask(sock, _traj("e1", 2, traj_id="c")).status,  # n=2: no third sample
        ask(sock, _traj("e1", 1, traj_id="d")).status,
    ]
    assert statuses == ["accepted", "duplicate", "rejected", "accepted"]
    other = ask(sock, _traj("e1", 1, traj_id="e", server_id=1))  # server 1 never leased it
    assert isinstance(other, Ack) and other.status == "rejected"
    assert ask(sock, EvalPoll(3, "job"), "client").group_ids == ["e1", "e1"]


def test_a_frame_over_the_size_limit_is_dropped_before_it_is_buffered():
    """Twice replay.max_message_mb is ZeroMQ's MAXMSGSIZE: a larger frame closes the sender's
    connection inside ZeroMQ and never reaches the replay (red-teaming: a forged 1.5 GB frame
    was read whole first, +2.9 GB RSS)."""
    with running_replay(_config(replay={"max_message_mb": 0.01})) as address:
        with dealer(address) as s:
            s.send_multipart([b"", b"x" * (1 << 20)])  # 1 MiB, limit 10 KiB
            time.sleep(0.3)
        with dealer(address) as s:
            stats = _stats(s)
        assert stats["received"] == 0 and stats["rejected_oversized"] == 0
