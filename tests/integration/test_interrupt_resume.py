"""Interrupting a run keeps its work (issue 40), tested on the user's path: the default config
(one rollout server, the relative run directory `runs/{time}`) through the `asyncrl` CLI, run
from a working directory of its own; and on the config easiest to break, two rollout servers and
two learner ranks (whose checkpoint is a collective). Ctrl-C (SIGINT) or SIGTERM to the
launcher: the learner ends its step and writes a checkpoint before the fleets stop, the
launcher prints the exact command that goes on, and that command ends the run with every step
recorded once (`asyncrl.launch.interrupt`)."""

from __future__ import annotations

import contextlib
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from launched_runs import steps

from asyncrl.checkpoints import check_complete, complete_checkpoints
from asyncrl.metrics import read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.long]

RESUME = re.compile(r"^  (asyncrl launch --resume .+)$", re.MULTILINE)


STARTUP_S = 600
"""How long a launch may take to record its first steps (the default's warm-start included, on
two loaded cores)."""


@contextlib.contextmanager
def _asyncrl(cwd: Path, *args: str) -> Iterator[subprocess.Popen]:
    """`asyncrl ARGS...` as a user types it in `cwd`, its output captured; killed if the test
    leaves it running (its fleet dies with it)."""
    argv = [sys.executable, "-m", "asyncrl.launch.cli", *args]
    proc = subprocess.Popen(
        argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _interrupt_at(launcher: subprocess.Popen, metrics: Path, step: int, sig: int) -> str:
    """Send `sig` to the launcher once `metrics` records `step`; its stderr, once it ended."""
    deadline = time.monotonic() + STARTUP_S
    while not metrics.is_file() or max(steps(metrics), default=0) < step:
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, f"the run did not reach step {step}"
        time.sleep(0.05)
    launcher.send_signal(sig)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, err
    return err


def _the_run_dir(launcher: subprocess.Popen, cwd: Path) -> Path:
    """The one run directory `runs/{time}` a launch in `cwd` made, relative to `cwd`."""
    deadline = time.monotonic() + STARTUP_S
    while not (found := list((cwd / "runs").glob("*/metrics.jsonl"))):
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "no run directory with metrics.jsonl under runs/"
        time.sleep(0.1)
    (metrics,) = found
    return metrics.parent.relative_to(cwd)


def _resume_as_told(cwd: Path, err: str) -> str:
    """Run the command the interrupted launcher printed, as printed; its stdout."""
    (command,) = RESUME.findall(err)
    with _asyncrl(cwd, *shlex.split(command)[1:]) as resumed:
        out, err = resumed.communicate(timeout=STARTUP_S)
    assert resumed.returncode == 0, err
    return out


def test_ctrl_c_on_the_default_run_checkpoints_and_the_printed_resume_finishes_it(
    tmp_path, model_cache
):
    """The acceptance of issue 40: `asyncrl launch trainer.save_every=10
    trainer.total_steps=40` in a working directory of its own, Ctrl-C at step 25, then the
    printed `asyncrl launch --resume runs/<time>`: metrics.jsonl holds steps 1-40, once each.
    Before, the run died at step 10 (its replay's part written to runs/X/runs/X/...), and
    Ctrl-C printed only `interrupted; every process was stopped`."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    with _asyncrl(
        cwd,
        "launch",
        "trainer.save_every=10",
        "trainer.total_steps=40",
        f"trainer.cache_dir={model_cache}",  # the warm-start, once per session
    ) as launcher:
        run_dir = _the_run_dir(launcher, cwd)
        err = _interrupt_at(launcher, cwd / run_dir / "metrics.jsonl", 25, signal.SIGINT)
    reached = max(steps(cwd / run_dir / "metrics.jsonl"))
    assert f"It goes on from its checkpoint at step {reached}:" in err, err
    assert RESUME.findall(err) == [f"asyncrl launch --resume {run_dir}"]
    saved = complete_checkpoints(cwd / run_dir)
    assert [p.name for p in saved] == [f"step_{v}" for v in (10, 20, reached)]
    assert not (cwd / run_dir / "final").exists()  # not the end of the run

    out = _resume_as_told(cwd, err)
    assert f"resuming {run_dir} in place from step_{reached}" in out
    assert steps(cwd / run_dir / "metrics.jsonl") == list(range(1, 41))
    assert not (cwd / run_dir / "runs").exists()
    check_complete(cwd / run_dir / "checkpoints" / "step_40")
    assert len(complete_checkpoints(cwd / run_dir)) == 3  # trainer.keep_checkpoints' default


def test_sigterm_checkpoints_two_learner_ranks_and_no_trajectory_is_trained_twice(
    tmp_path, model_cache
):
    """SIGTERM (a process manager's stop) on two rollout servers and two learner ranks, with
    the default trainer.save_every=0: both ranks write the checkpoint of the step they
    reached, together; the resume trains on to the end, each step once and no trajectory
    twice (the replay's state went into the checkpoint at the same version)."""
    run_dir = tmp_path / "run"
    with _asyncrl(
        tmp_path,
        "launch",
        f"trainer.run_dir={run_dir}",
        f"trainer.cache_dir={model_cache}",
        "trainer.total_steps=10",
        "rollout.num_servers=2",
        "learner.world_size=2",
        "data.train_batch_size=4",
        "rollout.n=4",
        "trainer.log_samples=true",
    ) as launcher:
        err = _interrupt_at(launcher, run_dir / "metrics.jsonl", 3, signal.SIGTERM)
    reached = max(steps(run_dir / "metrics.jsonl"))
    assert reached < 10, "the run ended before the signal: nothing was interrupted"
    (saved,) = complete_checkpoints(run_dir)
    assert saved.name == f"step_{reached}"
    assert sorted(p.name for p in (saved / "dcp").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert RESUME.findall(err) == [f"asyncrl launch --resume {run_dir}"]

    _resume_as_told(tmp_path, err)
    assert steps(run_dir / "metrics.jsonl") == list(range(1, 11))
    trained = [t for r in read_jsonl(run_dir / "samples.jsonl") for t in r["traj_ids"]]
    assert len(trained) == len(set(trained)) == 10 * 4 * 4


def test_ctrl_c_before_any_step_says_there_is_nothing_to_resume(tmp_path, model_cache):
    """An interrupt before the learner's first step leaves nothing to go on from: the
    launcher says so, and prints no resume command. Sent once every process is started (the
    learner's log exists, and a second more): a signal that lands while the launcher forks a
    child is lost, its KeyboardInterrupt swallowed by Python's at-fork hook (`logging`'s lock
    release; a run here went on to its end), a race of the CLI's signal handling as old as it."""
    with _asyncrl(
        tmp_path, "launch", f"trainer.cache_dir={model_cache}", "trainer.total_steps=40"
    ) as launcher:
        deadline = time.monotonic() + STARTUP_S
        while not list((tmp_path / "runs").glob("*/logs/learner_0.log")):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, err
    assert "Nothing to resume from: the learner had taken no step" in err
    assert RESUME.findall(err) == []
