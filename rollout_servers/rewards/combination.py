"""`CombinedReward`: the rule reward and the reward model's score of one response, combined as
the config says:

    reward = reward.rule_weight * rule + reward.model_weight * model

or, with `reward.combine.path`, a user's `combine(rule_score, model_score, data_source,
extra_info) -> float` (loaded at start-up, like a custom reward function).

Both scores run at once: the rule in the reward workers (`RewardComputer`), the model on the
reward-model fleet (`RewardModelClient`). With `rule_weight=0` and no combine function the
rule still runs where the row's data source has one, and is logged (`reward_rule`) but never
enters the reward: what the task's verifier thinks of a policy trained on the model's
judgement is the honest measure of a reward model. Each trajectory logs `reward_model` and,
when the model gave no score (a timeout, a judge's answer without one), `reward_model_failed`.
A combine function that raises or returns no finite number scores 0.0 and is counted
(`combine_errors`), as a reward function's failure is.

Evaluation prompts (`asyncrl eval`, `trainer.val_every`) are scored by the rule alone where
the data source has one, as verl validates on rule rewards only: an evaluation reports the
task's own score. Where it has none, the model's score is all there is.
"""

from __future__ import annotations

import asyncio
import logging
import numbers
from collections import Counter
from typing import Any

from asyncrl.config import RewardConfig
from asyncrl.wire.bounds import plausible_reward
from asyncrl.wire.protocol import PromptItem
from asyncrl.wire.reward_protocol import ScoreItem
from rollout_servers.rewards.computer import RewardComputer
from rollout_servers.rewards.functions import REWARD_FNS, load_custom_reward
from rollout_servers.rewards.model_client import RewardModelClient

log = logging.getLogger("asyncrl.rewards")


class CombinedReward:
    def __init__(self, cfg: RewardConfig, rules: RewardComputer, model: RewardModelClient):
        self.rules, self.model = rules, model
        self.rule_weight, self.model_weight = cfg.rule_weight, cfg.model_weight
        self._combine = (
            load_custom_reward(cfg.combine.path, cfg.combine.name) if cfg.combine.path else None
        )
        self._custom_rule = cfg.custom.path is not None  # it scores every data source
        self._rules_always = bool(cfg.rule_weight or self._combine or self._custom_rule)
        self.counters: Counter[str] = Counter()

    async def score(self, prompt: PromptItem, text: str) -> tuple[float, dict[str, float]]:
        """(reward, extra metrics) of one response (see the module docstring)."""
        item = ScoreItem(list(prompt.messages), text, prompt.data_source, prompt.ground_truth)
        has_rule = bool(self._custom_rule) or prompt.data_source in REWARD_FNS
        if prompt.eval_job and has_rule:  # the task's own score
            return await self.rules.score(
                prompt.data_source, text, prompt.ground_truth, prompt.extra_info
            )
        if self._rules_always or has_rule:
            (rule, extras), (model, error) = await asyncio.gather(
                self.rules.score(prompt.data_source, text, prompt.ground_truth, prompt.extra_info),
                self.model.score(item),
            )
            extras = {**extras, "reward_rule": rule}
        else:  # no rule for this data source, and none wanted: the model alone
            rule, extras = 0.0, {}
            model, error = await self.model.score(item)
        extras["reward_model"] = model
        if error:
            extras["reward_model_failed"] = 1.0
        return self._combined(rule, model, prompt), extras

    def _combined(self, rule: float, model: float, prompt: PromptItem) -> float:
        if self._combine is None:
            return self.rule_weight * rule + self.model_weight * model
        try:
            value: Any = self._combine(rule, model, prompt.data_source, prompt.extra_info)
        except Exception as e:
            return self._failed(f"reward.combine raised {type(e).__name__}: {e}")
        if not isinstance(value, numbers.Real) or not plausible_reward(float(value)):
            return self._failed(f"reward.combine returned {value!r}, not a finite number")
        return float(value)

    def _failed(self, why: str) -> float:
        self.counters["combine_errors"] += 1
        n = self.counters["combine_errors"]
        if n & (n - 1) == 0:  # 1st, 2nd, 4th, ...: visible without flooding the log
            log.warning("reward combine error (%d so far), scored 0: %s", n, why)
        return 0.0

    def stats(self) -> dict[str, float]:
        """Counters for the server's exit stats: the client's (`reward_model_*`) and ours."""
        return {
            **{f"reward_model_{k}": v for k, v in self.model.counters.items()},
            **self.counters,
        }
