"""The reward config section (`reward`): the reward function, its workers, DAPO's overlong
shaping (`reward.overlong_buffer`, see `rollout_servers.rewards.overlong`), and a reward model served
by a fleet of its own (`reward.model`, `reward.num_servers`: `reward_models/`) with how its
score combines with the rule reward.

Part of the tree `asyncrl.config` assembles (and re-exports); kept apart so each file reads
as one thing.
"""

from __future__ import annotations

import re
from typing import Literal

import pydantic
from pydantic import Field

from asyncrl.config.base import Section
from asyncrl.config.rollout import RolloutConfig


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


class CombineConfig(Section):
    path: str | None = None
    """Python file with `combine(rule_score, model_score, data_source, extra_info)` -> float,
    which replaces the weighted sum of the rule reward and the reward model's score."""
    name: str = "combine"
    """Name of the function in that file."""


DEFAULT_JUDGE_TEMPLATE = (
    "Rate the answer to the question below from 0 (wrong) to 10 (correct and clear).\n\n"
    "Question: {prompt}\n\nAnswer: {response}\n\n"
    "Reply with one line: 'Score: N'."
)


class RewardModelConfig(Section):
    """A reward model served by `reward.num_servers` processes of its own (`reward_models/`).
    A rollout server sends each response it finished to one of them and combines the model's
    score with the rule reward (`reward.rule_weight`, `reward.model_weight`, or
    `reward.combine`)."""

    path: str | None = None
    """Hugging Face model directory; None: no reward model (rule rewards only)."""
    kind: Literal["classifier", "judge"] = "classifier"
    """classifier: a sequence-classification model with one label, whose logit is the score.
    judge: a chat model that answers `template`; `score_regex` finds the score in its answer."""
    template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's user message; `{prompt}` (the prompt's last user message), `{response}`,
    `{ground_truth}` and `{data_source}` are filled in."""
    answer_prefix: str = "Score:"
    """The start of the judge's answer, written for it after the generation prompt: a small
    chat model then continues with a number instead of a sentence. `score_regex` is matched
    against this prefix followed by what the judge generated ("" : the judge starts alone)."""
    score_regex: str = r"Score:\s*(-?\d+(?:\.\d+)?)"
    """The judge's score: the first group of the first match in its answer (no match: an
    error, scored 0 and counted)."""
    score_scale: float = 0.1
    """The judge's parsed number times this is its score (0-10 -> 0-1 by default)."""
    max_new_tokens: int = Field(32, ge=1, le=4096)
    """The judge's answer budget (greedy)."""
    max_length: int = Field(1024, ge=16)
    """Tokens of one scored text at most; a longer one keeps its end (the response)."""
    max_batch: int = Field(32, ge=1, le=1024)
    """Items in one forward pass of the reward-model server."""
    timeout_s: float = Field(60.0, gt=0)
    """A response not scored this long after it was sent (a hung or dead reward-model server,
    resent meanwhile) scores 0 and is counted (`reward_model_timeout`)."""
    resend_s: float = Field(10.0, gt=0)
    """A request not answered this long (or 3 x the slowest recent reply, if longer: a slow
    model is not a dead one) is sent again, to the next reward-model server."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the reward model runs; auto: the GPU the launcher gave its process, else CPU."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The reward model's dtype."""
    gpu_memory_fraction: float = Field(0.1, gt=0.0, le=1.0)
    """Each reward-model server's share of its GPU's memory (`asyncrl.placement`, rule 5),
    enforced with `torch.cuda.set_per_process_memory_fraction` on a GPU of its own too, so it
    needs the same room on one GPU as on eight; on a learner rank's GPU the rank gets what the
    servers and reward models leave."""

    @pydantic.field_validator("template")
    @classmethod
    def _template_shows_the_response(cls, template: str) -> str:
        """A judge that never sees the response would score every response alike."""
        if "{response}" not in template:
            raise ValueError("reward.model.template must contain {response}")
        return template

    @pydantic.field_validator("score_regex")
    @classmethod
    def _regex_has_a_group(cls, regex: str) -> str:
        """The score is the first group of the first match: a regex without one finds none."""
        try:
            groups = re.compile(regex).groups
        except re.error as e:
            raise ValueError(f"reward.model.score_regex does not compile: {e}") from None
        if groups < 1:
            raise ValueError("reward.model.score_regex needs a group: the score is its first")
        return regex


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
    model: RewardModelConfig = RewardModelConfig()
    """A reward model served beside the fleet (off unless `reward.model.path` is set)."""
    num_servers: int = Field(1, ge=1, le=64)
    """Reward-model server processes (with `reward.model.path`)."""
    rule_weight: float = 1.0
    """With a reward model: reward = rule_weight * rule score + model_weight * model score."""
    model_weight: float = 1.0
    """See `rule_weight`."""
    combine: CombineConfig = CombineConfig()
    """A user's function that combines the two scores instead of the weighted sum."""


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


def scored_by_the_model_alone(reward: RewardConfig) -> bool:
    """Whether the reward model's score is all a sample's reward is made of (a reward model,
    `rule_weight=0`, no combine function): then a data source needs no rule reward."""
    return reward.model.path is not None and reward.rule_weight == 0 and not reward.combine.path
