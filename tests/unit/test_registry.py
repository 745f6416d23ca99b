"""The one `Registry` behind agent loops, tools, interactions, rewards, tasks and estimators, and
the embedded demo plugging in through entry points as a user's package would."""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

import pytest

from asyncrl.data.prompts import TASKS, setup_task
from asyncrl.registry import Registry, import_object


def test_decorator_direct_and_path_registration():
    reg: Registry[object] = Registry("widget")

    @reg.register("a")
    class A:
        pass

    reg.register("b", 42)
    reg.register("c", "json:dumps")
    assert reg["a"] is A and reg["b"] == 42
    import json

    assert reg["c"] is json.dumps  # imported on first use, then cached
    assert reg.names() == ["a", "b", "c"]
    assert reg.resolve("json:loads") is json.loads  # an unregistered import path
    with pytest.raises(ValueError, match=r"unknown widget 'json:loads': registered are"):
        reg.resolve("json:loads", allow_path=False)  # rows may not name import paths
    with pytest.raises(ValueError, match=r"unknown widget 'zzz': registered are \['a', 'b', 'c'\]"):
        reg.resolve("zzz")
    with pytest.raises(ValueError, match="cannot import 'no_such_module_x'"):
        reg.resolve("no_such_module_x:thing")
    with pytest.raises(ValueError, match="has no 'nothing_here'"):
        reg.resolve("json:nothing_here")
    with pytest.raises(KeyError, match="unknown widget"):
        reg["zzz"]
    assert reg.get("zzz") is None
    reg.unregister("a")
    assert "a" not in reg


def test_import_object_names_the_path_whatever_is_wrong_with_it():
    """The one `module:attr` helper: registries, estimator declarations and the reward workers
    all import through it, so each of their errors names the string that failed."""
    import json
    import os.path

    assert import_object("json:dumps") is json.dumps
    assert import_object("os:path.join") is os.path.join  # a dotted attribute
    for path, reason in [
        ("json.dumps", "is not an import path of the form package.module:attr"),
        (":dumps", "is not an import path"),
        ("json:", "is not an import path"),
        ("no_such_module_x:thing", "cannot import 'no_such_module_x'"),
        ("json:nothing_here", "'json' has no 'nothing_here'"),
        ("os:path.nothing_here", "'os' has no 'path.nothing_here'"),
    ]:
        with pytest.raises(ValueError, match=reason) as e:
            import_object(path)
        assert repr(path) in str(e.value)


def test_estimators_and_reward_workers_import_through_the_same_helper():
    from asyncrl.algorithms.estimators import ESTIMATORS, Estimator
    from rollout_servers.rewards.computer import _resolve

    assert ESTIMATORS["grpo"].function().__name__ == "_grpo"  # declared by import path
    with pytest.raises(ValueError, match="'asyncrl.algorithms.advantages:_nothing'"):
        Estimator("toy", "asyncrl.algorithms.advantages:_nothing", "sequence").function()
    assert _resolve(("module", "json", "dumps")) is __import__("json").dumps
    with pytest.raises(ValueError, match="cannot import 'no_such_module_x'"):
        _resolve(("module", "no_such_module_x", "score"))


def test_a_lazy_member_is_not_imported_until_used():
    reg: Registry[object] = Registry("widget")
    reg.register("later", "asyncrl_test_never_imported_module:thing")
    assert "later" in reg  # knowing the name imports nothing
    assert "asyncrl_test_never_imported_module" not in sys.modules
    with pytest.raises(ValueError, match="cannot import"):
        reg["later"]


def test_the_demo_plugs_in_through_entry_points_like_any_package():
    """pyproject.toml declares the embedded tasks and their reward as entry points; nothing in
    the core or the fleets names the demo."""
    declared = {ep.name: ep.value for ep in entry_points(group="asyncrl.tasks")}
    assert declared["arith"] == "asyncrl.demo.tasks:setup_arith_task"
    rewards = {ep.name: ep.value for ep in entry_points(group="asyncrl.rewards")}
    assert rewards["asyncrl/arith"] == "asyncrl.demo.tasks:arith_score"
    from asyncrl.config import DataConfig
    from asyncrl.demo.tasks import ArithmeticTask, ToolArithmeticTask, arith_score
    from rollout_servers.rewards.functions import REWARD_FNS

    assert {"arith", "arith_tool"} <= set(TASKS.names())
    assert setup_task(DataConfig(task="arith", task_max_operand=5, seed=3)) == ArithmeticTask(5, 3)
    assert setup_task(DataConfig(task="arith_tool", seed=3)) == ToolArithmeticTask(seed=3)
    assert REWARD_FNS["asyncrl/arith"] is REWARD_FNS["asyncrl/arith_tool"] is arith_score


def test_an_explicit_registration_overrides_an_entry_point():
    reg: Registry[object] = Registry("task", "asyncrl.tasks")
    reg.register("arith", 7)
    assert reg["arith"] == 7
    assert "arith_tool" in reg  # the other entry points are still there
