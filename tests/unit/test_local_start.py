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
