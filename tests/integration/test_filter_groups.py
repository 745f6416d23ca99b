"""Dynamic sampling through the whole pipeline (`replay.filter_groups`): a launched run on the
embedded task with the filter on trains no group whose samples all have the same reward, and
its step records say how much was filtered."""

from __future__ import annotations

import json

import pytest

from asyncrl.config import load_config
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl

pytestmark = pytest.mark.integration

STEPS = 6


@pytest.mark.long
def test_no_trained_batch_holds_a_zero_variance_group(tmp_path, model_cache):
    """The embedded default after its warm-start (reward ~0.3, groups of 8): many groups are
    all wrong, some all right. With the filter on, the learner's own count of zero-variance
    groups in each batch it trained on is 0, the replay filtered some, and every step tells
    its share filtered and the extra samples it cost."""
    cfg = load_config(
        overrides=[
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.cache_dir={model_cache}",
            f"trainer.total_steps={STEPS}",
            "trainer.save_final=false",
            "replay.filter_groups.enable=true",
            "launch.progress=none",
        ]
    )
    run_dir = launch(cfg)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["filter_bound_hit"] for r in rows] == [0.0] * STEPS
    assert [r["zero_variance_groups"] for r in rows] == [0] * STEPS
    dropped = sum(r["filter_groups_dropped"] for r in rows)
    assert dropped > 0, "the embedded task's early groups include all-0 ones: none filtered?"
    for r in rows:
        trained = r["samples"] // cfg.rollout.n
        share = r["filter_groups_dropped"] / (r["filter_groups_dropped"] + trained)
        assert r["filter_groups_frac"] == pytest.approx(share)
        extra = r["filter_groups_dropped"] * cfg.rollout.n / r["samples"]
        assert r["filter_extra_samples_per_trained"] == pytest.approx(extra)
    counters = json.loads((run_dir / "stats" / "replay.json").read_text())
    assert counters["groups_filtered"] >= dropped  # (and some after the last batch, maybe)
    assert counters["samples_filtered"] == counters["groups_filtered"] * cfg.rollout.n
