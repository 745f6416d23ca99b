"""`threads_per_process`: the CPUs split between compute processes unless set explicitly."""

from __future__ import annotations

import os

from asyncrl.config import load_config
from asyncrl.launch.fleet import threads_per_process


def test_cpus_are_split_between_servers_and_learner_ranks(monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert threads_per_process(load_config(None, [])) == 4  # 1 server + 1 learner rank
    cfg = load_config(None, ["rollout.num_servers=3", "learner.world_size=1"])
    assert threads_per_process(cfg) == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert threads_per_process(load_config(None, ["rollout.num_servers=3"])) == 1  # never 0


def test_an_explicit_count_wins(monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert threads_per_process(load_config(None, ["launch.threads_per_process=2"])) == 2
