"""The local backend starts every fleet process before it waits for the replay, so their
imports (seconds of torch and transformers each) overlap instead of queueing behind it."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.launch import local
from asyncrl.launch.fleet import LaunchError, prepare_run_dir


class _FakePopen:
    pid = 0
    returncode = None

    def poll(self):
        return None


def _fake_start(self, name, argv, env):
    proc = local.Proc(name, _FakePopen(), Path(self.spec.run_dir) / f"{name}.log")
    self.procs.append(proc)
    return proc


def test_servers_and_learners_start_before_the_replay_answers(tmp_path: Path, monkeypatch):
    cfg = load_config(None, [f"trainer.run_dir={tmp_path}", "rollout.num_servers=2"])
    run_dir = prepare_run_dir(cfg, "test")
    running_while_waiting: list[list[str]] = []

    def fake_wait_for_replay(fleet, answers, timeout_s):
        running_while_waiting.append([p.name for p in fleet.procs])

    monkeypatch.setattr(local.LocalFleet, "start", _fake_start)
    monkeypatch.setattr(local, "wait_for_replay", fake_wait_for_replay)
    fleet = local.start_local_fleets(cfg, run_dir, "model")
    everyone = ["replay", "server_0", "server_1", "learner_0"]
    assert [p.name for p in fleet.procs] == everyone  # the replay first: everyone's first contact
    assert running_while_waiting == [everyone]


def test_a_replay_that_never_answers_stops_everything_that_was_started(tmp_path, monkeypatch):
    cfg = load_config(None, [f"trainer.run_dir={tmp_path}"])
    run_dir = prepare_run_dir(cfg, "test")
    stopped: list[list[str]] = []

    def fake_wait_for_replay(fleet, answers, timeout_s):
        raise LaunchError("replay did not start within 1s")

    monkeypatch.setattr(local.LocalFleet, "start", _fake_start)
    monkeypatch.setattr(local.LocalFleet, "stop_all", lambda self: stopped.append(["all"]))
    monkeypatch.setattr(local, "wait_for_replay", fake_wait_for_replay)
    with pytest.raises(LaunchError, match="replay did not start"):
        local.start_local_fleets(cfg, run_dir, "model")
    assert stopped == [["all"]]


def test_reward_model_servers_start_after_the_replay_with_the_run_secret(tmp_path, monkeypatch):
    """With `reward.model.path`, each reward-model server gets an address of its own in the
    spec (the rollout servers read it there) and the run secret (it checks every role's key)."""
    from asyncrl.run_spec import RunSpec
    from asyncrl.wire.auth import KEY_ENV, SECRET_ENV

    model = tmp_path / "rm"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = load_config(
        None,
        [
            f"trainer.run_dir={tmp_path / 'run'}",
            f"reward.model.path={model}",
            "reward.num_servers=2",
        ],
    )
    run_dir = prepare_run_dir(cfg, "test")
    started: dict[str, dict[str, str]] = {}

    def record(self, name, argv, env):
        started[name] = env
        return _fake_start(self, name, argv, env)

    monkeypatch.setattr(local.LocalFleet, "start", record)
    monkeypatch.setattr(local, "wait_for_replay", lambda fleet, answers, timeout_s: None)
    fleet = local.start_local_fleets(cfg, run_dir, "model")
    assert list(started) == ["replay", "reward_model_0", "reward_model_1", "server_0", "learner_0"]
    spec = RunSpec.load(run_dir / "launch.json")
    assert spec == fleet.spec and len(set(spec.reward_model_addresses)) == 2
    assert all(a.startswith("tcp://127.0.0.1:") for a in spec.reward_model_addresses)
    assert SECRET_ENV in started["reward_model_0"] and KEY_ENV not in started["reward_model_0"]
    assert SECRET_ENV not in started["server_0"]  # a rollout server holds its own key only


def test_a_reward_model_path_without_a_model_fails_before_anything_starts(tmp_path, monkeypatch):
    cfg = load_config(None, [f"trainer.run_dir={tmp_path}", f"reward.model.path={tmp_path}"])
    run_dir = prepare_run_dir(cfg, "test")
    monkeypatch.setattr(local.LocalFleet, "start", lambda *a: pytest.fail("a process started"))
    with pytest.raises(LaunchError, match=r"reward.model.path=.* has no config.json"):
        local.start_local_fleets(cfg, run_dir, "model")


def test_the_ray_launcher_refuses_a_reward_model_before_it_connects(tmp_path):
    from asyncrl.launch.ray_cluster import start_ray_fleets

    cfg = load_config(None, [f"trainer.run_dir={tmp_path}", f"reward.model.path={tmp_path}"])
    with pytest.raises(LaunchError, match="launch.backend=local only"):
        start_ray_fleets(cfg, tmp_path, "model")
