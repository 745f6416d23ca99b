"""The Ray launcher's plan (`asyncrl.launch.ray_placement`): who reserves what, before Ray
places anything."""

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.launch.fleet import LaunchError
from asyncrl.launch.ray_placement import bundles, plan_seats, reserved, spec_for_seat
from asyncrl.placement import plan_placement
from asyncrl.run_spec import RunSpec


def _cfg(*overrides: str):
    return load_config(None, ["launch.backend=ray", *overrides])


def test_every_process_gets_a_seat_and_the_replay_reserves_nothing():
    cfg = _cfg("rollout.num_servers=2", "learner.world_size=2", "launch.ray.learner_num_cpus=2")
    plan = plan_placement(cfg, 4)  # disaggregated: learner ranks on GPUs 0-1, servers on 2-3
    seats = plan_seats(cfg, with_learner=True, plan=plan)
    assert [(s.name, s.role, s.index) for s in seats] == [
        ("replay", "replay", 0),
        ("server_0", "server", 0),
        ("server_1", "server", 1),
        ("learner_0", "learner", 0),
        ("learner_1", "learner", 1),
    ]
    assert seats[0].bundle == {}
    assert seats[1].bundle == {"CPU": 1.0, "GPU": 1.0}
    assert seats[3].bundle == {"CPU": 2.0, "GPU": 1.0}
    assert reserved(seats) == {"CPU": 6.0, "GPU": 4.0}
    cpu = plan_seats(cfg, with_learner=True, plan=plan_placement(cfg, 0))
    assert cpu[3].bundle == {"CPU": 2.0}  # a zero resource is not asked for
    assert reserved(cpu) == {"CPU": 6.0, "GPU": 0.0}


def test_processes_sharing_a_gpu_share_one_bundle_each_taking_its_fraction():
    """One GPU, two servers: one bundle {GPU: 1} holds the learner rank (0.6) and both servers
    (0.2 each); their CPUs add up."""
    cfg = _cfg("rollout.num_servers=2")
    seats = plan_seats(cfg, with_learner=True, plan=plan_placement(cfg, 1))
    takes = {s.name: s.bundle for s in seats}
    assert takes["server_0"] == takes["server_1"] == {"CPU": 1.0, "GPU": 0.2}
    assert takes["learner_0"] == {"CPU": 1.0, "GPU": 0.6}
    assert [(b, [s.name for s in members]) for b, members in bundles(seats)] == [
        ({"CPU": 3.0, "GPU": 1.0}, ["server_0", "server_1", "learner_0"])
    ]
    assert reserved(seats) == {"CPU": 3.0, "GPU": 1.0}


def test_a_server_sharing_several_gpus_is_refused_under_ray():
    cfg = _cfg("rollout.engine=vllm", "rollout.gpus_per_server=2")
    with pytest.raises(LaunchError, match="rollout.gpus_per_server=2"):
        plan_seats(cfg, with_learner=True, plan=plan_placement(cfg, 2))


def test_the_old_gpu_keys_name_launch_gpus():
    with pytest.raises(
        ConfigError, match="launch.ray.server_num_gpus was renamed: use launch.gpus"
    ):
        _cfg("launch.ray.server_num_gpus=1")


def test_serving_plans_no_learner():
    seats = plan_seats(_cfg(), with_learner=False)
    assert [s.name for s in seats] == ["replay", "server_0"]


@pytest.mark.parametrize(("threads_per_process", "expected"), [(0, 3), (5, 5)])
def test_an_actor_runs_as_many_threads_as_its_bundle_has_cpus_unless_pinned(
    threads_per_process, expected
):
    cfg = _cfg("launch.ray.server_num_cpus=3", f"launch.threads_per_process={threads_per_process}")
    server = plan_seats(cfg, with_learner=False)[1]
    spec = RunSpec("run", "model", "tcp://127.0.0.1:1", "127.0.0.1", 2, 3, threads=1)
    assert spec_for_seat(spec, cfg, server).threads == expected
    replay = plan_seats(cfg, with_learner=False)[0]
    assert spec_for_seat(spec, cfg, replay).threads == (threads_per_process or 1)
