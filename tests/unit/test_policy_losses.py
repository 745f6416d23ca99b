"""Policy losses are declared once (`asyncrl.algorithms.policy_losses.POLICY_LOSSES`): config
validation and the learner's update read that declaration, so a new loss, with fields of its
own, is one `@policy_loss` class."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from asyncrl.algorithms.correction_math import importance_weights
from asyncrl.algorithms.policy_losses import (
    POLICY_LOSSES,
    GSPOLoss,
    PolicyLoss,
    PolicyLossInputs,
    PPOLoss,
    policy_loss,
)
from asyncrl.config import AlgorithmConfig, ConfigError, LearnerConfig, load_config
from learner.update import UpdateInputs, Updater

TOY = "toy_reinforce"


@pytest.fixture
def toy_loss():
    """One declaration: REINFORCE without a ratio, l_t = -scale A_t logp_t, with a field of
    its own (scale) and its own stat."""

    @policy_loss
    class ToyReinforce(PolicyLoss):
        type: Literal["toy_reinforce"] = "toy_reinforce"
        scale: float = 1.0

        def loss(self, x: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            m = (x.mask > 0).to(x.logp.dtype)
            return -self.scale * x.advantages * x.logp * m, {"clipped_tokens": torch.zeros(())}

    yield ToyReinforce
    POLICY_LOSSES.unregister(TOY)


def test_the_builtins_are_declared_and_carry_only_their_own_fields():
    assert POLICY_LOSSES.names() == ["ppo", "gspo"]
    assert POLICY_LOSSES["ppo"] is PPOLoss and POLICY_LOSSES["gspo"] is GSPOLoss
    assert "clip_ratio_c" in PPOLoss.model_fields and "clip_ratio_c" not in GSPOLoss.model_fields
    with pytest.raises(
        ConfigError,
        match="algorithm.policy_loss.clip_ratio_c is not a field of algorithm.policy_loss.type=gspo",
    ):
        load_config(
            None, ["algorithm.policy_loss.type=gspo", "algorithm.policy_loss.clip_ratio_c=2"]
        )


def test_config_validation_accepts_a_declared_loss_and_names_the_declared_ones(toy_loss):
    cfg = load_config(None, [f"algorithm.policy_loss.type={TOY}", "algorithm.policy_loss.scale=2"])
    assert isinstance(cfg.algorithm.policy_loss, toy_loss) and cfg.algorithm.policy_loss.scale == 2
    assert load_config(None, [f"algorithm.policy_loss={TOY}"]).algorithm.policy_loss.scale == 1
    message = (
        f"algorithm.policy_loss='nope' is not a registered policy loss: ['ppo', 'gspo', '{TOY}']"
    )
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, ["algorithm.policy_loss=nope"])


def _updater(**algo) -> Updater:
    config = AlgorithmConfig.model_validate(algo)
    lc = LearnerConfig(micro_batch_size=4)
    return Updater(None, None, config, lc, 1.0, 1, 0, torch.device("cpu"))


def _inputs():
    """Two rows of three tokens, one masked; the proximal policy away from the behaviour."""
    g = torch.Generator().manual_seed(0)
    behaviour = -torch.rand(2, 3, generator=g) - 0.5
    proximal = behaviour + 0.3 * torch.randn(2, 3, generator=g)
    logp = (proximal + 0.1 * torch.randn(2, 3, generator=g)).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    inputs = UpdateInputs(adv, behaviour, proximal, None, None, None, None, None)
    return logp, inputs, mask


def test_the_update_applies_the_declared_loss(toy_loss):
    logp, inputs, mask = _inputs()
    loss = {"type": TOY, "scale": 2.0}
    got, stats = _updater(policy_loss=loss)._policy_loss(logp, torch.arange(2), inputs, mask)
    expected = -2.0 * inputs.advantages * logp * mask  # no ratio, no clip: the toy's own formula
    torch.testing.assert_close(got, expected)
    (grad,) = torch.autograd.grad(got.sum(), logp)
    torch.testing.assert_close(grad, -2.0 * inputs.advantages * mask)
    ppo, _ = _updater(policy_loss="ppo")._policy_loss(logp, torch.arange(2), inputs, mask)
    assert not torch.allclose(got, ppo)
    assert float(stats["clipped_tokens"]) == 0.0


def test_decoupled_weights_a_declared_loss_as_any_other(toy_loss):
    """With correction=decoupled the update hands the loss the proximal log-probs and multiplies in
    the untruncated behaviour -> proximal token weights, whatever the loss."""
    logp, inputs, mask = _inputs()
    updater = _updater(policy_loss=TOY, correction="decoupled")
    got, _ = updater._policy_loss(logp, torch.arange(2), inputs, mask)
    assert inputs.proximal is not None
    w = importance_weights(inputs.proximal, inputs.old_logprobs, mask, "token", None)
    torch.testing.assert_close(got, -inputs.advantages * logp * mask * w)


def test_a_policy_loss_without_its_loss_is_refused_when_built():
    """`PolicyLoss.loss` is abstract: a declared variant that forgot it fails at once, not at the
    first learner step."""

    from asyncrl.algorithms.policy_losses import PolicyLoss

    class Forgot(PolicyLoss):
        type: Literal["forgot"] = "forgot"

    with pytest.raises(TypeError, match="abstract method loss"):
        Forgot()
