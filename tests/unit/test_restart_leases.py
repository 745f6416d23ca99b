"""A restarted rollout server (epoch > 0) starts from the initial weights, so it asks for no
lease before the learner's current version has reached it (issue 40: the replay refused it as
too stale, or with a loose bound would have trained on the initial weights); one that gets no
version within launch.startup_timeout_s of its start stops, naming why, so the launcher
restarts or drops it rather than the run waiting on it for good."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from asyncrl.config import load_config
from asyncrl.run_spec import RunSpec
from asyncrl.wire.auth import SYNC_KEY_ENV
from asyncrl.wire.protocol import PromptItem
from rollout_servers.engines.base import AppliedVersion
from rollout_servers.server import RolloutServer


class _Engine:
    """Applies version 7 `after_s` after the join (never, with None)."""

    on_batch = None
    busy_s = 0.0

    def __init__(self, after_s: float | None) -> None:
        self.version, self.after_s = 0, after_s
        self.applied_at: float | None = None
        self.released = threading.Event()

    def follow_learner(self, target):
        if self.after_s is not None:
            time.sleep(self.after_s)
            self.version, self.applied_at = 7, time.monotonic()
            yield AppliedVersion(7, 0.0)
        self.released.wait()  # the learner keeps the group open


class _Rewards:
    failures: dict[str, int] = {}


class _Client:
    """Records when each lease was asked for, at which version; grants nothing."""

    def __init__(self) -> None:
        self.asked: list[tuple[float, int]] = []
        self.counters: dict[str, int] = {}
        self.outbox: dict = {}

    def start(self) -> list[asyncio.Task]:
        return []

    async def lease(self, server_id, version, max_groups, *args) -> list[PromptItem]:
        self.asked.append((time.monotonic(), version))
        await asyncio.sleep(0.05)
        return []

    async def drain(self, timeout_s: float) -> int:
        return 0


def _run(tmp_path, monkeypatch, epoch: int, engine: _Engine, for_s: float) -> _Client:
    monkeypatch.setenv(SYNC_KEY_ENV, "00" * 32)
    cfg = load_config(None, ["launch.startup_timeout_s=1.5"])
    spec = RunSpec(str(tmp_path), "unused", "tcp://127.0.0.1:1", "127.0.0.1", 1, 0, 1)
    client = _Client()
    server = RolloutServer(cfg, spec, 0, engine, None, client, _Rewards(), epoch=epoch)  # type: ignore[arg-type]

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(for_s, stop.set)
        try:
            await server.run(stop)
        finally:
            engine.released.set()

    asyncio.run(main())
    return client


def test_a_restarted_server_leases_only_once_the_learners_version_reached_it(tmp_path, monkeypatch):
    engine = _Engine(after_s=0.5)
    client = _run(tmp_path, monkeypatch, 1, engine, for_s=1.2)
    assert engine.applied_at is not None and client.asked
    assert all(at >= engine.applied_at and version == 7 for at, version in client.asked)


def test_a_first_start_leases_at_once_with_the_models_weights(tmp_path, monkeypatch):
    engine = _Engine(after_s=0.5)
    client = _run(tmp_path, monkeypatch, 0, engine, for_s=1.2)
    assert engine.applied_at is not None and client.asked[0][0] < engine.applied_at
    assert client.asked[0][1] == 0


def test_a_restarted_server_without_weights_stops_after_the_startup_timeout(tmp_path, monkeypatch):
    started = time.monotonic()
    message = r"server 0 epoch 2 received no weights from the learner within .*=1.5 s"
    with pytest.raises(RuntimeError, match=message):
        _run(tmp_path, monkeypatch, 2, _Engine(after_s=None), for_s=10.0)
    assert 1.5 < time.monotonic() - started < 5.0
