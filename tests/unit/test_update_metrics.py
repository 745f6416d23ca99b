"""The update's metrics are declared once (`learner.update_metrics.UPDATE_METRICS`): a new metric
is one `UpdateMetric`, and its reduction across micro-batches, ranks and mini-batches follows
from the declaration. Values here are computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from learner.update_metrics import (
    UPDATE_METRICS,
    MetricSums,
    MicroStep,
    UpdateMetric,
    combine_mini_batches,
)


def _step(mask, logp, loss_sum=0.0, kl_ref=None) -> MicroStep:
    mask = torch.tensor(mask)
    logp = torch.tensor(logp)
    zeros = torch.zeros_like(logp)
    return MicroStep(
        mask=mask,
        logp=logp,
        behaviour=zeros,
        anchor=zeros,
        entropy=zeros,
        kl_ref=None if kl_ref is None else torch.tensor(kl_ref),
        loss_sum=torch.tensor(loss_sum),
        loss_stats={"clipped_tokens": torch.tensor(1.0)},
    )


# a test metric, one declaration each: the tokens' mean of -logp, and its largest |logp|
NEG_LOGP = UpdateMetric("neg_logp", "token_mean", lambda s: (-s.logp * s.mask).sum())
TOP = UpdateMetric("top", "max", lambda s: (s.logp.abs() * s.mask).max(), across="max")


def test_a_declared_metric_is_reported_with_its_reduction():
    sums = MetricSums((*UPDATE_METRICS, NEG_LOGP, TOP), torch.device("cpu"))
    # two micro-batches; the second has a filler row (weight 0) that counts nothing
    sums.add(_step([[1.0, 1.0]], [[-1.0, -2.0]], loss_sum=3.0))
    sums.add(_step([[1.0, 0.0], [0.0, 0.0]], [[-3.0, -9.0], [-50.0, -50.0]], loss_sum=1.0))
    sums.all_reduce(world=1)
    got = sums.values(tokens=3.0, loss_denominator=2.0)
    assert got["neg_logp"] == pytest.approx((1 + 2 + 3) / 3)  # over the 3 loss tokens
    assert got["top"] == 3.0  # the filler row and the masked token do not count
    assert got["loss"] == pytest.approx((3.0 + 1.0) / 2.0)  # over the loss denominator
    assert got["clip_frac"] == pytest.approx(2 / 3)  # one clipped token per micro-batch
    assert "kl_loss_ref" not in got  # no KL loss in this run: not reported


def test_mini_batches_combine_as_declared():
    metrics = (*UPDATE_METRICS, NEG_LOGP, TOP)
    steps = [
        {"neg_logp": 1.0, "top": 5.0, "mismatch_kl": 0.25, "grad_norm": 2.0},
        {"neg_logp": 2.0, "top": 3.0, "mismatch_kl": 0.75, "grad_norm": 4.0},
    ]
    got = combine_mini_batches(steps, metrics)
    assert got == {"neg_logp": 1.5, "top": 5.0, "mismatch_kl": 0.25, "grad_norm": 3.0}


def test_every_declared_name_is_unique():
    names = [m.name for m in UPDATE_METRICS]
    assert len(names) == len(set(names))


def test_a_max_metric_of_negative_values_reports_the_largest():
    """A maximum starts at -inf: with every value negative it is the largest of them (it
    started at 0 and reported 0)."""
    sums = MetricSums((TOP_LOGP,), torch.device("cpu"))
    sums.add(_step([[1.0, 1.0]], [[-1.0, -2.0]]))
    sums.add(_step([[1.0, 0.0]], [[-3.0, -0.25]]))  # the masked -0.25 does not count
    sums.all_reduce(world=1)
    assert sums.values(tokens=3.0, loss_denominator=3.0) == {"logp_max": -1.0}


def test_a_max_metric_without_data_reports_zero():
    """No value raised the maximum above -inf (every value -inf): it reports 0, as before."""
    sums = MetricSums((TOP_LOGP,), torch.device("cpu"))
    sums.add(_step([[0.0, 0.0]], [[-1.0, -2.0]]))
    sums.all_reduce(world=1)
    assert sums.values(tokens=0.0, loss_denominator=0.0) == {"logp_max": 0.0}


# the largest log-prob of a counted token (-inf elsewhere): a max of negative values
TOP_LOGP = UpdateMetric(
    "logp_max",
    "max",
    lambda s: torch.where(s.mask > 0, s.logp, torch.full_like(s.logp, -math.inf)).max(),
    across="max",
)
