"""The placement rule (`asyncrl.placement`): which GPUs each process gets, its share of their
memory, its CUDA_VISIBLE_DEVICES, and the placements refused before anything starts; for 0, 1,
2, 4 and 8 GPUs across learner ranks, servers and gpus_per_server."""

from __future__ import annotations

import json

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.placement import PlacementError, PlacementPlan, maybe_limit_gpu_memory, plan_placement
from asyncrl.run_spec import RunSpec


def _plan(gpus: int, *overrides: str, with_learner: bool = True, parent_cvd: str | None = None):
    return plan_placement(load_config(None, list(overrides)), gpus, with_learner, parent_cvd)


def _where(plan: PlacementPlan) -> dict[str, tuple[tuple[int, ...], float | None, bool]]:
    """name -> (GPUs, memory fraction, shared), the replay left out."""
    return {
        p.name: (p.gpus, p.memory_fraction, p.shared) for p in plan.places if p.name != "replay"
    }


def test_no_gpu_leaves_every_process_as_it_always_was():
    plan = _plan(0, "rollout.num_servers=2", "learner.world_size=2")
    assert plan.mode == "cpu" and plan.gpus == 0
    assert [p.name for p in plan.places] == [
        "replay",
        "server_0",
        "server_1",
        "learner_0",
        "learner_1",
    ]
    for p in plan.places:
        assert (p.gpus, p.cuda_visible_devices, p.memory_fraction, p.shared) == (
            (),
            None,
            None,
            False,
        )


def test_launch_gpus_0_hides_the_gpus_a_machine_has():
    plan = _plan(2, "launch.gpus=0")
    assert plan.mode == "cpu"
    assert {p.cuda_visible_devices for p in plan.places} == {""}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["rollout.device=cuda"], "rollout.device=cuda"),
        (["learner.device=cuda"], "learner.device=cuda"),
    ],
)
def test_a_cuda_device_without_gpus_is_refused_naming_its_key(overrides, key):
    with pytest.raises(PlacementError, match=key):
        _plan(0, *overrides)
    with pytest.raises(PlacementError, match=key):
        _plan(4, "launch.gpus=0", *overrides)


def test_more_gpus_than_present_is_refused():
    with pytest.raises(PlacementError, match=r"launch.gpus=2 but this machine shows 1 GPU"):
        _plan(1, "launch.gpus=2")
    with pytest.raises(PlacementError, match=r"CUDA_VISIBLE_DEVICES='3'"):
        _plan(1, "launch.gpus=2", parent_cvd="3")


def test_one_gpu_colocates_the_server_with_the_learner():
    plan = _plan(1)
    assert plan.mode == "colocated"
    assert _where(plan) == {"server_0": ((0,), 0.4, True), "learner_0": ((0,), 0.6, True)}
    cvd = {p.name: p.cuda_visible_devices for p in plan.places}
    assert cvd == {"replay": "", "server_0": "0", "learner_0": "0"}


def test_one_gpu_two_servers_split_the_servers_share():
    plan = _plan(1, "rollout.num_servers=2")
    assert _where(plan) == {
        "server_0": ((0,), 0.2, True),
        "server_1": ((0,), 0.2, True),
        "learner_0": ((0,), 0.6, True),
    }


def test_an_explicit_fraction_is_taken_and_the_learner_gets_the_rest():
    plan = _plan(1, "rollout.num_servers=2", "rollout.gpu_memory_fraction=0.3")
    assert _where(plan)["server_1"] == ((0,), 0.3, True)
    assert _where(plan)["learner_0"] == ((0,), 0.4, True)


@pytest.mark.parametrize(
    ("overrides", "total"),
    [
        (["rollout.num_servers=2", "rollout.gpu_memory_fraction=0.5"], "1.00"),  # learner: 0
        (["rollout.gpu_memory_fraction=0.95"], "0.95"),  # learner: 0.05 < LEARNER_MIN_SHARE
    ],
)
def test_fractions_that_leave_the_learner_too_little_are_refused(overrides, total):
    with pytest.raises(PlacementError, match=rf"rollout.gpu_memory_fraction=.* adds up to {total}"):
        _plan(1, *overrides)


def test_servers_alone_on_a_gpu_may_not_take_more_than_all_of_it():
    serving = ["rollout.num_servers=3", "rollout.gpu_memory_fraction=0.4"]
    with pytest.raises(PlacementError, match="adds up to 1.20"):
        _plan(1, *serving, with_learner=False)
    plan = _plan(1, "rollout.num_servers=2", with_learner=False)  # default 0.85, split
    assert _where(plan) == {"server_0": ((0,), 0.425, True), "server_1": ((0,), 0.425, True)}


def test_learner_ranks_need_a_gpu_each():
    with pytest.raises(PlacementError, match=r"learner.world_size=2 needs a GPU per rank"):
        _plan(1, "learner.world_size=2")
    plan = _plan(1, "learner.world_size=2", "learner.device=cpu")  # ranks on CPU: fine
    assert _where(plan) == {
        "server_0": ((0,), 0.85, False),
        "learner_0": ((), None, False),
        "learner_1": ((), None, False),
    }
    assert plan.place("learner_1").cuda_visible_devices == ""  # type: ignore[union-attr]


def test_a_cpu_server_beside_a_gpu_learner():
    plan = _plan(1, "rollout.device=cpu")
    assert plan.mode == "disaggregated"
    assert _where(plan) == {"server_0": ((), None, False), "learner_0": ((0,), 1.0, False)}
    assert plan.place("server_0").cuda_visible_devices == ""  # type: ignore[union-attr]


def test_two_gpus_give_each_process_its_own():
    plan = _plan(2)
    assert plan.mode == "disaggregated"
    assert _where(plan) == {"server_0": ((1,), 0.85, False), "learner_0": ((0,), 1.0, False)}


def test_two_gpus_three_processes_fill_the_free_gpu_first():
    plan = _plan(2, "rollout.num_servers=2")
    assert plan.mode == "colocated"
    assert _where(plan) == {
        "server_0": ((1,), 0.85, False),
        "server_1": ((0,), 0.4, True),
        "learner_0": ((0,), 0.6, True),
    }


def test_gpus_per_server():
    tp = ["rollout.engine=vllm", "rollout.gpus_per_server=2"]
    plan = _plan(2, *tp)  # wraps onto the learner's GPU: the smaller share of the two
    assert _where(plan) == {"server_0": ((1, 0), 0.4, True), "learner_0": ((0,), 0.6, True)}
    assert plan.place("server_0").cuda_visible_devices == "1,0"  # type: ignore[union-attr]
    with pytest.raises(PlacementError, match="rollout.gpus_per_server=3 exceeds launch.gpus=2"):
        _plan(2, "rollout.engine=vllm", "rollout.gpus_per_server=3")
    with pytest.raises(ConfigError, match="rollout.gpus_per_server=2 with rollout.engine=hf"):
        load_config(None, ["rollout.gpus_per_server=2"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["learner.world_size=2", "rollout.num_servers=2"],
            {"server_0": (2,), "server_1": (3,), "learner_0": (0,), "learner_1": (1,)},
        ),
        (
            ["rollout.num_servers=3"],
            {"server_0": (1,), "server_1": (2,), "server_2": (3,), "learner_0": (0,)},
        ),
        (
            ["rollout.engine=sglang", "rollout.gpus_per_server=3"],
            {"server_0": (1, 2, 3), "learner_0": (0,)},
        ),
    ],
)
def test_four_gpus_disaggregated(overrides, expected):
    plan = _plan(4, *overrides)
    assert plan.mode == "disaggregated"
    assert {name: gpus for name, (gpus, _, _) in _where(plan).items()} == expected
    for p in plan.places:
        if p.role == "server":
            assert (p.memory_fraction, p.shared) == (0.85, False)
            assert p.cuda_visible_devices == ",".join(map(str, p.gpus))


def test_four_gpus_two_ranks_four_servers_wrap_onto_the_learner():
    plan = _plan(4, "learner.world_size=2", "rollout.num_servers=4")
    assert plan.mode == "colocated"
    assert _where(plan) == {
        "server_0": ((2,), 0.85, False),
        "server_1": ((3,), 0.85, False),
        "server_2": ((0,), 0.4, True),
        "server_3": ((1,), 0.4, True),
        "learner_0": ((0,), 0.6, True),
        "learner_1": ((1,), 0.6, True),
    }


def test_eight_gpus():
    plan = _plan(
        8,
        "learner.world_size=4",
        "rollout.num_servers=2",
        "rollout.engine=vllm",
        "rollout.gpus_per_server=2",
    )
    assert plan.mode == "disaggregated"
    assert {n: g for n, (g, _, _) in _where(plan).items() if n.startswith("server")} == {
        "server_0": (4, 5),
        "server_1": (6, 7),
    }
    full = _plan(8, "learner.world_size=8", "rollout.num_servers=16")  # two servers per rank
    assert full.mode == "colocated"
    for r in range(8):
        assert _where(full)[f"server_{r}"] == ((r,), 0.2, True)
        assert _where(full)[f"server_{r + 8}"] == ((r,), 0.2, True)
        assert _where(full)[f"learner_{r}"] == ((r,), 0.6, True)
    with pytest.raises(PlacementError, match="learner.world_size=9"):
        _plan(8, "learner.world_size=9")


def test_gpu_ids_are_the_parents_names_for_them():
    plan = _plan(2, "rollout.num_servers=2", parent_cvd="4,GPU-abc")
    cvd = {p.name: p.cuda_visible_devices for p in plan.places}
    assert cvd == {"replay": "", "server_0": "GPU-abc", "server_1": "4", "learner_0": "4"}
    one = _plan(1, "launch.gpus=1", parent_cvd="6,7")  # launch.gpus: the first of them
    assert one.place("learner_0").cuda_visible_devices == "6"  # type: ignore[union-attr]


def test_serving_places_no_learner():
    plan = _plan(2, "rollout.num_servers=2", with_learner=False)
    assert _where(plan) == {"server_0": ((0,), 0.85, False), "server_1": ((1,), 0.85, False)}


def test_the_plan_is_printable_and_goes_through_launch_json(tmp_path):
    plan = _plan(1, "rollout.num_servers=2")
    table = plan.table()
    assert "colocated, 1 GPU(s)" in table
    for name in ("replay", "server_0", "server_1", "learner_0"):
        assert name in table
    assert "0.60 shared" in table and "0.20 shared" in table
    assert PlacementPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    spec = RunSpec(str(tmp_path), "model", "tcp://127.0.0.1:1", "127.0.0.1", 2, 3, 1, plan)
    spec.save(tmp_path / "launch.json")
    loaded = RunSpec.load(tmp_path / "launch.json")
    assert loaded == spec
    assert loaded.own_place("server_1") == plan.place("server_1")
    assert json.loads((tmp_path / "launch.json").read_text())["placement"]["mode"] == "colocated"
    old = RunSpec(str(tmp_path), "model", "tcp://127.0.0.1:1", "127.0.0.1", 2, 3, 1)
    old.save(tmp_path / "old.json")  # a spec without a placement still loads
    assert RunSpec.load(tmp_path / "old.json").own_place("learner_0") is None


def test_a_process_on_cpu_is_left_untouched():
    shared = _plan(1).place("learner_0")
    assert maybe_limit_gpu_memory(shared, "cpu") is None
    assert maybe_limit_gpu_memory(None, "cpu") is None


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("rollout.vllm.gpu_memory_utilization", "rollout.gpu_memory_fraction"),
        ("rollout.sglang.mem_fraction_static", "rollout.gpu_memory_fraction"),
        ("launch.ray.learner_num_gpus", "launch.gpus"),
    ],
)
def test_the_old_memory_and_gpu_keys_name_the_new_ones(old, new):
    with pytest.raises(ConfigError, match=f"{old} was renamed: use {new}"):
        load_config(None, [f"{old}=0.5"])


def test_the_engines_take_the_placed_fraction_and_gpus():
    """SGLang's arguments carry the server's fraction and GPUs (sglang is not imported)."""
    from asyncrl.config import SGLangConfig
    from rollout_servers.engines.sglang import engine_kwargs

    kwargs = engine_kwargs(
        "m", SGLangConfig(), "cuda", 0, gpu_memory_fraction=0.3, tensor_parallel=2
    )
    assert (kwargs["mem_fraction_static"], kwargs["tp_size"]) == (0.3, 2)
