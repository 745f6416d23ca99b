"""The launcher stops every process when one dies or on Ctrl-C, and leaves no orphans."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "asyncrl.launch.cli",
        "launch",
        "trainer.total_steps=100000",
        "trainer.warmstart_steps=10",
        f"trainer.cache_dir={tmp_path / 'cache'}",
        f"trainer.run_dir={run_dir}",
        "launch.progress=line",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run did not reach its first learner step"
        time.sleep(0.2)
    return proc, run_dir


def _fleet(launcher_pid: int) -> list[psutil.Process]:
    return psutil.Process(launcher_pid).children(recursive=True)


def _assert_all_gone(procs: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, f"orphans left: {[p.pid for p in alive]}"


def test_a_dead_server_stops_the_run_and_is_named(tmp_path):
    proc, _ = _start(tmp_path)
    fleet = _fleet(proc.pid)
    server = next(p for p in fleet if "server" in p.cmdline())
    server.kill()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "server_0" in err and "SIGKILL" in err
    _assert_all_gone(fleet)


def test_ctrl_c_stops_every_process(tmp_path):
    proc, _ = _start(tmp_path)
    fleet = _fleet(proc.pid)
    assert len(fleet) >= 3  # replay, server, learner
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err
    _assert_all_gone(fleet)
