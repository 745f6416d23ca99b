"""`asyncrl launch` as a user starts it (a CLI subprocess), and its learner killed mid-run:
shared by the resume tests (test_auto_resume.py, test_resume_in_place_runs.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from asyncrl.metrics import read_jsonl


def start_launch(*args: str) -> subprocess.Popen:
    """`asyncrl launch ARGS...`, its output captured."""
    argv = [sys.executable, "-m", "asyncrl.launch.cli", "launch", *args]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def learner_of(launcher: subprocess.Popen) -> psutil.Process | None:
    """The launcher's learner_0 process now (None between attempts)."""
    for p in psutil.Process(launcher.pid).children():
        try:
            if p.environ().get("ASYNCRL_PROCESS") == "learner_0":
                return p
        except psutil.NoSuchProcess:
            continue
    return None


def kill_learner_when(
    launcher: subprocess.Popen, ready: Callable[[psutil.Process], bool], timeout_s: float = 120
) -> int:
    """SIGKILL learner_0 as soon as `ready(learner)`; returns its pid."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.communicate()
        learner = learner_of(launcher)
        if learner is not None and ready(learner):
            learner.kill()
            return learner.pid
        time.sleep(0.01)
    launcher.kill()
    pytest.fail(f"the learner was not ready within {timeout_s:.0f}s: {launcher.communicate()}")


def steps(path: Path) -> list[int]:
    """The `step` of every record of a per-step JSON-lines file."""
    return [r["step"] for r in read_jsonl(path)]
