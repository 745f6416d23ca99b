"""The reward config section (`reward`): the reward function, its workers, and DAPO's
overlong shaping (`reward.overlong_buffer`, see `rollout_servers.overlong`).

Part of the tree `asyncrl.config` assembles (and re-exports); kept apart so each file reads
as one thing.
"""

from __future__ import annotations

from pydantic import Field

from asyncrl.config_base import Section
from asyncrl.rollout_config import RolloutConfig


class CustomRewardConfig(Section):
    path: str | None = None
    """Python file with a verl-signature reward function
    `compute_score(data_source, solution_str, ground_truth, extra_info=None)`; when set it
    scores every data_source."""
    name: str = "compute_score"
    """Name of the function in that file."""


class OverlongBufferConfig(Section):
    """DAPO's soft overlong punishment, verl's formula: with L the response budget,
    `expected = L - len`, `exceed = response_tokens - expected`, the penalty
    `min(-exceed / len * penalty_factor, 0)` is added to the reward."""

    enable: bool = False
    """Add the overlong penalty to every sample's reward."""
    len: int = Field(4, ge=1)
    """The buffer: responses longer than the budget less this many tokens are penalised,
    linearly, up to `penalty_factor` at the budget."""
    penalty_factor: float = Field(1.0, ge=0)
    """The penalty of a response that uses its whole budget."""
    max_resp_len: int | None = Field(None, ge=1)
    """The response budget L; None: the sample's agent loop's, `rollout.max_new_tokens`
    (`rollout.tool_agent.max_response_tokens` for the tool agent)."""


class RewardConfig(Section):
    custom: CustomRewardConfig = CustomRewardConfig()
    """A user's reward function loaded by path (verl's custom_reward_function)."""
    timeout_s: float = Field(10.0, gt=0)
    """A reward call that takes longer scores 0 and is counted; its worker is replaced."""
    workers: int = Field(2, ge=1)
    """Reward worker processes per rollout server."""
    kwargs: dict[str, float | int | bool | str] = {}
    """Options passed to reward functions that declare them (format_score, partial_credit,
    case_timeout_s, ...)."""
    overlong_buffer: OverlongBufferConfig = OverlongBufferConfig()
    """DAPO's overlong shaping: a penalty on responses that run into the end of their budget."""


def response_budget(reward: RewardConfig, rollout: RolloutConfig, agent_name: str) -> int:
    """The overlong shaping's budget L for a sample of the agent loop `agent_name`:
    `reward.overlong_buffer.max_resp_len` when set, else the loop's own budget."""
    ob = reward.overlong_buffer
    if ob.max_resp_len is not None:
        return ob.max_resp_len
    if agent_name == "tool_agent":
        return rollout.tool_agent.max_response_tokens
    return rollout.max_new_tokens


def check_overlong_budget(reward: RewardConfig, rollout: RolloutConfig) -> None:
    """ValueError when the overlong buffer is longer than the default agent loop's response
    budget (verl asserts the same): every response would be penalised."""
    ob = reward.overlong_buffer
    budget = response_budget(reward, rollout, rollout.agent_loop)
    if ob.enable and ob.len > budget:
        raise ValueError(
            f"reward.overlong_buffer.len={ob.len} is longer than the response budget {budget} "
            f"of rollout.agent_loop={rollout.agent_loop!r}: every response would be penalised"
        )
