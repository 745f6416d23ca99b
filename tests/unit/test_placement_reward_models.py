"""Rule 5 of the placement (`asyncrl.placement`): the reward-model servers go after the learner's
and the servers' GPUs, one GPU each, with `reward.model.gpu_memory_fraction` of it counted
against the GPU like a server's share; the local launcher starts them with their
CUDA_VISIBLE_DEVICES; a plan without a reward model is the plan it always was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl import placement
from asyncrl.config import ConfigError, load_config
from asyncrl.launch import local
from asyncrl.launch.fleet import prepare_run_dir
from asyncrl.launch.ray_placement import plan_seats
from asyncrl.placement import PlacementError, PlacementPlan, maybe_limit_gpu_memory, plan_placement

RM = "reward.model.path=rm"  # the path is only checked by the launcher


class _FakePopen:
    pid = 0
    returncode = None

    def poll(self):
        return None


def _plan(gpus: int, *overrides: str, with_learner: bool = True) -> PlacementPlan:
    return plan_placement(load_config(None, list(overrides)), gpus, with_learner)


def _where(plan: PlacementPlan) -> dict[str, tuple[tuple[int, ...], float | None, bool]]:
    """name -> (GPUs, memory fraction, shared), the replay left out."""
    return {
        p.name: (p.gpus, p.memory_fraction, p.shared) for p in plan.places if p.name != "replay"
    }


def test_one_gpu_everything_shares_gpu_0_and_the_learner_gets_what_is_left():
    plan = _plan(1, RM)
    assert plan.mode == "colocated"
    assert _where(plan) == {
        "reward_model_0": ((0,), 0.1, True),
        "server_0": ((0,), 0.4, True),  # the servers' default share is as it was
        "learner_0": ((0,), 0.5, True),  # 1 - 0.4 - 0.1
    }
    two = _plan(1, RM, "rollout.num_servers=2", "reward.num_servers=2")
    assert _where(two) == {
        "reward_model_0": ((0,), 0.1, True),
        "reward_model_1": ((0,), 0.1, True),
        "server_0": ((0,), 0.2, True),
        "server_1": ((0,), 0.2, True),
        "learner_0": ((0,), 0.4, True),  # 1 - 2 x 0.2 - 2 x 0.1
    }
    assert two.place("reward_model_1").cuda_visible_devices == "0"  # type: ignore[union-attr]


def test_four_gpus_the_reward_model_gets_the_gpu_after_the_servers():
    """1 rank + 2 servers + 1 reward model on 4 GPUs: every process has a GPU of its own; the
    reward model's share is its fraction there too (rule 5: it holds to it either way)."""
    plan = _plan(4, RM, "rollout.num_servers=2")
    assert plan.mode == "disaggregated"
    assert _where(plan) == {
        "reward_model_0": ((3,), 0.1, False),
        "server_0": ((1,), 0.85, False),
        "server_1": ((2,), 0.85, False),
        "learner_0": ((0,), 1.0, False),
    }
    assert plan.place("reward_model_0").cuda_visible_devices == "3"  # type: ignore[union-attr]


def test_too_few_gpus_the_reward_models_wrap_after_the_servers():
    """(L + servers x T + k) mod G: with 2 GPUs, 1 rank, 1 server, reward models 0 and 1 land
    on the learner's GPU and the server's."""
    plan = _plan(2, RM, "reward.num_servers=2", "reward.model.gpu_memory_fraction=0.05")
    assert _where(plan) == {
        "reward_model_0": ((0,), 0.05, True),
        "reward_model_1": ((1,), 0.05, True),
        "server_0": ((1,), 0.85, True),
        "learner_0": ((0,), 0.95, True),
    }


def test_servers_on_cpu_take_no_gpus_before_the_reward_models():
    plan = _plan(2, RM, "rollout.device=cpu")
    assert _where(plan)["reward_model_0"] == ((1,), 0.1, False)


def test_a_cpu_reward_model_or_no_gpu_keeps_it_off_the_gpus():
    plan = _plan(1, RM, "reward.model.device=cpu")
    assert _where(plan)["reward_model_0"] == ((), None, False)
    assert _where(plan)["learner_0"] == ((0,), 0.6, True)  # as without a reward model
    assert plan.place("reward_model_0").cuda_visible_devices == ""  # type: ignore[union-attr]
    none = _plan(0, RM, "reward.num_servers=2")
    assert none.mode == "cpu"
    for name in ("reward_model_0", "reward_model_1"):
        place = none.place(name)
        assert place is not None and place.role == "reward_model"
        assert (place.gpus, place.cuda_visible_devices, place.memory_fraction) == ((), None, None)


def test_a_cuda_reward_model_without_gpus_is_refused_naming_its_key():
    with pytest.raises(PlacementError, match="reward.model.device=cuda but launch.gpus"):
        _plan(0, RM, "reward.model.device=cuda")
    _plan(0, "reward.model.device=cuda")  # no reward model: nothing to place


@pytest.mark.parametrize(
    ("gpus", "overrides", "with_learner", "message"),
    [
        (  # 0.4 + 0.6 leaves the learner rank nothing
            1,
            ["reward.model.gpu_memory_fraction=0.6"],
            True,
            r"rollout.gpu_memory_fraction=None x 1 server\(s\) \+ "
            r"reward.model.gpu_memory_fraction=0.6 x 1 reward model\(s\) on GPU 0 adds up to "
            r"1.00: .*leave learner rank 0 less than 0.1.*lower rollout.gpu_memory_fraction "
            r"or rollout.num_servers, reward.model.gpu_memory_fraction or reward.num_servers",
        ),
        (  # two reward models alone on a GPU
            1,
            ["reward.num_servers=2", "reward.model.gpu_memory_fraction=0.6", "rollout.device=cpu"],
            False,
            r"^reward.model.gpu_memory_fraction=0.6 x 2 reward model\(s\) on GPU 0 adds up to 1.20",
        ),
        (  # beside a server of its own GPU's default 0.85
            2,
            ["reward.num_servers=2", "reward.model.gpu_memory_fraction=0.2"],
            True,
            r"reward.model.gpu_memory_fraction=0.2 x 1 reward model\(s\) on GPU 1 adds up to 1.05",
        ),
    ],
)
def test_over_subscription_is_refused_naming_the_reward_models_key(
    gpus, overrides, with_learner, message
):
    with pytest.raises(PlacementError, match=message):
        _plan(gpus, RM, *overrides, with_learner=with_learner)


@pytest.mark.parametrize("value", ["0", "1.5"])
def test_the_fraction_is_bounded(value):
    with pytest.raises(ConfigError, match="reward.model.gpu_memory_fraction"):
        load_config(None, [f"reward.model.gpu_memory_fraction={value}"])


def test_the_table_lists_the_reward_models_and_launch_json_keeps_them():
    plan = _plan(1, RM)
    lines = plan.table().splitlines()
    assert lines[3].split() == ["reward_model_0", "gpu", "0", "'0'", "0.10", "shared"]
    assert len({line.index("gpu 0") for line in lines if "gpu 0" in line}) == 1  # aligned
    assert PlacementPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
def test_without_a_reward_model_the_plan_is_the_same(gpus):
    """`reward.num_servers` alone (no `reward.model.path`) places nothing: same plan, same
    table, as with no reward section at all."""
    for overrides in ([], ["rollout.num_servers=2"], ["learner.world_size=2"]):
        if gpus < 2 and overrides == ["learner.world_size=2"]:
            continue
        before = _plan(gpus, *overrides)
        after = _plan(gpus, *overrides, "reward.num_servers=3", "reward.model.device=cuda")
        assert after == before and after.table() == before.table()
        assert all(p.role != "reward_model" for p in after.places)


def test_a_reward_model_holds_to_its_share_on_a_gpu_of_its_own(monkeypatch):
    """Rule 5: its fraction is enforced shared or not; a server of its own GPU is not capped."""
    calls: list[tuple[float, torch.device]] = []
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d))
    )
    plan = _plan(4, RM, "rollout.num_servers=2")
    cuda = torch.device("cuda", 0)
    assert maybe_limit_gpu_memory(plan.place("reward_model_0"), cuda) == 0.1
    assert maybe_limit_gpu_memory(plan.place("server_0"), cuda) is None
    assert calls == [(0.1, cuda)]
    assert maybe_limit_gpu_memory(plan.place("reward_model_0"), "cpu") is None


def test_the_local_launcher_starts_them_with_their_gpus(tmp_path: Path, monkeypatch):
    rm_dir = tmp_path / "rm"
    rm_dir.mkdir()
    (rm_dir / "config.json").write_text("{}")
    envs: dict[str, dict[str, str]] = {}

    def fake_start(self, name, argv, env):
        envs[name] = env
        proc = local.Proc(name, _FakePopen(), Path(self.spec.run_dir) / f"{name}.log")
        self.procs.append(proc)
        return proc

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(placement, "visible_gpus", lambda: 4)
    monkeypatch.setattr(local.LocalFleet, "start", fake_start)
    monkeypatch.setattr(local, "wait_for_replay", lambda fleet, answers, timeout_s: None)
    cfg = load_config(
        None,
        [
            f"trainer.run_dir={tmp_path}",
            f"reward.model.path={rm_dir}",
            "reward.num_servers=2",
            "rollout.num_servers=2",
        ],
    )
    local.start_local_fleets(cfg, prepare_run_dir(cfg, "test"), "model")
    cvd = {name: env["CUDA_VISIBLE_DEVICES"] for name, env in envs.items()}
    assert cvd == {
        "replay": "",
        "reward_model_0": "3",
        "reward_model_1": "0",  # wraps onto the learner's GPU
        "server_0": "1",
        "server_1": "2",
        "learner_0": "0",
    }


def test_ray_seats_leave_the_reward_models_out():
    """The Ray launcher refuses a reward model; its seats do not break on a plan that has one."""
    cfg = load_config(None, ["launch.backend=ray", RM])
    seats = plan_seats(cfg, with_learner=True, plan=plan_placement(cfg, 1))
    assert [s.name for s in seats] == ["replay", "server_0", "learner_0"]
