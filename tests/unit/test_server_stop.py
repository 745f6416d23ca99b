"""A server stopped while it applies the learner's last version (the learner finished and
closed the group, the launcher sends SIGTERM) finishes that apply and logs it before it ends:
the engine's apply runs on the server's own event loop (vLLM's and SGLang's do), so a stop that
did not wait for it would leave the version applied by no one and missing from
weights_server_<id>.jsonl (CI caught this once with vLLM)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import CancelledError

from asyncrl.config import load_config
from asyncrl.metrics import read_jsonl
from asyncrl.run_spec import RunSpec
from asyncrl.wire.auth import SYNC_KEY_ENV
from rollout_servers.engines.base import AppliedVersion
from rollout_servers.server import RECEIVER_FINISH_S, RolloutServer


class _Engine:
    """Follows a learner that sends version 1 and closes the group: the apply is a coroutine
    on the server's loop taking `apply_s`, started once the server has been told to stop."""

    on_batch = None
    busy_s = 0.0

    def __init__(self, apply_s: float, stopping: asyncio.Event) -> None:
        self.version, self.apply_s, self.stopping = 0, apply_s, stopping
        self.loop: asyncio.AbstractEventLoop | None = None

    def follow_learner(self, target):
        assert self.loop is not None
        asyncio.run_coroutine_threadsafe(self.stopping.wait(), self.loop).result()
        start = time.perf_counter()
        try:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(self.apply_s), self.loop).result()
        except (CancelledError, RuntimeError):  # the process ended mid-apply (bounded wait)
            return
        self.version = 1
        yield AppliedVersion(1, time.perf_counter() - start)

    def weights_checksum(self) -> str:
        return f"v{self.version}"


class _Client:
    def start(self) -> list[asyncio.Task]:
        return []

    async def lease(self, *args) -> list:
        await asyncio.sleep(0.05)
        return []

    async def drain(self, timeout_s: float) -> int:
        return 0


def _stop_while_applying(tmp_path, monkeypatch, apply_s: float) -> tuple[list[dict], float]:
    monkeypatch.setenv(SYNC_KEY_ENV, "00" * 32)  # the launcher hands each server epoch its key
    cfg = load_config(None, ["learner.weight_checksum=true"])
    spec = RunSpec(str(tmp_path), "unused", "tcp://127.0.0.1:1", "127.0.0.1", 1, 0, 1)

    async def main() -> float:
        stop = asyncio.Event()
        engine = _Engine(apply_s, stop)
        engine.loop = asyncio.get_running_loop()
        server = RolloutServer(cfg, spec, 0, engine, None, _Client(), None)  # type: ignore[arg-type]
        engine.loop.call_later(0.2, stop.set)
        start = time.monotonic()
        await server.run(stop)
        return time.monotonic() - start

    took = asyncio.run(main())
    return read_jsonl(tmp_path / "weights_server_0.jsonl"), took


def test_a_stop_waits_for_the_version_being_applied_and_logs_it(tmp_path, monkeypatch):
    rows, _ = _stop_while_applying(tmp_path, monkeypatch, apply_s=1.0)
    assert [(r["version"], r["checksum"]) for r in rows] == [(0, "v0"), (1, "v1")]


def test_the_wait_at_stop_is_bounded(tmp_path, monkeypatch):
    rows, took = _stop_while_applying(tmp_path, monkeypatch, apply_s=RECEIVER_FINISH_S + 30)
    assert [r["version"] for r in rows] == [0]
    assert took < RECEIVER_FINISH_S + 10
