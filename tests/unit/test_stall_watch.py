"""A server whose engine is wedged while its event loop (and so its heartbeat) runs on stops
after rollout.stall_timeout_s without a finished sample, so the launcher restarts it; one that
is idle, or whose samples keep finishing, does not."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncrl.config import load_config
from asyncrl.run_spec import RunSpec
from asyncrl.wire.protocol import ChatMessage, PromptItem
from rollout_servers.agents.base import AgentResult
from rollout_servers.server import RolloutServer


class _Engine:
    on_batch = None
    version = 0
    busy_s = 0.0


class _Loop:
    """Each sample takes `take_s`; forever when None (a wedged engine)."""

    def __init__(self, take_s: float | None) -> None:
        self.take_s = take_s

    async def run(self, prompt, params=None) -> AgentResult:
        await (asyncio.Event().wait() if self.take_s is None else asyncio.sleep(self.take_s))
        return AgentResult([1], [2], [1], [-0.5], [0], "answer", "stop")


class _Rewards:
    failures: dict[str, int] = {}

    async def score(self, data_source, solution_str, ground_truth, extra_info):
        return 1.0, {}


class _Client:
    """Grants `groups` one-sample prompts, then nothing; keeps what it is sent."""

    def __init__(self, groups: int) -> None:
        self.groups, self.sent, self.counters, self.outbox = groups, [], {}, {}

    def start(self) -> list[asyncio.Task]:
        return []

    async def lease(self, server_id, version, max_groups, *args) -> list[PromptItem]:
        k, self.groups = min(max_groups, self.groups), self.groups - min(max_groups, self.groups)
        if not k:
            await asyncio.sleep(0.05)
        return [
            PromptItem(f"{len(self.sent)}-{i}", 1, "src", [ChatMessage("user", "q")], "a", {})
            for i in range(k)
        ]

    async def put(self, traj) -> None:
        self.sent.append(traj)

    async def drain(self, timeout_s: float) -> int:
        return 0


def _run(tmp_path, loop: _Loop, client: _Client, for_s: float) -> RolloutServer:
    cfg = load_config(None, ["rollout.stall_timeout_s=1.0", "rollout.max_concurrent_groups=2"])
    spec = RunSpec(str(tmp_path), "unused", "tcp://127.0.0.1:1", "127.0.0.1", 0, 0, 1)
    server = RolloutServer(cfg, spec, 0, _Engine(), loop, client, _Rewards())  # type: ignore[arg-type]

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(for_s, stop.set)
        await server.run(stop)

    asyncio.run(main())
    return server


def test_a_wedged_engine_stops_the_server_after_the_stall_timeout(tmp_path):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"2 group\(s\) in flight and no sample done for \d+ s"):
        _run(tmp_path, _Loop(take_s=None), _Client(groups=2), for_s=10.0)
    assert 1.0 < time.monotonic() - started < 5.0


def test_slow_samples_that_keep_finishing_and_an_idle_server_do_not_stop_it(tmp_path):
    client = _Client(groups=8)
    _run(tmp_path, _Loop(take_s=0.4), client, for_s=4.0)  # idle after about 1.6 s
    assert len(client.sent) == 8
