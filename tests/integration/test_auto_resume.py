"""`trainer.auto_resume`: a learner SIGKILLed after its step-3 checkpoint, and again after its
step-6 one, is resumed from each by the launcher, in the same run directory, and the run
completes every step; its records read like one run (each step once, no prompt repeated or skipped, the groups ready at the checkpoint
trained after the resume rather than generated again). Without retries, or once they are spent,
the same death fails the run naming it."""

import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from launched_runs import kill_learner_when, learner_of, start_launch, steps

from asyncrl.checkpoints import REPLAY_FILE
from asyncrl.launch.rewind import RESUMES_FILE
from asyncrl.metrics import read_jsonl
from replay.checkpoint import read_state

pytestmark = pytest.mark.integration

TOTAL_STEPS = 9


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One warm-started tiny model for the module's runs."""
    return tmp_path_factory.mktemp("cache")


def _launch(run_dir: Path, cache_dir: Path, retries: int) -> subprocess.Popen:
    return start_launch(
        f"trainer.run_dir={run_dir}",
        f"trainer.cache_dir={cache_dir}",
        "trainer.warmstart_steps=0",  # an untrained model: enough to be killed and resumed
        "data.train_batch_size=4",
        "rollout.n=4",
        f"trainer.total_steps={TOTAL_STEPS}",
        "trainer.save_every=3",
        "trainer.save_final=false",
        "trainer.log_samples=true",
        f"trainer.auto_resume={retries}",
        "launch.restart_backoff_s=0.2",
        "launch.progress=none",
    )


def _past_checkpoint(
    run_dir: Path, step: int, not_pid: int = 0
) -> Callable[[psutil.Process], bool]:
    """Ready once checkpoint step_<step> exists and a learner (other than `not_pid`) has
    recorded a step past it (which the rewind must take back)."""
    ckpt = run_dir / "checkpoints" / f"step_{step}"
    return lambda learner: (
        learner.pid != not_pid
        and ckpt.is_dir()
        and max(steps(run_dir / "samples.jsonl"), default=0) > step
    )


def _rows(samples: list[dict]) -> list[int]:
    return [int(g.split("-")[0]) for s in samples for g in s["group_ids"]]


@pytest.mark.long
def test_without_auto_resume_the_same_death_fails_the_run_naming_the_learner(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    launcher = _launch(run_dir, cache_dir, retries=0)
    kill_learner_when(launcher, lambda _: (run_dir / "checkpoints" / "step_3").is_dir())
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 1
    assert "asyncrl: launch failed: process learner_0 was killed by signal SIGKILL" in err
    assert "resuming" not in out and not (run_dir / RESUMES_FILE).exists()


@pytest.mark.long
def test_a_learner_killed_twice_is_resumed_and_the_records_read_like_one_run(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    launcher = _launch(run_dir, cache_dir, retries=2)
    first = kill_learner_when(launcher, _past_checkpoint(run_dir, 3))
    kill_learner_when(launcher, _past_checkpoint(run_dir, 6, not_pid=first))
    out, err = launcher.communicate(timeout=150)
    assert launcher.returncode == 0, err
    ckpt = run_dir / "checkpoints" / "step_3"
    for step, attempt in ((3, 1), (6, 2)):
        assert (
            f"asyncrl: learner_0 was killed by signal SIGKILL; resuming from "
            f"{run_dir / 'checkpoints' / f'step_{step}'} (step {step}), attempt {attempt}/2" in out
        )
    resumes = read_jsonl(run_dir / RESUMES_FILE)
    assert [(r["failed"], r["step"], r["attempt"]) for r in resumes] == [
        ("learner_0", 3, 1),
        ("learner_0", 6, 2),
    ]
    for resume in resumes:
        assert resume["rewound"]["samples.jsonl"] >= 1, "no step past the checkpoint was taken back"

    # every step once, in order, as if the run had never died
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    samples = read_jsonl(run_dir / "samples.jsonl")
    every_step = list(range(1, TOTAL_STEPS + 1))
    assert [r["step"] for r in metrics] == every_step
    assert [r["step"] for r in samples] == every_step

    # the groups ready at the checkpoint are trained after the resume, their very samples
    # (only a group that became too stale meanwhile may be dropped, and is counted)
    at_3 = read_state(ckpt / REPLAY_FILE)
    assert at_3.ready, "no group was ready at the checkpoint: the test would prove nothing"
    trained_after = {t for s in samples[3:] for t in s["traj_ids"]}
    stale_after = sum(r["stale_dropped"] for r in metrics[3:])
    kept = [g for g in at_3.ready if {t.traj_id for t in g.samples} <= trained_after]
    assert kept and len(kept) >= len(at_3.ready) - stale_after

    # no prompt repeated or skipped: the rows trained and those the replay still held at the
    # end are every row drawn, each once (less the groups dropped as stale, never trained)
    at_end = read_state(run_dir / "checkpoints" / f"step_{TOTAL_STEPS}" / REPLAY_FILE)
    held = [int(g.item.group_id.split("-")[0]) for g in at_end.ready]
    held += [int(p.group_id.split("-")[0]) for p in at_end.reissue]
    seen = Counter(_rows(samples) + held)
    assert [r for r, k in seen.items() if k > 1] == [], "a prompt was repeated"
    drawn = set(range(at_end.rows_drawn))
    assert set(seen) <= drawn
    stale = sum(r["stale_dropped"] for r in metrics)
    assert len(drawn - set(seen)) == stale, "a prompt was skipped"


@pytest.mark.long  # over 30 s: its own CI step (the default tier stays under 15 min)
def test_when_the_retries_run_out_the_last_death_is_named(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    launcher = _launch(run_dir, cache_dir, retries=1)
    first = kill_learner_when(launcher, lambda _: (run_dir / "checkpoints" / "step_3").is_dir())
    kill_learner_when(launcher, lambda learner: learner.pid != first)  # the resumed learner
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 1
    assert "asyncrl: launch failed: process learner_0 was killed by signal SIGKILL" in err
    assert out.count("resuming from") == 1 and "attempt 1/1" in out
    assert len(read_jsonl(run_dir / RESUMES_FILE)) == 1


@pytest.mark.long  # half a minute or more: its own CI step
def test_ctrl_c_after_a_resume_stops_everything_without_resuming(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    launcher = _launch(run_dir, cache_dir, retries=2)
    first = kill_learner_when(launcher, lambda _: (run_dir / "checkpoints" / "step_3").is_dir())
    deadline = time.monotonic() + 60
    while (learner := learner_of(launcher)) is None or learner.pid == first:
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
        time.sleep(0.01)
    fleet = psutil.Process(launcher.pid).children(recursive=True)
    launcher.send_signal(signal.SIGINT)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130 and "interrupted" in err
    assert out.count("resuming from") == 1
    _, alive = psutil.wait_procs(fleet, timeout=10)
    assert not alive, f"orphans left: {[p.pid for p in alive]}"
