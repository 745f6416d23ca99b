"""How a rollout server combines the rule reward with the reward model's score
(`rollout_servers.rewards.combination.CombinedReward`), with fakes for both scorers: the
weighted sum (values by hand), a user's combine function, its failures scored 0 and counted,
the rule logged but left out at rule_weight=0, and skipped where the data source has none."""

from __future__ import annotations

from collections import Counter

import pytest

from asyncrl.config import Config
from asyncrl.wire.protocol import ChatMessage, PromptItem
from asyncrl.wire.reward_protocol import ScoreItem
from rollout_servers.rewards.combination import CombinedReward


class FakeRules:
    def __init__(self, score: float) -> None:
        self.score_value, self.calls = score, 0

    async def score(self, data_source, solution_str, ground_truth, extra_info):
        self.calls += 1
        return self.score_value, {"format": 1.0}


class FakeModel:
    def __init__(self, score: float, error: str = "") -> None:
        self.result, self.items = (score, error), []
        self.counters: Counter[str] = Counter({"requests": 3})

    async def score(self, item: ScoreItem):
        self.items.append(item)
        return self.result


def _prompt(data_source: str = "openai/gsm8k", eval_job: str = "") -> PromptItem:
    messages = [ChatMessage("user", "2+2?")]
    return PromptItem("g1", 1, data_source, messages, "4", {"k": 1}, eval_job=eval_job)


def _combined(rule: float, model: float, error: str = "", **reward) -> tuple:
    cfg = Config.model_validate({"reward": {"model": {"path": "/rm"}, **reward}}).reward
    rules, fake_model = FakeRules(rule), FakeModel(model, error)
    return CombinedReward(cfg, rules, fake_model), rules, fake_model  # type: ignore[arg-type]


async def test_the_weighted_sum_and_what_each_trajectory_logs():
    combined, _, model = _combined(1.0, 0.25, rule_weight=0.5, model_weight=2.0)
    reward, extras = await combined.score(_prompt(), "the answer is 4")
    assert reward == pytest.approx(0.5 * 1.0 + 2.0 * 0.25)
    assert extras == {"format": 1.0, "reward_rule": 1.0, "reward_model": 0.25}
    (item,) = model.items
    assert (item.response, item.ground_truth, item.data_source) == (
        "the answer is 4",
        "4",
        "openai/gsm8k",
    )
    assert item.messages[0].content == "2+2?"
    assert combined.stats() == {"reward_model_requests": 3}


async def test_a_model_that_gave_no_score_is_marked_on_the_trajectory():
    combined, _, _ = _combined(1.0, 0.0, error="timeout")
    reward, extras = await combined.score(_prompt(), "4")
    assert reward == 1.0 and extras["reward_model_failed"] == 1.0


async def test_rule_weight_0_logs_the_rule_but_trains_on_the_model_alone():
    combined, rules, _ = _combined(1.0, 0.3, rule_weight=0.0)
    reward, extras = await combined.score(_prompt(), "4")
    assert reward == pytest.approx(0.3) and extras["reward_rule"] == 1.0 and rules.calls == 1


async def test_without_a_rule_for_the_data_source_and_none_wanted_the_rule_is_not_run():
    combined, rules, _ = _combined(1.0, 0.3, rule_weight=0.0)
    reward, extras = await combined.score(_prompt("my/unruled_source"), "4")
    assert reward == pytest.approx(0.3) and "reward_rule" not in extras and rules.calls == 0


def _combine_file(tmp_path, body: str) -> str:
    path = tmp_path / "combine.py"
    path.write_text(f"def combine(rule_score, model_score, data_source, extra_info):\n{body}\n")
    return str(path)


async def test_a_users_combine_function_gets_both_scores_and_the_row(tmp_path):
    body = "    return rule_score * 10 + model_score + extra_info['k']"
    combined, _, _ = _combined(1.0, 0.5, combine={"path": _combine_file(tmp_path, body)})
    reward, _ = await combined.score(_prompt(), "4")
    assert reward == pytest.approx(11.5)


@pytest.mark.parametrize(
    "body", ["    raise ValueError('boom')", "    return 'high'", "    return float('nan')"]
)
async def test_a_combine_function_that_fails_scores_0_and_is_counted(tmp_path, body):
    combined, _, _ = _combined(1.0, 0.5, combine={"path": _combine_file(tmp_path, body)})
    reward, extras = await combined.score(_prompt(), "4")
    assert reward == 0.0 and extras["reward_model"] == 0.5
    assert combined.stats()["combine_errors"] == 1


def test_a_missing_combine_file_fails_at_start_up(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _combined(1.0, 0.5, combine={"path": str(tmp_path / "nope.py")})


def test_the_shipped_probability_combine_squashes_the_logit_without_overflow():
    from asyncrl.config import CONFIG_DIR
    from rollout_servers.rewards.functions import load_custom_reward

    combine = load_custom_reward(CONFIG_DIR / "rewards" / "model_probability.py", "combine")
    assert combine(1.0, 0.0, "s", {}) == 0.5
    assert combine(1.0, 2.0, "s", {}) == pytest.approx(0.8808, abs=1e-4)
    assert combine(0.0, 1000.0, "s", {}) == 1.0 and combine(0.0, -1000.0, "s", {}) == 0.0


async def test_an_evaluation_reports_the_rule_where_there_is_one_else_the_model():
    """As verl validates on rule rewards only: the task's own score, the model not asked."""
    combined, _, model = _combined(1.0, 0.3, rule_weight=0.0)
    assert await combined.score(_prompt(eval_job="job1"), "4") == (1.0, {"format": 1.0})
    assert model.items == []
    reward, extras = await combined.score(_prompt("my/unruled_source", eval_job="job1"), "4")
    assert reward == pytest.approx(0.3) and extras == {"reward_model": 0.3}
