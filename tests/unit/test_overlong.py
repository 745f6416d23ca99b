"""DAPO's overlong shaping (`reward.overlong_buffer`, `rollout_servers.rewards.overlong`): verl's formula
on values worked out by hand, the budget each agent loop gets, and a server that adds the
penalty to the reward and logs it apart from the task reward."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.reward import response_budget
from asyncrl.run_spec import RunSpec
from asyncrl.wire.protocol import ChatMessage, PromptItem
from rollout_servers.agents.base import AgentResult
from rollout_servers.rewards.overlong import overlong_reward
from rollout_servers.server import RolloutServer


# By hand, with verl's definitions: expected = L - buffer, exceed = length - expected,
# penalty = min(-exceed / buffer * factor, 0).
@pytest.mark.parametrize(
    ("length", "budget", "buffer", "factor", "penalty"),
    [
        (10, 16, 4, 1.0, 0.0),  # expected 12, exceed -2: +0.5 is capped at 0
        (12, 16, 4, 1.0, 0.0),  # exactly the expected length: exceed 0
        (13, 16, 4, 1.0, -0.25),  # exceed 1 of a buffer of 4
        (14, 16, 4, 1.0, -0.5),
        (16, 16, 4, 1.0, -1.0),  # the whole budget: the whole factor
        (17, 20, 8, 0.5, -0.3125),  # expected 12, exceed 5: -5/8 x 0.5
        (4000, 4096, 512, 1.0, -0.8125),  # expected 3584, exceed 416: -416/512
        (20, 16, 4, 1.0, -2.0),  # past the budget (a multi-turn response): linear beyond -1
    ],
)
def test_verls_formula_on_hand_computed_values(length, budget, buffer, factor, penalty):
    assert overlong_reward(length, budget, buffer, factor) == pytest.approx(penalty, abs=1e-12)


def test_the_budget_is_the_agent_loops_unless_set():
    cfg = load_config(
        None, ["rollout.max_new_tokens=6", "rollout.tool_agent.max_response_tokens=64"]
    )
    assert response_budget(cfg.reward, cfg.rollout, "single_turn") == 6
    assert response_budget(cfg.reward, cfg.rollout, "tool_agent") == 64
    cfg = load_config(None, ["reward.overlong_buffer.max_resp_len=32"])
    assert response_budget(cfg.reward, cfg.rollout, "tool_agent") == 32


def test_a_buffer_longer_than_the_budget_is_refused_at_start_up():
    with pytest.raises(ConfigError, match="overlong_buffer.len=7 is longer than the response"):
        load_config(None, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=7"])


class _Loop:
    """Responses of 3, 5 and 6 tokens, in the order the samples ask."""

    def __init__(self) -> None:
        self.lengths = [3, 5, 6]

    async def run(self, prompt, params=None) -> AgentResult:
        r = self.lengths.pop(0)
        return AgentResult([1], [2] * r, [1] * r, [-0.5] * r, [0] * r, "x", "length")


class _Rewards:
    async def score(self, data_source, solution_str, ground_truth, extra_info):
        return 1.0, {}


class _Client:
    def __init__(self) -> None:
        self.sent: list = []

    async def put(self, traj) -> None:
        self.sent.append(traj)


class _Engine:
    on_batch = None


def _shaped(tmp_path: Path, overrides: list[str], eval_job: str = "") -> list:
    cfg = load_config(None, ["rollout.n=3", "rollout.max_new_tokens=6", *overrides])
    spec = RunSpec(str(tmp_path), "unused", "tcp://127.0.0.1:1", "127.0.0.1", 0, 0, 1)
    client = _Client()
    server = RolloutServer(cfg, spec, 0, _Engine(), _Loop(), client, _Rewards())  # type: ignore[arg-type]
    prompt = PromptItem("g-1", 3, "src", [ChatMessage("user", "q")], "a", {}, eval_job=eval_job)
    asyncio.run(server.run_group(prompt))
    return sorted(client.sent, key=lambda t: t.sample_index)


def test_the_server_adds_the_penalty_and_logs_it_apart(tmp_path):
    on = ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=2"]
    sent = _shaped(tmp_path, on)  # budget 6, buffer 2: penalised past 4 tokens, -0.5 per token
    assert [t.reward for t in sent] == [1.0, 0.5, 0.0]
    assert [t.metrics["overlong_reward"] for t in sent] == [0.0, -0.5, -1.0]
    assert [t.metrics["overlong"] for t in sent] == [0.0, 1.0, 1.0]
    assert [t.metrics["task_reward"] for t in sent] == [1.0, 1.0, 1.0]
    off = _shaped(tmp_path, [])
    assert [t.reward for t in off] == [1.0, 1.0, 1.0] and off[0].metrics == {}
    evaluation = _shaped(tmp_path, on, eval_job="job-1")  # an evaluation reports the task's score
    assert [t.reward for t in evaluation] == [1.0, 1.0, 1.0] and evaluation[0].metrics == {}
