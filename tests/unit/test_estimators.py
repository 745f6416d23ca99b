"""Advantage estimators are declared once (`asyncrl.algorithms.estimators.ESTIMATORS`), and config
validation, the learner's dispatch and the rollout servers all read that declaration: a new
estimator is one registration."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from asyncrl.algorithms.advantages import AdvantageInputs, compute_advantages
from asyncrl.algorithms.estimators import ESTIMATORS, estimator
from asyncrl.config import ConfigError, load_config
from asyncrl.run_spec import RunSpec
from asyncrl.wire.protocol import ChatMessage, PromptItem
from rollout_servers.agents.base import AgentResult
from rollout_servers.server import RolloutServer

TOY = "toy_greedy_gap"


@pytest.fixture
def toy_estimator():
    """One registration: a sequence-level estimator that needs groups of 3 and a greedy
    baseline, A_i = r_i - r_i^greedy - mean of the group's r_j - r_j^greedy."""

    @estimator(TOY, level="sequence", min_group_size=3, greedy_baseline=True)
    def toy(x: AdvantageInputs) -> torch.Tensor:
        assert x.baseline_rewards is not None
        gap = x.rewards - x.baseline_rewards
        total = torch.zeros(int(x.group_index.max()) + 1).index_add_(0, x.group_index, gap)
        count = torch.bincount(x.group_index).float()
        return gap - (total / count)[x.group_index]

    yield
    ESTIMATORS.unregister(TOY)


def test_builtin_declarations_say_what_each_estimator_needs():
    needs = {
        name: (e.level, e.needs_critic, e.min_group_size, e.greedy_baseline)
        for name in ESTIMATORS
        for e in [ESTIMATORS[name]]
    }
    assert needs == {
        "gae": ("token", True, 1, False),
        "grpo": ("sequence", False, 2, False),
        "rloo": ("sequence", False, 2, False),
        "reinforce_plus_plus": ("token", False, 1, False),
        "reinforce_plus_plus_baseline": ("token", False, 2, False),
        "remax": ("token", False, 1, True),
    }


def test_config_validation_reads_the_declaration(toy_estimator):
    cfg = load_config(None, [f"algorithm.adv_estimator={TOY}", "rollout.n=3"])
    assert cfg.algorithm.adv_estimator == TOY
    with pytest.raises(ConfigError, match=f"rollout.n must be >= 3 for {TOY}"):
        load_config(None, [f"algorithm.adv_estimator={TOY}", "rollout.n=2"])
    with pytest.raises(ConfigError, match="not a registered estimator"):
        load_config(None, ["algorithm.adv_estimator=no_such_estimator"])


def test_the_learner_dispatch_computes_and_broadcasts_it(toy_estimator):
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    greedy = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 6)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, returns = compute_advantages(
        TOY, rewards=rewards, mask=mask, group_index=groups, baseline_rewards=greedy
    )
    # group 0: gaps 1, 0, 1 (mean 2/3); group 1: gaps -1, -1, 0 (mean -2/3)
    per_seq = torch.tensor([1 / 3, -2 / 3, 1 / 3, -1 / 3, -1 / 3, 2 / 3])
    torch.testing.assert_close(adv, per_seq[:, None] * mask)
    assert returns is None
    with pytest.raises(ValueError, match="needs `baseline_rewards`"):
        compute_advantages(TOY, rewards=rewards, mask=mask, group_index=groups)


class _Loop:
    """An agent loop that answers "greedy" when sampling greedily, else "sampled"."""

    async def run(self, prompt, params=None) -> AgentResult:
        text = "greedy" if params is not None and params.temperature == 0 else "sampled"
        return AgentResult([1], [2], [1], [-0.5], [0], text, "stop")


class _Rewards:
    async def score(self, data_source, solution_str, ground_truth, extra_info):
        return (0.25 if solution_str == "greedy" else 1.0), {}


class _Client:
    def __init__(self) -> None:
        self.sent = []

    async def put(self, traj) -> None:
        self.sent.append(traj)


class _Engine:
    on_batch = None


def _baselines(tmp_path: Path, estimator_name: str) -> list[float]:
    cfg = load_config(None, [f"algorithm.adv_estimator={estimator_name}", "rollout.n=3"])
    spec = RunSpec(str(tmp_path), "unused", "tcp://127.0.0.1:1", "127.0.0.1", 0, 0, 1)
    client = _Client()
    server = RolloutServer(cfg, spec, 0, _Engine(), _Loop(), client, _Rewards())  # type: ignore[arg-type]
    prompt = PromptItem("g-1", 3, "src", [ChatMessage("user", "q")], "a", {})
    asyncio.run(server.run_group(prompt))
    assert [t.reward for t in client.sent] == [1.0, 1.0, 1.0]
    return [t.baseline_reward for t in client.sent]


def test_the_servers_sample_a_greedy_baseline_when_the_declaration_asks(tmp_path, toy_estimator):
    assert _baselines(tmp_path, TOY) == [0.25, 0.25, 0.25]
    assert all(math.isnan(b) for b in _baselines(tmp_path, "grpo"))


def test_validating_a_config_imports_no_torch():
    """The launcher and every process validate the config first; the estimator declarations
    it reads must not cost a torch import (about 1.3 s on this project's CPUs)."""
    import subprocess
    import sys

    code = (
        "import sys; from asyncrl.config import load_config; load_config(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
