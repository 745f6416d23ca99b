import math

import pytest

from asyncrl.evaluation import pass_at_k, summarize


def test_pass_at_k_by_hand():
    # n=4, c=1: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2; pass@4 = 1
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_pass_at_k_matches_sampling_without_replacement():
    # independent formula: probability that k draws without replacement contain a correct one
    n, c, k = 6, 2, 3
    p_all_wrong = math.prod((n - c - i) / (n - i) for i in range(k))
    assert pass_at_k(n, c, k) == pytest.approx(1 - p_all_wrong)


def test_summarize_per_source_and_overall():
    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    groups = ["a", "a", "b", "b", "c", "c"]
    sources = ["s1", "s1", "s1", "s1", "s2", "s2"]
    out = summarize(scores, groups, sources)
    assert out["s1/mean_score"] == pytest.approx(0.25)
    assert out["s1/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert out["s1/pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert out["s2/pass@2"] == 1.0
    assert out["mean_score"] == pytest.approx(0.5)
    assert out["pass@2"] == pytest.approx(2 / 3)
    assert "pass@4" not in out


def test_eval_prompts_carry_the_temperature_or_leave_it_to_the_servers():
    from asyncrl.evaluation import eval_prompts

    rows = [{"data_source": "s", "prompt": "1+1=", "reward_model": {"ground_truth": "2"}}]
    for temperature in (None, 0.0, 0.7):
        (item,) = eval_prompts(rows, 2, temperature, "job")
        assert item.temperature == temperature and item.eval_job == "job" and item.n == 2
        item.validate()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="evaluation temperature"):
            eval_prompts(rows, 2, bad, "job")
