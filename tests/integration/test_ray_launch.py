"""launch.backend=ray on a local Ray cluster: the embedded default learns as it does under the
local launcher; a dead server actor is restarted in its bundle as epoch 1; with restarts off a
dead actor stops the run, is named, and leaves no process behind."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from asyncrl.launch.progress import training_rows
from asyncrl.metrics import read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.long]

STEPS = 200  # the local launcher's default run: reward ~0.30 -> ~0.77 over its first 200 steps


def _launch(
    tmp_path: Path, *overrides: str, cache: Path | None = None
) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "asyncrl.launch.cli",
        "launch",
        "launch.backend=ray",
        f"trainer.cache_dir={cache or tmp_path / 'cache'}",
        f"trainer.run_dir={run_dir}",
        "launch.progress=line",
        *overrides,
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, run_dir


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_the_embedded_default_learns_under_ray(tmp_path, model_cache):
    proc, run_dir = _launch(tmp_path, f"trainer.total_steps={STEPS}", cache=model_cache)
    out, err = proc.communicate(timeout=480)
    assert proc.returncode == 0, err

    assert "started a local Ray cluster" in out and "Ray actors placed on 1 node(s)" in out
    rows = training_rows(read_jsonl(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    first = _mean([r["reward_mean"] for r in rows[:5]])
    last = _mean([r["reward_mean"] for r in rows[-20:]])
    assert last > 0.55 and last - first > 0.25, f"reward {first:.3f} -> {last:.3f}"
    assert all(r["staleness_max"] <= 2 for r in rows)
    # every role ran to a graceful stop, through the same files as under the local launcher
    for name in ("replay", "server_0", "learner"):
        assert (run_dir / "stats" / f"{name}.json").is_file(), f"{name} wrote no stats"
    assert (run_dir / "final" / "config.json").is_file()


def _fleet_processes(run_dir: Path) -> list[psutil.Process]:
    """Every process of this run, wherever Ray started it (actors carry ASYNCRL_RUN_DIR)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("ASYNCRL_RUN_DIR") == str(run_dir):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _start_long_run(
    tmp_path: Path, *overrides: str
) -> tuple[subprocess.Popen, Path, list[psutil.Process]]:
    """A run past its first learner step, and every process it owns: the actors (and what
    they started) and the local Ray cluster."""
    proc, run_dir = _launch(
        tmp_path, "trainer.total_steps=100000", "trainer.warmstart_steps=10", *overrides
    )
    deadline = time.monotonic() + 180
    while not read_jsonl(run_dir / "metrics.jsonl"):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run did not reach its first learner step"
        time.sleep(0.2)
    actors = _fleet_processes(run_dir)
    assert {"replay", "server_0", "learner_0"} <= {p.environ()["ASYNCRL_PROCESS"] for p in actors}
    return proc, run_dir, actors + psutil.Process(proc.pid).children(recursive=True)


def _assert_all_gone(procs: list[psutil.Process], run_dir: Path) -> None:
    _, alive = psutil.wait_procs(procs, timeout=15)
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
    assert not _fleet_processes(run_dir)


def test_a_dead_server_actor_stops_the_run_and_is_named(tmp_path):
    proc, run_dir, owned = _start_long_run(tmp_path, "launch.max_restarts=0")
    server = next(p for p in owned if p.environ().get("ASYNCRL_PROCESS") == "server_0")
    server.kill()
    _, err = proc.communicate(timeout=90)

    assert proc.returncode == 1
    assert "Ray actor server_0" in err and "died" in err
    _assert_all_gone(owned, run_dir)


def test_sigterm_stops_every_actor_and_the_cluster(tmp_path):
    """As Ctrl-C does: ray.init's own SIGTERM handling would abort the launcher uncleanly."""
    proc, run_dir, owned = _start_long_run(tmp_path)
    proc.terminate()
    _, err = proc.communicate(timeout=60)

    assert proc.returncode == 130 and "interrupted" in err
    _assert_all_gone(owned, run_dir)
    for name in ("replay", "server_0"):  # stopped by SIGTERM, not killed
        assert (run_dir / "stats" / f"{name}.json").is_file()


def test_a_killed_server_actor_is_restarted_as_epoch_1(tmp_path):
    """Serving under Ray: server_1's actor process is SIGKILLed; the launcher creates a new
    actor in its bundle, which heartbeats to the replay as epoch 1."""
    from asyncrl.run_spec import RunSpec
    from asyncrl.wire.auth import read_secret, role_key
    from asyncrl.wire.replay_client import ReplayClient

    run_dir = tmp_path / "run"
    argv = [
        *(sys.executable, "-m", "asyncrl.launch.cli", "serve", "launch.backend=ray"),
        *("rollout.num_servers=2", "trainer.warmstart_steps=10", "launch.restart_backoff_s=0.5"),
        *(f"trainer.cache_dir={tmp_path / 'cache'}", f"trainer.run_dir={run_dir}"),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def epochs() -> dict[int, int]:
        if not (run_dir / "launch.json").is_file():
            return {}
        spec = RunSpec.load(run_dir / "launch.json")
        key = role_key(read_secret(str(run_dir)), "client")
        client = ReplayClient(spec.replay_address, key, reply_timeout_s=2.0)
        try:
            return client.server_epochs()
        except Exception:  # not answering yet
            return {}
        finally:
            client.close()

    def wait(condition, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"{what} within {timeout_s}s"
            time.sleep(0.2)

    try:
        wait(lambda: epochs() == {0: 0, 1: 0}, 240, "both servers alive")
        servers = [
            p for p in _fleet_processes(run_dir) if p.environ().get("ASYNCRL_PROCESS") == "server_1"
        ]  # the actor's process and those it started (they inherit its environment)
        (server,) = [p for p in servers if p.ppid() not in {q.pid for q in servers}]
        server.kill()
        wait(lambda: epochs() == {0: 0, 1: 1}, 120, "server_1 back as epoch 1")
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    assert "asyncrl: server_1 died: " in out and "; restart 1/3 in 0.5s" in out, (out, err)
    (record,) = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert (record["server"], record["epoch"], record["event"]) == ("server_1", 1, "restart")
