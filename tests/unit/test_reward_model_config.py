"""`reward.model` refuses a judge that could not work (a template without the response, a
regex without a group), and a RunSpec carries the reward-model servers' addresses through its
JSON file as the tuple it was written with."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.config.reward import RewardModelConfig
from asyncrl.run_spec import RunSpec


def test_the_judge_template_must_show_the_response():
    with pytest.raises(ValidationError, match=r"must contain \{response\}"):
        RewardModelConfig(template="Rate {prompt}")
    assert RewardModelConfig(template="Rate {response} for {prompt}").template


@pytest.mark.parametrize(("regex", "why"), [("Score: \\d+", "needs a group"), ("(", "compile")])
def test_the_score_regex_must_compile_with_a_group(regex, why):
    with pytest.raises(ValidationError, match=why):
        RewardModelConfig(score_regex=regex)


def test_a_run_spec_keeps_the_reward_model_addresses(tmp_path):
    fields = dict(
        run_dir=str(tmp_path),
        model_path="m",
        replay_address="tcp://127.0.0.1:1",
        sync_host="127.0.0.1",
        sync_port=0,
        learner_master_port=2,
        threads=1,
    )
    spec = RunSpec(**fields, reward_model_addresses=("tcp://127.0.0.1:3", "tcp://127.0.0.1:4"))
    spec.save(tmp_path / "launch.json")
    assert RunSpec.load(tmp_path / "launch.json") == spec
    RunSpec(**fields).save(tmp_path / "old.json")
    assert RunSpec.load(tmp_path / "old.json").reward_model_addresses == ()
