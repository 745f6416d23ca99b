"""The learning-rate schedule, checked against values computed by hand."""

from __future__ import annotations

import math

import pytest

from asyncrl.config import ConfigError, LearnerConfig, load_config
from learner.optim import lr_factor


def test_constant_after_linear_warmup():
    lc = LearnerConfig(warmup_steps=3)
    assert [lr_factor(s, lc, 10) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_no_warmup_is_constant():
    assert {lr_factor(s, LearnerConfig(), 10) for s in range(10)} == {1.0}


def test_cosine_decays_to_min_ratio_at_the_last_step():
    lc = LearnerConfig(lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    total = 12  # decay over steps 2..11
    assert lr_factor(2, lc, total) == pytest.approx(1.0)
    mid = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert lr_factor(2 + 4.5, lc, total) == pytest.approx(mid)
    assert lr_factor(11, lc, total) == pytest.approx(0.1)
    assert lr_factor(50, lc, total) == pytest.approx(0.1)  # past the end: stays at the floor
    factors = [lr_factor(s, lc, total) for s in range(2, 12)]
    assert factors == sorted(factors, reverse=True)


def test_schedule_keys_are_validated():
    with pytest.raises(ConfigError, match="learner.lr_schedule"):
        load_config(None, ["learner.lr_schedule=linear"])
    with pytest.raises(ConfigError, match="learner.min_lr_ratio"):
        load_config(None, ["learner.min_lr_ratio=2"])
