"""A run directory a launch trains in is held (`hold_run_dir`): a second launch or resume into
it is refused by name while the first runs; and serve/eval never write into a training run."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest

from asyncrl.config import load_config
from asyncrl.launch.fleet import LaunchError
from asyncrl.launch.run import LOCK_FILE, hold_run_dir, serve


def test_a_held_run_directory_is_refused_to_another_process_and_freed_after(tmp_path):
    hold = (
        "import contextlib, sys, time\n"
        "from pathlib import Path\n"
        "from asyncrl.launch.run import hold_run_dir\n"
        "with contextlib.ExitStack() as held:\n"
        "    hold_run_dir(Path(sys.argv[1]), held)\n"
        "    print('held', flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", hold, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "held"
        with contextlib.ExitStack() as held, pytest.raises(LaunchError, match="is in use"):
            hold_run_dir(tmp_path, held)
    finally:
        other.communicate("\n", timeout=30)
    with contextlib.ExitStack() as held:  # free once the other launch ended
        hold_run_dir(tmp_path, held)
    assert (tmp_path / LOCK_FILE).exists()


def test_serve_or_eval_into_a_training_run_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "config.yaml").write_text("trainer: {save_every: 2}\n")
    cfg = load_config(None, [f"trainer.run_dir={tmp_path}"])
    with pytest.raises(LaunchError, match="holds a training run"):
        serve(cfg)
    assert (tmp_path / "config.yaml").read_text() == "trainer: {save_every: 2}\n"
