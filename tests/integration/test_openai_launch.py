"""Training through the OpenAI-compatible endpoint: `asyncrl launch` with `agent_loop=openai`
runs a user's agent (the real `openai` client, from a module of the user's own) in the rollout
server, the learner trains on what the endpoint recorded, and every trained sample keeps the
staleness bound. And on the user's path (the `asyncrl` CLI from a relative working directory,
the default `runs/{time}`, one server), an agent's hostile requests neither restart the server
nor train a token sampled at another temperature (issue 40)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


def test_a_launched_run_trains_through_the_endpoint(tmp_path, monkeypatch, model_cache):
    (tmp_path / "user_agent.py").write_text(AGENT)
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{path}" if path else str(tmp_path))
    cfg = load_config(
        overrides=[
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.cache_dir={model_cache}",
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


HOSTILE = '''
import asyncio, json, pathlib, time
import openai

STATE = {}


async def run(client, row):
    """The server's first episode: a 16 MB message, 200 requests at temperatures the run does
    not sample at (8 at a time, the episode's concurrency), then stream=True, whose streamed
    reply is the episode's answer, with a ticker timing the server's event loop meanwhile; its
    findings go to hostile_report.json. Every other episode waits for it, so the server lives
    on its heartbeats alone meanwhile (no sample reaches the replay); then each answers once."""
    if "done" not in STATE:
        STATE["done"] = asyncio.Event()
        lag = [0.0]

        async def tick():
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                lag[0], last = max(lag[0], now - last - 0.01), now

        async def status(messages, **extra):
            try:
                await client.chat.completions.create(model="policy", messages=messages, **extra)
                return 200
            except openai.APIStatusError as e:
                return e.status_code

        ticker = asyncio.ensure_future(tick())
        start = time.monotonic()
        huge = await status([{"role": "user", "content": "x" * 16_000_000}])
        temperatures = []
        for _ in range(25):
            temperatures += await asyncio.gather(
                *(status(row["messages"], temperature=t) for t in (0.7, 0.0) * 4)
            )
        stream = await client.chat.completions.create(
            model="policy", messages=row["messages"], max_tokens=6, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        ticker.cancel()
        report = {"huge": huge, "temperatures": temperatures, "streamed": text, "lag_s": lag[0],
                  "took_s": time.monotonic() - start}
        pathlib.Path(__file__).with_name("hostile_report.json").write_text(json.dumps(report))
        STATE["done"].set()
        return row["messages"] + [{"role": "assistant", "content": text}]
    await STATE["done"].wait()
    reply = await client.chat.completions.create(
        model="policy", messages=row["messages"], max_tokens=6
    )
    return row["messages"] + [reply.choices[0].message.model_dump(exclude_none=True)]
'''


def test_hostile_agent_requests_on_the_default_path(tmp_path, model_cache):
    """The 16 MB message used to hold the server's loop past the liveness bound (the server
    was declared dead and restarted), the other temperatures were sampled and trained, and
    stream=True got an empty stream. Now the message and every other temperature are
    refused, the stream carries the reply (trained: no drift), the loop never waits as long as
    one heartbeat interval, and the run ends its steps without a restart or an agent failure."""
    (tmp_path / "hostile_agent.py").write_text(HOSTILE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    argv = [sys.executable, "-m", "asyncrl.launch.cli", "launch"]
    overrides = [
        f"trainer.cache_dir={model_cache}",
        f"trainer.total_steps={STEPS}",
        "rollout.agent_loop=openai",
        "rollout.openai.enabled=true",
        "rollout.openai.agent=hostile_agent:run",
        "rollout.openai.max_requests_per_episode=256",
        "launch.progress=none",
    ]
    done = subprocess.run(
        argv + overrides, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()  # the default relative run directory
    report = json.loads((tmp_path / "hostile_report.json").read_text())
    assert report["huge"] == 400 and report["streamed"]
    assert report["temperatures"] == [400] * 200
    cfg = load_config(None, [])
    assert report["lag_s"] < cfg.launch.heartbeat_s < cfg.launch.server_timeout_s, report
    print(f"\nhostile requests: loop lag {report['lag_s']:.3f}s, {report['took_s']:.1f}s in all")
    assert not (run_dir / "restarts.jsonl").exists() or not read_jsonl(run_dir / "restarts.jsonl")
    assert "restart" not in done.stderr
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    stats = json.loads((run_dir / "stats" / "server_0.json").read_text())
    assert stats["openai_status_400"] == 201 and "openai_status_500" not in stats
    assert stats["openai_agent_errors"] == stats["openai_agent_timeouts"] == 0
    assert stats["openai_drift"] == 0
