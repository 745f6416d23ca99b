"""A run killed and resumed in place twice, by hand, reads as one run: `asyncrl launch` with
checkpoints every step, its learner SIGKILLed after step 2; `asyncrl launch --resume RUN_DIR`
(nothing typed again), killed after step 3; `asyncrl launch trainer.resume_from=RUN_DIR
trainer.total_steps=5`, which trains on to step 5. metrics.jsonl and samples.jsonl then hold
steps 1-5, each once, in order; so `asyncrl plot` draws one curve."""

import subprocess
from pathlib import Path

import pytest
from launched_runs import kill_learner_when, start_launch, steps

from asyncrl.analysis.figures import read_jsonl as plot_rows
from asyncrl.analysis.plot import plot_run
from asyncrl.config import load_config
from asyncrl.launch.rewind import RESUMES_FILE
from asyncrl.metrics import read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.long]


def _killed_after(launcher: subprocess.Popen, run_dir: Path, step: int) -> str:
    """SIGKILL the learner once metrics.jsonl holds `step`; the launcher fails the run."""
    kill_learner_when(launcher, lambda _: max(steps(run_dir / "metrics.jsonl"), default=0) >= step)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 1 and "learner_0 was killed by signal SIGKILL" in err, err
    return out


def test_a_run_killed_and_resumed_in_place_twice_reads_as_one_run(tmp_path):
    run_dir = tmp_path / "run"
    _killed_after(
        start_launch(
            f"trainer.run_dir={run_dir}",
            f"trainer.cache_dir={tmp_path / 'cache'}",
            "trainer.warmstart_steps=0",  # an untrained model: enough to be killed and resumed
            "data.train_batch_size=4",
            "rollout.n=4",
            "trainer.total_steps=4",
            "trainer.save_every=1",
            "trainer.save_final=false",
            "trainer.log_samples=true",
            "launch.progress=none",
        ),
        run_dir,
        2,
    )
    out = _killed_after(start_launch("--resume", str(run_dir)), run_dir, 3)
    assert f"asyncrl: resuming {run_dir} in place from step_" in out

    last = start_launch(f"trainer.resume_from={run_dir}", "trainer.total_steps=5")
    out, err = last.communicate(timeout=120)
    assert last.returncode == 0, err
    assert "asyncrl: on top of its config.yaml: trainer.total_steps=5 (was 4)" in out

    # one run: every step once, in order, in each per-step record, and in what plot reads
    assert steps(run_dir / "metrics.jsonl") == [1, 2, 3, 4, 5]
    assert steps(run_dir / "samples.jsonl") == [1, 2, 3, 4, 5]
    assert [r["step"] for r in plot_rows(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert "reward.png" in [p.name for p in plot_run(run_dir, tmp_path / "plots")]
    assert "5 steps;" in out  # the launcher's summary counts the run's steps once

    # the run's own config went on: checkpoints every step (never typed again), the last
    # override kept for the next resume, and each resume recorded with its command
    cfg = load_config(run_dir / "config.yaml")
    assert (cfg.trainer.save_every, cfg.trainer.total_steps) == (1, 5)
    assert (run_dir / "checkpoints" / "step_5").is_dir()
    resumes = read_jsonl(run_dir / RESUMES_FILE)
    assert [r["command"] for r in resumes] == [
        f"asyncrl launch --resume {run_dir}",
        f"asyncrl launch --resume {run_dir} trainer.total_steps=5",
    ]
    assert resumes[1]["changed"] == {"trainer.total_steps": {"was": 4, "now": 5}}
    assert [r["step"] for r in resumes] == sorted(r["step"] for r in resumes)
