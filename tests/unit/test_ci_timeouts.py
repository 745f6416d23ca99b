"""The promises README makes about CI's time limits, on scratch tests run by pytest itself:
a stuck test fails after its timeout and, with the long tier's flags, runs once more; an
assertion failure is never rerun; the engine steps' tests get 30 minutes (tests/conftest.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
RERUN_FLAGS = ["--reruns", "1", "--only-rerun", "Timeout"]  # as README's long-tier command

SCRATCH = """
import time
from pathlib import Path

import pytest


def test_stuck_once():
    flag = Path(__file__).with_name("stuck_once")
    if not flag.exists():
        flag.write_text("1")
        time.sleep(30)


def test_wrong():
    assert 1 == 2


@pytest.mark.vllm
def test_engine_step(request):
    marker = request.node.get_closest_marker("timeout")
    assert marker is not None and marker.args == (1800,)
"""


def run_pytest(tmp_path: Path, *args: str) -> str:
    (tmp_path / "test_scratch.py").write_text(SCRATCH)
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    vllm: engine\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "2"]
    done = subprocess.run(
        [*cmd, *args, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    return done.stdout


def test_a_stuck_long_test_runs_once_more_and_an_assertion_never_does(tmp_path):
    out = run_pytest(tmp_path, *RERUN_FLAGS)
    assert "1 failed, 2 passed, 1 rerun" in out, out
    assert "FAILED" in out and "test_wrong" in out


def test_without_the_rerun_a_stuck_test_fails_on_its_timeout(tmp_path):
    out = run_pytest(tmp_path)
    assert "2 failed, 1 passed" in out and "Timeout" in out, out
