"""The launcher's rules for rollout server restarts that need no process to end
(`asyncrl.launch.restarts.ServerRestarts`): a server epoch the replay has not heard from within
`launch.startup_timeout_s` of its start is killed and restarted (each epoch timed from its own
start; a replay that does not answer is no news), and a server healthy for
`HEALTHY_RESET_TIMEOUTS * launch.server_timeout_s` in a row gets its restart budget and backoff
back. Driven with a fake fleet, a fake replay report and a fake clock."""

from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass, field

import pytest
from fake_fleets import restart_records

from asyncrl.config import Config
from asyncrl.launch.fleet import LaunchError, replay_health
from asyncrl.launch.restarts import HEALTHY_RESET_TIMEOUTS, ServerRestarts
from asyncrl.wire.auth import new_secret, role_key
from asyncrl.wire.protocol import ServerHealth
from replay.service import setup_replay_service


@dataclass
class FakeFleet:
    """Nothing ends by itself here; retire and start_server are recorded."""

    retired: list[str] = field(default_factory=list)
    started: list[tuple[int, int]] = field(default_factory=list)

    def failures(self) -> list:
        return []

    def retire(self, name: str) -> None:
        self.retired.append(name)

    def start_server(self, index: int, epoch: int) -> None:
        self.started.append((index, epoch))


@dataclass
class FakeReplay:
    """The report the launcher polls: `servers`, or None (the replay did not answer)."""

    servers: list[ServerHealth] | None = field(default_factory=list)

    def __call__(self) -> list[ServerHealth] | None:
        return None if self.servers is None else list(self.servers)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _restarts(tmp_path, servers: int = 2, **launch):
    cfg = Config.model_validate(
        {"rollout": {"num_servers": servers}, "launch": {"restart_backoff_s": 2.0, **launch}}
    )
    clock, replay, said = Clock(), FakeReplay(), []
    restarts = ServerRestarts(cfg, tmp_path, replay, clock, said.append)
    return restarts, FakeFleet(), replay, clock, said


def _advance(restarts: ServerRestarts, fleet: FakeFleet, clock: Clock, seconds: float) -> None:
    """Let `seconds` pass, checking once a second as the watch loop does (and at the end)."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now = min(end, clock.now + 1.0)
        restarts.check(fleet)


# ---- startup: an epoch never heard from ------------------------------------------------------
def test_an_epoch_not_heard_from_within_startup_timeout_is_killed_and_restarted(tmp_path):
    restarts, fleet, replay, clock, said = _restarts(tmp_path, startup_timeout_s=60.0)
    replay.servers = [ServerHealth(0, 0, True, 0.5, 0)]  # server_1 hangs loading its model
    _advance(restarts, fleet, clock, 60.0)
    assert fleet.retired == []  # not before the timeout
    _advance(restarts, fleet, clock, 1.0)
    assert fleet.retired == ["server_1"]
    assert said == [
        "asyncrl: server_1 sent no heartbeat within startup_timeout_s=60 s of its start; "
        "restart 1/3 in 2.0s"
    ]
    _advance(restarts, fleet, clock, 2.0)
    assert fleet.started == [(1, 1)]
    (record,) = restart_records(tmp_path)
    assert (record["server"], record["epoch"], record["event"]) == ("server_1", 1, "restart")
    assert record["why"] == "sent no heartbeat within startup_timeout_s=60 s of its start"

    # epoch 1 is timed from its own start; an entry for epoch 0 is no news of epoch 1
    replay.servers = [ServerHealth(0, 0, True, 0.5, 0), ServerHealth(1, 0, False, 9.0, 0)]
    _advance(restarts, fleet, clock, 59.0)
    assert fleet.retired == ["server_1"]
    _advance(restarts, fleet, clock, 2.0)
    assert fleet.retired == ["server_1", "server_1"]
    assert said[-1].endswith("of its start; restart 2/3 in 4.0s")


def test_an_epoch_heard_from_in_time_is_left_alone_and_a_silent_replay_is_no_news(tmp_path):
    restarts, fleet, replay, clock, said = _restarts(tmp_path, startup_timeout_s=60.0)
    replay.servers = None  # the replay does not answer: nothing is known of any server
    _advance(restarts, fleet, clock, 120.0)
    assert fleet.retired == [] and said == []
    replay.servers = [ServerHealth(0, 0, True, 0.5, 0), ServerHealth(1, 0, True, 1.0, 0)]
    _advance(restarts, fleet, clock, 1.0)
    replay.servers = []  # (a report without them now: they were heard from, that stands)
    _advance(restarts, fleet, clock, 600.0)
    assert fleet.retired == [] and said == []


def test_the_replays_report_tells_no_answer_from_no_server_heard():
    """What the startup rule stands on: a replay that answers with no server is [] (they may
    be hung), one that does not answer is None (nothing is known)."""
    cfg, secret = Config(), new_secret()
    key = role_key(secret, "client")
    with tempfile.TemporaryDirectory(prefix="asyncrl-") as short:  # ipc paths are short
        assert replay_health(f"ipc://{short}/nobody", key, timeout_s=0.2) is None
        address = f"ipc://{short}/replay"
        service = setup_replay_service(cfg, address, None, secret=secret)
        stop = threading.Event()
        loop = threading.Thread(target=service.run, args=(stop,), daemon=True)
        loop.start()
        try:
            assert replay_health(address, key, timeout_s=5.0) == []
        finally:
            stop.set()
            loop.join(timeout=5)
            service.close()


def test_with_max_restarts_0_an_epoch_silent_from_its_start_ends_the_run(tmp_path):
    restarts, fleet, replay, clock, _ = _restarts(tmp_path, startup_timeout_s=30.0, max_restarts=0)
    replay.servers = [ServerHealth(1, 0, True, 0.5, 0)]
    with pytest.raises(LaunchError) as e:
        _advance(restarts, fleet, clock, 31.0)
    assert str(e.value).startswith(
        "process server_0 sent no heartbeat within startup_timeout_s=30 s of its start"
    )
    assert e.value.failed == ("server_0",)


# ---- the restart budget: reset after a sustained healthy stretch -----------------------------
def _kill_and_restart(restarts, fleet, replay, clock, epoch: int) -> None:
    """server_0 (now at `epoch`) is declared dead; its restart comes after the backoff."""
    replay.servers = [ServerHealth(0, epoch, False, 4.0, 0)]
    _advance(restarts, fleet, clock, 1.0)
    _advance(restarts, fleet, clock, 10.0)  # past the backoff (2 s, then 4 s)
    assert fleet.started[-1] == (0, epoch + 1)


def test_a_server_healthy_long_enough_gets_its_restart_budget_and_backoff_back(tmp_path):
    restarts, fleet, replay, clock, said = _restarts(tmp_path, servers=1, max_restarts=1)
    healthy_s = HEALTHY_RESET_TIMEOUTS * 30.0  # server_timeout_s: 30 s by default
    replay.servers = [ServerHealth(0, 0, True, 0.5, 0)]
    _advance(restarts, fleet, clock, 5.0)
    replay.servers = [ServerHealth(0, 0, False, 31.0, 2)]
    _advance(restarts, fleet, clock, 1.0)
    assert said[-1].endswith("restart 1/1 in 2.0s")
    _advance(restarts, fleet, clock, 2.0)
    assert fleet.started == [(0, 1)]
    replay.servers = [ServerHealth(0, 1, True, 0.5, 0)]
    _advance(restarts, fleet, clock, healthy_s + 1.0)
    assert said[-1] == "asyncrl: server_0 healthy for 300 s: its restart budget is reset (1 left)"
    replay.servers = [ServerHealth(0, 1, False, 31.0, 0)]  # a rare death, much later
    _advance(restarts, fleet, clock, 1.0)
    assert said[-1].endswith("restart 1/1 in 2.0s")  # not dropped; the backoff starts over
    _advance(restarts, fleet, clock, 2.0)
    assert fleet.started == [(0, 1), (0, 2)]  # the epoch only goes up
    assert [r["epoch"] for r in restart_records(tmp_path)] == [1, 2]


def test_deaths_closer_together_than_the_healthy_stretch_use_the_budget_up(tmp_path):
    restarts, fleet, replay, clock, said = _restarts(tmp_path, servers=1, max_restarts=2)
    healthy_s = HEALTHY_RESET_TIMEOUTS * 30.0
    for epoch in range(2):
        _kill_and_restart(restarts, fleet, replay, clock, epoch)
        replay.servers = [ServerHealth(0, epoch + 1, True, 0.5, 0)]
        _advance(restarts, fleet, clock, healthy_s - 10.0)  # healthy, but not long enough
    assert not any("budget is reset" in line for line in said)
    replay.servers = [ServerHealth(0, 2, False, 31.0, 0)]
    with pytest.raises(LaunchError, match="no rollout server is left"):
        _advance(restarts, fleet, clock, 1.0)
    assert said[-1] == (
        "asyncrl: server_0 dropped after 2 restarts: was declared dead by the replay "
        "(silent for 31.0 s)"
    )
    assert restarts.dropped == ["server_0"]
