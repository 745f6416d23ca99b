"""A new update metric takes one declaration: added to `learner.update_metrics.UPDATE_METRICS`, it
reaches `Updater.run`'s output, reduced as declared; the critic's metrics
(`learner.update_metrics.CRITIC_METRICS`) are declared the same way. The forward passes are
fakes that return fixed log-probs and values, so every value here is computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

import learner.update
from asyncrl.config import AlgorithmConfig, LearnerConfig
from learner.batch import TrainBatch
from learner.update import UpdateInputs, Updater
from learner.update_metrics import UPDATE_METRICS, UpdateMetric

CPU = torch.device("cpu")
LOGP = torch.tensor([[-1.0, -2.0], [-3.0, -0.5]])
VALUES = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
RETURNS = torch.zeros(2, 2)

NEG_LOGP = UpdateMetric("neg_logp", "token_mean", lambda s: (-s.logp * s.mask).sum())
LOGP_MAX = UpdateMetric(
    "logp_max",
    "max",
    lambda s: torch.where(s.mask > 0, s.logp, torch.full_like(s.logp, -math.inf)).max(),
    across="max",
)


class _Scalar(torch.nn.Module):
    """A model whose only weight shifts the fixed outputs (0: they are unchanged)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))


def _batch() -> TrainBatch:
    rows = torch.arange(2)
    ones = torch.ones(2, 3)
    return TrainBatch(
        input_ids=torch.tensor([[1, 2, 3], [1, 4, 5]]),
        attention_mask=ones.long(),
        loss_mask=torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]),
        old_logprobs=torch.zeros(2, 3),
        versions=torch.zeros(2, 3, dtype=torch.long),
        rewards=rows.float(),  # the row's index: what the fake forwards look up
        group_index=torch.zeros(2, dtype=torch.long),
        baseline_rewards=torch.full((2,), math.nan),
        prompt_lengths=torch.ones(2, dtype=torch.long),
    )


def _run(monkeypatch) -> dict[str, float]:
    def policy_forward(model, mb, temperature, grad, layout, with_entropy):
        logp = LOGP[mb.rewards.long()] + model.w
        return logp, torch.zeros_like(logp)

    def value_forward(critic, mb, layout):
        return VALUES[mb.rewards.long()] + critic.w

    monkeypatch.setattr(learner.update, "policy_forward", policy_forward)
    monkeypatch.setattr(learner.update, "value_forward", value_forward)
    # the one declaration each new metric takes
    monkeypatch.setattr(learner.update, "UPDATE_METRICS", (*UPDATE_METRICS, NEG_LOGP, LOGP_MAX))
    model, critic = _Scalar(), _Scalar()
    updater = Updater(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        AlgorithmConfig(),
        LearnerConfig(packing=False),
        1.0,
        1,
        0,
        CPU,
        critic,
        torch.optim.SGD(critic.parameters(), lr=0.0),
    )
    inputs = UpdateInputs(torch.zeros(2, 2), LOGP, None, None, None, None, RETURNS, VALUES)
    return updater.run(_batch(), inputs, epochs=1, groups_per_mini=0)


def test_a_declared_metric_reaches_the_update_output(monkeypatch):
    got = _run(monkeypatch)
    assert got["neg_logp"] == pytest.approx((1.0 + 2.0 + 3.0 + 0.5) / 4)  # over 4 loss tokens
    assert got["logp_max"] == -0.5  # a max of negative values (not a floor of 0)
    assert got["ratio_mean"] == pytest.approx(1.0)  # the built-ins alongside
    assert got["mismatch_kl"] == pytest.approx(0.0)


def test_the_critic_metrics_are_declared_and_reported(monkeypatch):
    got = _run(monkeypatch)
    # V = V_old, so clipping changes nothing: l = 0.5 (V - R)^2 = 0.5, 2, 4.5, 8
    assert got["value_loss"] == pytest.approx((0.5 + 2.0 + 4.5 + 8.0) / 4)
    assert got["value_clip_frac"] == 0.0
    assert got["value_mean"] == pytest.approx((1.0 + 2.0 + 3.0 + 4.0) / 4)
    assert "critic_grad_norm" in got
