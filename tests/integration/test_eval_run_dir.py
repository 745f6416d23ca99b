"""`asyncrl eval --run-dir RUN` without `--address` scores RUN's own weights and writes under RUN
(issue 40, finding 4), on the user's path: the default config (one rollout server, the
relative run directory `runs/{time}`) through the `asyncrl` CLI, from a working directory of
its own. Before, it served the model the run started from (the warm-start: 0.55 against the
run's 0.87) and wrote into a new `runs/<time>/eval/`.

One short run, validated before training (the warm-start's score) and at its end (its
weights'), with a checkpoint at its last step. Then: the eval of RUN scores what the run's
last validation scored and what an eval of RUN/final named directly scores, not the
warm-start's; with RUN/final gone, the latest checkpoint is scored the same; each says which
weights, and writes RUN/eval/<job>.json and nothing under runs/ beside RUN. The number of
rollout servers plays no part here (the eval fleet is the run's config, one server or many)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.long]

STEPS = 60
SAME = 0.03  # greedy on the same 100 questions and weights: equal up to batch numerics


def _asyncrl(cwd: Path, *args: str) -> str:
    """`asyncrl ARGS...` as a user types it in `cwd`; its stdout, once it succeeded."""
    argv = [sys.executable, "-m", "asyncrl.launch.cli", *args]
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _eval_result(run: Path) -> dict:
    """The one result an eval wrote under `run`/eval, which is then moved aside."""
    (path,) = (run / "eval").glob("eval-*.json")
    path.rename(path.with_suffix(".seen"))
    return json.loads(path.with_suffix(".seen").read_text())


def test_eval_of_a_run_dir_scores_its_weights_final_or_checkpoint(tmp_path, model_cache):
    cwd = tmp_path / "work"
    cwd.mkdir()
    _asyncrl(
        cwd,
        "launch",
        f"trainer.total_steps={STEPS}",
        f"trainer.save_every={STEPS}",
        "trainer.val_before_train=true",
        f"trainer.val_every={STEPS}",
        f"trainer.cache_dir={model_cache}",  # the default's warm-start, built once
        "launch.progress=none",
    )
    (metrics,) = (cwd / "runs").glob("*/metrics.jsonl")
    run = metrics.parent.relative_to(cwd)  # runs/<time>, as the user names it
    val = {r["step"]: r["val/mean_score"] for r in read_jsonl(metrics) if "val/mean_score" in r}
    warm, trained = val[0], val[STEPS]
    assert abs(trained - warm) > 2 * SAME, f"the run did not move its score enough to tell: {val}"
    _asyncrl(cwd, "data", "arith", "--output", "data")

    said = _asyncrl(cwd, "eval", "--run-dir", str(run), "--data", "data/val.parquet")
    assert f"the run's final weights ({run / 'final'})" in said
    final = _eval_result(cwd / run)
    assert final["weights"] == str(run / "final") and final["step"] is None
    assert [p.name for p in (cwd / "runs").iterdir()] == [run.name]  # no new runs/<time>
    assert abs(final["mean_score"] - trained) <= SAME, (final, val)
    assert abs(final["mean_score"] - warm) > SAME, (final, val)

    direct = cwd / "direct.json"  # the same weights named directly
    model = f"trainer.model_path={run / 'final'}"
    _asyncrl(cwd, "eval", "--data", "data/val.parquet", model, "--output", str(direct))
    assert abs(final["mean_score"] - json.loads(direct.read_text())["mean_score"]) <= SAME

    (cwd / run / "final").rename(cwd / run / "final.aside")  # a run that wrote no final weights
    said = _asyncrl(cwd, "eval", "--run-dir", str(run), "--data", "data/val.parquet")
    assert f"the run's latest checkpoint, step {STEPS}" in said
    checkpoint = _eval_result(cwd / run)
    assert checkpoint["weights"] == str(run / "checkpoints" / f"step_{STEPS}")
    assert checkpoint["step"] == STEPS
    assert abs(checkpoint["mean_score"] - final["mean_score"]) <= SAME, (checkpoint, final)
    assert not list((cwd / run / "eval").glob("*/model"))  # the exported copy is deleted
