"""Dead and hung rollout servers are detected and restarted, with real processes and sockets.

In this process: a server's client heartbeats; the replay declares it dead once it is silent for
launch.server_timeout_s, re-issues its leases and answers its late samples `late`; the same
epoch is refused afterwards (its client stops) and a newer epoch is alive again.
With the launcher: a SIGKILLed server is restarted as epoch 1 and the run completes with no
sample trained twice; a SIGSTOPped one is declared dead within the timeout, killed and
restarted; a server out of restarts is dropped and training goes on with the other one."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from replay_peers import KEYRING, ask, dealer, running_replay, trajectory

from asyncrl.config import Config
from asyncrl.metrics import read_jsonl
from asyncrl.run_spec import RunSpec
from asyncrl.wire.auth import read_secret, role_key, server_role
from asyncrl.wire.protocol import Ack, LeaseGrant, LeaseRequest, Stats, StatsRequest
from asyncrl.wire.replay_client import ReplayClient
from rollout_servers.replay_client import AsyncReplayClient

pytestmark = pytest.mark.integration

TIMEOUT_S = 3.0  # launch.server_timeout_s of the launched runs
HEALTH = ["launch.heartbeat_s=0.5", f"launch.server_timeout_s={TIMEOUT_S}"]


# ---- the replay and a server's client, in this process ----------------------------------------
async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until `condition()` holds (polled while the event loop runs)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} within {timeout_s}s"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def _client(address: str, epoch: int) -> AsyncReplayClient:
    return AsyncReplayClient(
        address,
        KEYRING.key(server_role(0, epoch)),
        ack_timeout_s=30.0,
        heartbeat_s=0.2,
    )


async def test_a_silent_server_is_declared_dead_its_leases_reissued_and_a_new_epoch_replaces_it():
    cfg = Config.model_validate(
        {
            "rollout": {"n": 2, "num_servers": 2},
            "data": {"train_batch_size": 2},
            "launch": {"heartbeat_s": 0.2, "server_timeout_s": 1.0},
        }
    )
    with running_replay(cfg) as address, dealer(address) as sock:
        learner = ReplayClient(address, KEYRING.key("learner"), reply_timeout_s=5.0)
        first = _client(address, epoch=0)
        first.start()
        await _until(lambda: learner.server_epochs() == {0: 0}, 5.0, "server 0 alive")
        grant = ask(sock, LeaseRequest(1, 0, 0, 2))
        assert isinstance(grant, LeaseGrant) and len(grant.prompts) == 2
        assert [s.in_flight for s in learner.server_health()] == [2]
        first.close()  # silent from now on, as a killed or stopped server is
        took = await _until(lambda: learner.server_epochs() == {}, 5.0, "declared dead")
        # the timeout, then up to two of the replay's checks (1 s apart, plus a 0.1 s loop tick;
        # measured 2.0-2.1 s), and slack for a stalled test process; health.silent_s below
        # shows it was not declared before the timeout
        assert took < 1.0 + 2 * 1.1 + 1.5
        (health,) = learner.server_health()
        assert (health.server_id, health.epoch, health.alive, health.in_flight) == (0, 0, False, 0)
        assert health.silent_s > 1.0
        stats = learner.stats()
        assert (stats["servers_declared_dead"], stats["dead_server_leases"]) == (1, 2)
        late = ask(sock, trajectory(grant.prompts[0].group_id, 0))
        assert isinstance(late, Ack) and late.status == "late"  # never trained

        zombie = _client(address, epoch=0)  # the dead epoch, come back (SIGCONT)
        heartbeat = zombie.start()[-1]
        with pytest.raises(RuntimeError, match="refused the heartbeat of server_0 epoch 0"):
            await asyncio.wait_for(heartbeat, 5.0)
        zombie.close()

        restarted = _client(address, epoch=1)
        restarted.start()
        try:
            await _until(lambda: learner.server_epochs() == {0: 1}, 5.0, "epoch 1 alive")
            again = await restarted.lease(0, version=0, max_groups=2)
            assert [p.messages for p in again] == [p.messages for p in grant.prompts]
            assert learner.stats()["leases_reissued"] == 2
        finally:
            restarted.close()
            learner.close()


def test_the_stats_reply_carries_every_servers_health():
    cfg = Config.model_validate({"rollout": {"num_servers": 2}})
    with running_replay(cfg) as address, dealer(address) as sock:
        reply = ask(sock, StatsRequest(1), role="client")
        assert isinstance(reply, Stats) and reply.servers == []
        assert reply.counters["servers_alive"] == 0


# ---- with the launcher: real runs ---------------------------------------------------------
def _start(tmp_path: Path, command: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "asyncrl.launch.cli",
        command,
        "trainer.warmstart_steps=10",
        f"trainer.cache_dir={tmp_path.parent / 'restart_cache'}",
        f"trainer.run_dir={run_dir}",
        "launch.progress=line",
        "launch.restart_backoff_s=0.5",
        *HEALTH,
        *overrides,
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, run_dir


def _replay(run_dir: Path) -> ReplayClient:
    spec = RunSpec.load(run_dir / "launch.json")
    key = role_key(read_secret(str(run_dir)), "client")
    return ReplayClient(spec.replay_address, key, reply_timeout_s=5.0)


def _wait(proc: subprocess.Popen, condition: Callable[[], bool], timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the launcher ended before {what}: {proc.communicate()}")
        assert time.monotonic() < deadline, f"{what} within {timeout_s}s"
        time.sleep(0.1)


def _member(launcher_pid: int, name: str) -> psutil.Process:
    children = psutil.Process(launcher_pid).children()
    return next(p for p in children if p.environ().get("ASYNCRL_PROCESS") == name)


def _epochs(run_dir: Path) -> dict[int, int]:
    if not (run_dir / "launch.json").is_file():
        return {}
    client = _replay(run_dir)
    try:
        return client.server_epochs()
    except Exception:  # not answering yet
        return {}
    finally:
        client.close()


def _holds_leases(run_dir: Path, server: int) -> bool:
    """Whether the replay says `server` is alive with incomplete leases (and training runs)."""
    if _steps(run_dir) < 2:
        return False
    client = _replay(run_dir)
    try:
        return any(s.server_id == server and s.in_flight > 0 for s in client.server_health())
    finally:
        client.close()


def _kill_holding_leases(proc, run_dir: Path, server: int) -> None:
    """SIGKILL the server while it holds incomplete leases: frozen first (SIGSTOP), so that its
    groups cannot complete between the replay's answer and the kill; let go and tried again
    when the frozen server turns out to hold none."""
    for _ in range(20):
        _wait(proc, lambda: _holds_leases(run_dir, server), 180, f"server_{server} holding leases")
        member = _member(proc.pid, f"server_{server}")
        member.suspend()
        time.sleep(0.3)  # what it had already sent reaches the replay
        if _holds_leases(run_dir, server):
            member.kill()
            return
        member.resume()
    raise AssertionError(f"server_{server} never held a lease while frozen")


def _steps(run_dir: Path) -> int:
    return len([r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward_mean" in r])


def _restarts(run_dir: Path) -> list[tuple[str, int, str]]:
    return [(r["server"], r["epoch"], r["event"]) for r in read_jsonl(run_dir / "restarts.jsonl")]


def _no_sample_trained_twice(run_dir: Path, n: int = 4) -> None:
    steps = read_jsonl(run_dir / "samples.jsonl")
    trained = [t for s in steps for t in s["traj_ids"]]
    assert trained and len(set(trained)) == len(trained)
    groups = Counter(g for s in steps for g in s["group_ids"])  # each step lists its groups
    assert set(groups.values()) == {1} and len(trained) == n * len(groups)  # whole, once


STEPS = 120  # long enough for a restarted server to load and sample again
TRAIN = [
    "rollout.num_servers=2",
    "rollout.temperature=4.0",  # long random responses: a server always has groups in flight
    "rollout.max_new_tokens=64",
    "trainer.log_samples=true",
    "trainer.save_final=false",
    "data.train_batch_size=4",
    "rollout.n=4",
]


@pytest.mark.long
def test_a_killed_server_is_restarted_as_epoch_1_and_the_run_completes(tmp_path):
    proc, run_dir = _start(
        tmp_path, "launch", *TRAIN, f"trainer.total_steps={STEPS}", "learner.weight_checksum=true"
    )
    _kill_holding_leases(proc, run_dir, server=1)
    killed_at = _steps(run_dir)
    _wait(proc, lambda: _epochs(run_dir).get(1) == 1, 60, "server_1 back as epoch 1")
    back_at = _steps(run_dir)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert "asyncrl: server_1 was killed by signal SIGKILL; restart 1/3 in 0.5s" in out
    assert _restarts(run_dir) == [("server_1", 1, "restart")]
    assert _steps(run_dir) == STEPS > back_at
    stats = json.loads((run_dir / "stats" / "replay.json").read_text())
    # its incomplete leases were taken back (declared dead, or replaced by epoch 1) and leased
    # again; its samples that arrived later were answered late, not trained
    assert stats["dead_server_leases"] >= 1
    assert stats["leases_reissued"] >= stats["dead_server_leases"]
    _no_sample_trained_twice(run_dir)
    _rejoined_with_the_learners_weights(run_dir, server=1, epoch=1, not_before=killed_at)


@pytest.mark.long
def test_a_frozen_server_holds_training_for_the_give_up_bound_not_the_server_timeout(tmp_path):
    """A server SIGSTOPped while training: the learner's next weight sync waits for it only
    until the replay has not heard from it for launch.sync_give_up_s (2 s here, against a
    server_timeout_s of 60 s), then goes on with the other server and has it declared dead;
    the launcher restarts it, it rejoins with the learner's weights, the run completes."""
    proc, run_dir = _start(
        tmp_path,
        "launch",
        *TRAIN,
        f"trainer.total_steps={STEPS}",
        "learner.weight_checksum=true",
        "launch.server_timeout_s=60",
        "launch.sync_give_up_s=2",
    )
    _wait(proc, lambda: _holds_leases(run_dir, 1), 180, "server_1 holding leases")
    _member(proc.pid, "server_1").suspend()
    frozen_at, t0 = _steps(run_dir), time.monotonic()
    _wait(proc, lambda: bool(_restarts(run_dir)), 60, "a restart")
    # silent 2 s, seen by the learner's next poll (1 s) once a sync waits on it, the launcher's
    # next poll (1 s), the backoff (0.5 s): far inside the 60 s of server_timeout_s
    assert time.monotonic() - t0 < 15
    (record,) = read_jsonl(run_dir / "restarts.jsonl")
    assert (record["server"], record["epoch"]) == ("server_1", 1)
    assert record["why"].startswith("was declared dead by the replay (silent for ")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    (drop,) = [r for r in read_jsonl(run_dir / "sync_members.jsonl") if r["event"] == "dropped"]
    assert (drop["server"], drop["epoch"]) == (1, 0) and "sync_give_up_s 2" in drop["reason"]
    stats = json.loads((run_dir / "stats" / "replay.json").read_text())
    assert stats["servers_declared_dead_by_learner"] == 1
    assert stats["servers_declared_dead"] == 0  # not by the replay's own 60 s rule
    assert _steps(run_dir) == STEPS
    _no_sample_trained_twice(run_dir)
    _rejoined_with_the_learners_weights(run_dir, server=1, epoch=1, not_before=frozen_at)


def _rejoined_with_the_learners_weights(run_dir, server: int, epoch: int, not_before: int):
    """The restarted epoch joined the weight sync at a version no older than the learner's when
    it died, and at that version and every later one holds exactly the learner's weights."""
    learner = {r["version"]: r["checksum"] for r in read_jsonl(run_dir / "weights_learner.jsonl")}
    records = read_jsonl(run_dir / f"weights_server_{server}.jsonl")
    synced = [r for r in records if r["epoch"] == epoch and r["version"] > 0]
    assert synced, f"epoch {epoch} of server_{server} never received a version"
    assert synced[0]["version"] >= not_before
    assert all(r["checksum"] == learner[r["version"]] for r in synced), synced
    joins = [
        r
        for r in read_jsonl(run_dir / "sync_members.jsonl")
        if r["event"] == "joined" and (r["server"], r["epoch"]) == (server, epoch)
    ]
    assert [r["version"] for r in joins] == [synced[0]["version"]]


@pytest.mark.long  # over 30 s: its own CI step (the default tier stays under 15 min)
def test_a_stopped_server_is_declared_dead_within_the_timeout_killed_and_restarted(tmp_path):
    """Serving only (no learner): the replay notices the silence, the launcher kills the
    stopped process and starts epoch 1."""
    proc, run_dir = _start(tmp_path, "serve", "rollout.num_servers=2")
    try:
        _wait(proc, lambda: _epochs(run_dir) == {0: 0, 1: 0}, 180, "both servers alive")
        stopped = _member(proc.pid, "server_1")
        stopped.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        _wait(proc, lambda: bool(_restarts(run_dir)), 30, "a restart")
        # silent TIMEOUT_S, then seen by the replay's next check (<= 1 s) and the launcher's
        # next poll (<= 1.05 s), then the backoff (0.5 s) and the loop that writes the record
        # (<= 0.5 s), and slack for three processes on two loaded cores
        assert time.monotonic() - t0 < TIMEOUT_S + 1 + 1.05 + 0.5 + 0.5 + 3
        assert not stopped.is_running() or stopped.status() == psutil.STATUS_ZOMBIE
        (record,) = read_jsonl(run_dir / "restarts.jsonl")
        assert (record["server"], record["epoch"]) == ("server_1", 1)
        assert record["why"].startswith("was declared dead by the replay (silent for ")
        _wait(proc, lambda: _epochs(run_dir) == {0: 0, 1: 1}, 60, "server_1 back as epoch 1")
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert "asyncrl: server_1 was declared dead by the replay (silent for " in out


@pytest.mark.long
def test_a_server_out_of_restarts_is_dropped_and_training_goes_on_with_the_other(tmp_path):
    proc, run_dir = _start(
        tmp_path, "launch", *TRAIN, f"trainer.total_steps={STEPS}", "launch.max_restarts=1"
    )
    _wait(proc, lambda: _holds_leases(run_dir, 1), 180, "server_1 holding leases")
    _member(proc.pid, "server_1").kill()
    _wait(proc, lambda: _epochs(run_dir).get(1) == 1, 60, "server_1 back as epoch 1")
    _member(proc.pid, "server_1").kill()
    _wait(proc, lambda: len(_restarts(run_dir)) == 2, 30, "server_1 dropped")
    dropped_at = _steps(run_dir)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert "asyncrl: server_1 dropped after 1 restarts: was killed by signal SIGKILL" in out
    assert _restarts(run_dir) == [("server_1", 1, "restart"), ("server_1", 1, "dropped")]
    assert _steps(run_dir) == STEPS > dropped_at  # trained on with server_0 alone
    _no_sample_trained_twice(run_dir)
