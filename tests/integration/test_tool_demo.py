"""The embedded tool demo end to end: the tool agent loop on the calculator task through the
real launcher, replay, rollout server and learner, for a few steps on a barely warm model."""

from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.long]

STEPS = 3


def test_tool_demo_runs_and_logs_tool_metrics_per_trajectory(
    tmp_path: Path, model_cache: Path
) -> None:
    cfg = load_config(
        "configs/tool_demo.yaml",
        overrides=[
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.cache_dir={model_cache}",
            "trainer.warmstart_steps=100",
            f"trainer.total_steps={STEPS}",
            "trainer.save_final=false",
            "rollout.n=4",
            "rollout.max_concurrent_groups=4",
            "data.train_batch_size=4",
            "learner.micro_batch_size=16",
            "launch.progress=none",
            "launch.startup_timeout_s=120",
        ],
    )
    run_dir = launch(cfg)

    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert len(steps) == STEPS
    for step in steps:  # the samples' agent metrics reach the learner's metrics, per step
        assert {"traj/turns", "traj/tool_calls", "traj/tool_errors"} <= step.keys()
        assert 1.0 <= step["traj/turns"] <= 2.0
    trajectories = read_jsonl(run_dir / "rollout_metrics.jsonl")
    assert len(trajectories) >= STEPS * 4 * 4
    for t in trajectories:
        assert t["data_source"] == "asyncrl/arith_tool"
        assert {"turns", "tool_calls", "tool_errors", "malformed_calls"} <= t["metrics"].keys()
    # a call that ran and was answered: a second assistant turn after the tool's (unmasked) turn
    answered = [t for t in trajectories if t["metrics"]["tool_calls"] >= 1]
    assert answered, "the warm-started model never called the calculator"
    assert all(t["metrics"]["turns"] == 2 for t in answered if t["finish_reason"] == "stop")
