"""`asyncrl launch` on one GPU, as a new user runs it (`gpu` tier; tools/gpu_check.sh runs the
same two launches through the CLI and reports their figures):
1. the defaults, colocated (the learner and the rollout server share the one GPU): the reward
   rises by at least 0.3 over 200 steps, as on the CPU (~0.27 -> ~0.77);
2. `rollout.device=cpu` with the learner on the GPU: the two ends of the weight sync are on
   different devices, and the run still makes its steps with every version applied.
Each takes well under two minutes on an H100 or H200."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.launch.progress import training_rows
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LEARNS_GAIN = 0.3
"""Issue 27's acceptance: on one GPU, colocated, the default launch learns (+0.3)."""


def _launch(tmp_path: Path, cache: Path, *overrides: str) -> Path:
    cfg = load_config(
        overrides=[
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.cache_dir={cache}",
            "launch.progress=none",
            *overrides,
        ]
    )
    return launch(cfg)


def test_the_default_launch_learns_colocated_on_one_gpu(tmp_path, model_cache):
    steps = 200
    run_dir = _launch(tmp_path, model_cache, f"trainer.total_steps={steps}")
    rows = training_rows(read_jsonl(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    first = sum(r["reward_mean"] for r in rows[:5]) / 5
    last = sum(r["reward_mean"] for r in rows[-20:]) / 20
    assert last - first >= LEARNS_GAIN, f"reward {first:.3f} -> {last:.3f}"
    _assert_the_server_applied_every_version(run_dir, steps)


def test_a_cpu_server_follows_a_gpu_learner(tmp_path, model_cache):
    steps = 8
    run_dir = _launch(
        tmp_path,
        model_cache,
        f"trainer.total_steps={steps}",
        "rollout.device=cpu",
        "learner.device=cuda",
        "replay.max_staleness=1",
    )
    rows = training_rows(read_jsonl(run_dir / "metrics.jsonl"))
    assert [r["version"] for r in rows] == list(range(1, steps + 1))
    # with a bound of 1 the server must have applied versions to go on being admitted
    assert all(r["staleness_max"] <= 1 for r in rows)
    _assert_the_server_applied_every_version(run_dir, steps)


def _assert_the_server_applied_every_version(run_dir: Path, steps: int) -> None:
    """The server's exit stats: it applied one sync per step and ended on the last version."""
    stats = json.loads((run_dir / "stats" / "server_0.json").read_text())
    assert stats["weight_syncs"] == steps and stats["engine_version"] == steps, stats
