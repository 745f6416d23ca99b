"""DAPO's overlong shaping (`reward.overlong_buffer`): a soft penalty on responses that run
into the end of their token budget, added to the task reward, with verl's formula
(`verl/workers/reward_manager/dapo.py`):

    expected_len = max_resp_len - buffer_len
    exceed_len = valid_response_length - expected_len
    overlong_reward = min(-exceed_len / buffer_len * penalty_factor, 0)
    reward = score + overlong_reward

`max_resp_len` is the sample's response budget (`asyncrl.config.reward.response_budget`:
`rollout.max_new_tokens`, or the tool agent's `max_response_tokens`) and
`valid_response_length` its response tokens, every one after the prompt (verl counts the
response's attention mask: tool and template tokens of a multi-turn response included).

The penalty is logged apart from the task reward: each shaped sample carries the metrics
`overlong_reward` (the penalty, <= 0), `overlong` (1 when penalised) and `task_reward` (the
reward before it), whose means reach the step record as `traj/<name>`. The shaped reward is
what the learner trains on and what `replay.filter_groups`'s `seq_reward` sees.

Departures from verl:
1. Evaluation samples are scored without the penalty (verl's validation reward manager gets
   the same reward kwargs, so it shapes validation too): an evaluation reports the task's
   score, and pass@k is not moved by the length of a right answer.
2. The budget is per agent loop (the tool agent's response budget, not the single-turn one),
   where verl has one `max_resp_len` for the run; `max_resp_len` sets one here too.
"""

from __future__ import annotations

from asyncrl.config import Config
from asyncrl.config.reward import response_budget
from asyncrl.wire.protocol import PromptItem


def overlong_reward(
    response_len: int, max_resp_len: int, buffer_len: int, penalty_factor: float
) -> float:
    """verl's DAPO overlong penalty (<= 0) of a response of `response_len` tokens."""
    expected_len = max_resp_len - buffer_len
    exceed_len = response_len - expected_len
    return min(-exceed_len / buffer_len * penalty_factor, 0.0)


class OverlongShaping:
    """Adds the overlong penalty to a sample's reward (nothing when the buffer is off)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.buffer = cfg.reward.overlong_buffer

    def shape(
        self, reward: float, response_len: int, prompt: PromptItem
    ) -> tuple[float, dict[str, float]]:
        """(reward with the penalty, the metrics that log it apart) for a response of
        `response_len` tokens to `prompt`, whose agent loop sets the budget. Evaluation
        prompts are not shaped: an evaluation reports the task's own score."""
        if not self.buffer.enable or prompt.eval_job:
            return reward, {}
        loop = prompt.agent_name or self.cfg.rollout.agent_loop
        budget = response_budget(self.cfg.reward, self.cfg.rollout, loop)
        penalty = overlong_reward(response_len, budget, self.buffer.len, self.buffer.penalty_factor)
        metrics = {
            "task_reward": reward,
            "overlong_reward": penalty,
            "overlong": float(penalty < 0),
        }
        return reward + penalty, metrics
