"""The launcher's rules for reward-model servers (`asyncrl.launch.restarts.ServerRestarts`),
with a fake fleet and clock: one whose process ends is restarted (the replay's report of
rollout servers never judges it), its budget comes back after the healthy stretch, and with
all of them out of restarts the run fails naming them."""

from __future__ import annotations

import pytest
from fake_fleets import Clock, FakeFleet, FakeMember, restart_records

from asyncrl.config import Config
from asyncrl.launch.fleet import LaunchError
from asyncrl.launch.restarts import ServerRestarts
from asyncrl.wire.protocol import ServerHealth


def _with_reward_models(tmp_path, health=(), **launch):
    """Two rollout servers and two reward-model servers (`reward.model.path` set)."""
    cfg = Config.model_validate(
        {
            "rollout": {"num_servers": 2},
            "reward": {"model": {"path": "/rm"}, "num_servers": 2},
            "launch": {"restart_backoff_s": 2.0, **launch},
        }
    )
    clock, said = Clock(), []
    names = ["replay", "server_0", "server_1", "reward_model_0", "reward_model_1"]
    fleet = FakeFleet([FakeMember(n) for n in names])
    restarts = ServerRestarts(cfg, tmp_path, lambda: list(health), clock, said.append)
    return restarts, fleet, clock, said


def test_a_dead_reward_model_server_is_restarted_and_the_replays_report_never_judges_it(
    tmp_path,
):
    # the replay reports rollout servers by index: its server 0 is not reward_model_0
    health = [ServerHealth(0, 0, True, 0.5, 1), ServerHealth(1, 0, True, 0.5, 0)]
    restarts, fleet, clock, said = _with_reward_models(tmp_path, health, startup_timeout_s=5.0)
    fleet.end("reward_model_1")
    assert restarts.failures(fleet) == []  # taken: restarted, not a failure of the run
    assert said == ["asyncrl: reward_model_1 was killed by signal SIGKILL; restart 1/3 in 2.0s"]
    clock.now += 2.0
    restarts.check(fleet)
    assert fleet.started == [(101, 1)] and fleet.retired == ["reward_model_1"]
    clock.now += 60.0  # the replay never hears from a reward-model server: no startup kill
    restarts.check(fleet)
    assert fleet.retired == ["reward_model_1"]
    assert restart_records(tmp_path)[0]["server"] == "reward_model_1"


def test_a_reward_model_server_running_long_enough_gets_its_restart_budget_back(tmp_path):
    restarts, fleet, clock, said = _with_reward_models(tmp_path, max_restarts=1)
    fleet.end("reward_model_0")
    restarts.failures(fleet)
    clock.now += 2.0
    restarts.check(fleet)
    clock.now += 10 * 30.0 - 1.0  # HEALTHY_RESET_TIMEOUTS x server_timeout_s, less a second
    restarts.check(fleet)
    assert not any("budget is reset" in line for line in said)
    clock.now += 1.0
    restarts.check(fleet)
    assert said[-1] == (
        "asyncrl: reward_model_0 running for 300 s since its restart: its restart budget is "
        "reset (1 left)"
    )
    fleet.end("reward_model_0")  # a rare death, much later: restarted, not dropped
    restarts.failures(fleet)
    assert said[-1].endswith("restart 1/1 in 2.0s")


def test_with_every_reward_model_server_dropped_the_run_fails_naming_them(tmp_path):
    restarts, fleet, clock, said = _with_reward_models(tmp_path, max_restarts=1)
    for name in ("reward_model_0", "reward_model_1"):
        fleet.end(name)
        restarts.failures(fleet)
        clock.now += 2.0
        restarts.check(fleet)
    fleet.end("reward_model_0")
    assert restarts.failures(fleet) == []  # one is left
    fleet.end("reward_model_1")
    with pytest.raises(LaunchError) as e:
        restarts.failures(fleet)
    assert str(e.value).startswith("no reward-model server is left: each used up its 1 restarts")
    assert e.value.failed == ("reward_model_0", "reward_model_1")
    assert fleet.started[:2] == [(100, 1), (101, 1)]
