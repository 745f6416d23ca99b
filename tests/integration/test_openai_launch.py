"""Training through the OpenAI-compatible endpoint: `asyncrl launch` with `agent_loop=openai`
runs a user's agent (the real `openai` client, from a module of the user's own) in the rollout
server, the learner trains on what the endpoint recorded, and every trained sample keeps the
staleness bound."""

from __future__ import annotations

import json
import os

import pytest

from asyncrl.config import load_config
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.long]  # a launch plus its warm-start

STEPS = 4
AGENT = '''
async def answer(client, row):
    """One chat completion for the row's question; the server's reward scores the reply."""
    reply = await client.chat.completions.create(
        model="policy", messages=row["messages"], max_tokens=6
    )
    return row["messages"] + [reply.choices[0].message.model_dump(exclude_none=True)]
'''


def test_a_launched_run_trains_through_the_endpoint(tmp_path, monkeypatch, default_model_cache):
    (tmp_path / "user_agent.py").write_text(AGENT)
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{path}" if path else str(tmp_path))
    cfg = load_config(
        overrides=[
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.cache_dir={default_model_cache}",
            f"trainer.total_steps={STEPS}",
            "rollout.agent_loop=openai",
            "rollout.openai.enabled=true",
            "rollout.openai.agent=user_agent:answer",
            "rollout.n=4",
            "rollout.max_concurrent_groups=4",
            "data.train_batch_size=4",
            "replay.max_staleness=1",
            "launch.progress=none",
        ]
    )
    run_dir = launch(cfg)
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward_mean" in r]
    assert len(steps) == STEPS
    for r in steps:
        assert r["staleness_max"] <= 1 and sum(r["staleness_hist"][2:]) == 0
        assert r["samples"] == 16
    trajectories = read_jsonl(run_dir / "rollout_metrics.jsonl")
    assert len(trajectories) >= STEPS * 16
    for t in trajectories:  # one completion each, recorded, no drift, no agent failure
        metrics = t["metrics"]
        assert metrics["openai_completions"] == 1 and metrics["openai_drift"] == 0
        assert metrics["openai_agent_errors"] == 0 and metrics["openai_agent_timeouts"] == 0
    stats = json.loads((run_dir / "stats" / "server_0.json").read_text())  # the server's counts
    assert stats["openai_episodes"] >= STEPS * 16 and stats["openai_requests"] >= STEPS * 16
    assert stats["openai_agent_errors"] == stats["openai_drift"] == 0
