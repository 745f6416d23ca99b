"""The local launcher hands each process the CUDA_VISIBLE_DEVICES of its placement (a fake GPU
count stands in for the GPUs), records the plan in launch.json, leaves the CPU default run's
environment as it was, and refuses a placement that cannot work before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl import placement
from asyncrl.config import load_config
from asyncrl.launch import cli, local
from asyncrl.launch.fleet import prepare_run_dir


class _FakePopen:
    pid = 0
    returncode = None

    def poll(self):
        return None


def _start_recorded(
    monkeypatch, tmp_path: Path, gpus: int, *overrides: str, with_learner: bool = True
):
    """Start the local fleets with `gpus` fake GPUs; (name -> env, run_dir)."""
    envs: dict[str, dict[str, str]] = {}

    def fake_start(self, name, argv, env):
        envs[name] = env
        proc = local.Proc(name, _FakePopen(), Path(self.spec.run_dir) / f"{name}.log")
        self.procs.append(proc)
        return proc

    monkeypatch.setattr(placement, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(local.LocalFleet, "start", fake_start)
    monkeypatch.setattr(local, "wait_for_replay", lambda fleet, answers, timeout_s: None)
    cfg = load_config(None, [f"trainer.run_dir={tmp_path}", *overrides])
    run_dir = prepare_run_dir(cfg, "test")
    local.start_local_fleets(cfg, run_dir, "model", with_learner)
    return envs, run_dir


def test_each_process_gets_the_gpus_of_its_placement(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    envs, run_dir = _start_recorded(
        monkeypatch, tmp_path, 3, "learner.world_size=2", "rollout.num_servers=2"
    )
    cvd = {name: env["CUDA_VISIBLE_DEVICES"] for name, env in envs.items()}
    # ranks on GPUs 0, 1 (the parent's 3, 5); server_0 on 2 (6); server_1 wraps onto rank 0's
    assert cvd == {
        "replay": "",
        "server_0": "6",
        "server_1": "3",
        "learner_0": "3",
        "learner_1": "5",
    }
    assert [envs[f"learner_{r}"]["LOCAL_RANK"] for r in (0, 1)] == ["0", "0"]  # its own cuda:0
    assert [envs[f"learner_{r}"]["RANK"] for r in (0, 1)] == ["0", "1"]
    saved = json.loads((run_dir / "launch.json").read_text())["placement"]
    assert saved["mode"] == "colocated" and saved["gpus"] == 3
    assert [p["cuda_visible_devices"] for p in saved["places"]] == ["", "6", "3", "3", "5"]
    out = capsys.readouterr().out
    assert "asyncrl: placement: colocated, 3 GPU(s)" in out and "learner_1" in out


def test_the_cpu_default_run_environment_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    envs, run_dir = _start_recorded(monkeypatch, tmp_path, 0, "learner.world_size=2")
    assert list(envs) == ["replay", "server_0", "learner_0", "learner_1"]
    assert all("CUDA_VISIBLE_DEVICES" not in env for env in envs.values())
    assert [envs[f"learner_{r}"]["LOCAL_RANK"] for r in (0, 1)] == ["0", "1"]  # as before
    assert json.loads((run_dir / "launch.json").read_text())["placement"]["mode"] == "cpu"


def test_a_placement_that_cannot_work_fails_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(placement, "visible_gpus", lambda: 0)
    run_dir = tmp_path / "run"
    code = cli.main(["launch", "launch.gpus=1", f"trainer.run_dir={run_dir}"])
    assert code == 2
    assert "launch.gpus=1 but this machine shows 0 GPU(s)" in capsys.readouterr().err
    assert not run_dir.exists()  # no run directory, no model, no process


@pytest.mark.parametrize("gpus", [1, 2])
def test_serving_places_the_servers_only(tmp_path, monkeypatch, gpus):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    envs, _ = _start_recorded(
        monkeypatch, tmp_path, gpus, "rollout.num_servers=2", with_learner=False
    )
    cvd = {name: env["CUDA_VISIBLE_DEVICES"] for name, env in envs.items()}
    assert cvd == {"replay": "", "server_0": "0", "server_1": "0" if gpus == 1 else "1"}
