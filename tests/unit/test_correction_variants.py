"""Off-policy corrections are declared once (`asyncrl.algorithms.corrections`): config
validation, the learner's whole-batch stage (`learner.corrections.off_policy_corrections`) and
the update read that declaration, so a new correction, with fields of its own, is one
`@off_policy_correction` class. Values by hand."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import pytest
import torch

from asyncrl.algorithms.corrections import (
    OFF_POLICY_CORRECTIONS,
    OffPolicyCorrection,
    off_policy_correction,
)
from asyncrl.config import ConfigError, LearnerConfig, load_config
from learner.corrections import off_policy_corrections
from learner.update import UpdateInputs, Updater

TOY = "toy_floor"


@pytest.fixture
def toy_correction():
    """One declaration: decoupled, each token weighted by exp(prox - behav) floored at `floor`
    (a made-up correction), with a metric of its own."""

    @off_policy_correction
    class FloorWeights(OffPolicyCorrection):
        type: Literal["toy_floor"] = "toy_floor"
        decoupled: ClassVar[bool] = True
        floor: float = 0.5

        def batch_weights(self, proximal, behaviour, mask, metrics):
            w = torch.exp(proximal - behaviour).clamp(min=self.floor) * mask
            metrics["toy_floor_mean"] = float(w.sum() / mask.sum())
            return w

    yield FloorWeights
    OFF_POLICY_CORRECTIONS.unregister(TOY)


def test_a_declared_correction_is_configured_by_its_own_fields(toy_correction):
    cfg = load_config(None, [f"algorithm.correction.type={TOY}", "algorithm.correction.floor=0.8"])
    algo = cfg.algorithm
    assert isinstance(algo.correction, toy_correction) and algo.correction.floor == 0.8
    assert algo.needs_proximal  # decoupled: the learner recomputes the proximal policy
    with pytest.raises(ConfigError, match="algorithm.correction.level is not a field of"):
        load_config(None, [f"algorithm.correction.type={TOY}", "algorithm.correction.level=token"])
    assert load_config(None, []).algorithm.correction.type == "none"


def test_the_learner_applies_a_declared_correction(toy_correction):
    cfg = load_config(None, [f"algorithm.correction.type={TOY}", "algorithm.correction.floor=0.8"])
    behaviour = torch.tensor([[0.0, 0.0, 0.0]])
    proximal = torch.tensor([[math.log(2.0), math.log(0.5), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    metrics: dict[str, float] = {}
    weights, keep = off_policy_corrections(cfg.algorithm, proximal, behaviour, mask, metrics)
    assert keep is None  # no rejection configured
    assert weights is not None
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.8, 0.0]]))  # 0.5 floored at 0.8
    assert metrics["toy_floor_mean"] == pytest.approx(1.4)
    # the update takes the ratio against the proximal policy and multiplies the weights in
    logp = proximal.clone().requires_grad_(True)  # ratio 1: nothing clipped, loss = -A w
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    inputs = UpdateInputs(adv, behaviour, proximal, weights, None, None, None, None)
    updater = Updater(None, None, cfg.algorithm, LearnerConfig(), 1.0, 1, 0, torch.device("cpu"))
    got, _ = updater._policy_loss(logp, torch.arange(1), inputs, mask)
    torch.testing.assert_close(got.detach(), torch.tensor([[-2.0, 0.8, 0.0]]))


def test_the_kl_variants_build_what_the_learner_uses():
    """kl_in_reward's controller carries its estimator and coefficient; none builds nothing and
    needs no reference model."""
    algo = load_config(
        None,
        [
            "algorithm.kl_in_reward={type: adaptive, coef: 0.2, target: 1.0, horizon: 10}",
            "algorithm.kl_loss={type: reference, coef: 0.05, estimator: k3+}",
        ],
    ).algorithm
    ctl = algo.kl_in_reward.controller()
    assert (ctl.value, ctl.estimator, ctl.target, ctl.horizon) == (0.2, "kl", 1.0, 10.0)
    ctl.update(current_kl=2.0, n_steps=5)  # e = clip(2 / 1 - 1, -0.2, 0.2) = 0.2
    assert ctl.value == pytest.approx(0.2 * (1 + 0.2 * 5 / 10))
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])
    kl, coef = algo.kl_loss.per_token(logp, ref)
    assert coef == 0.05
    torch.testing.assert_close(kl, torch.tensor([[math.exp(-0.5) + 0.5 - 1.0]]))  # k3's value
    assert algo.needs_reference
    default = load_config(None, []).algorithm
    assert (
        default.kl_in_reward.controller() is None and default.kl_loss.per_token(logp, ref) is None
    )
    assert not default.needs_reference and not default.needs_proximal
