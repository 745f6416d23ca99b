"""KL terms against the frozen reference policy, each declared once as a variant
(`asyncrl.algorithms.variants`): `algorithm.kl_in_reward` names a `KLInReward` (a penalty
subtracted from the per-token reward, with a fixed or adaptive coefficient), `algorithm.kl_loss`
a `KLLoss` (a term added to the loss, GRPO style).

The learner builds the frozen reference policy when either needs it (`needs_reference`) and calls
the variant; the estimators and controllers are `asyncrl.algorithms.kl_math`'s, imported when they
are used (no torch import to validate a config). Adding a variant is one declaration (`@kl_in_reward` /
`@kl_loss` over a class) plus its test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

from pydantic import Field

from asyncrl.algorithms.variants import Variant, declare
from asyncrl.registry import Registry

if TYPE_CHECKING:
    import torch

KLKind = Literal[
    "kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+"
]
"""The per-token estimators of `asyncrl.algorithms.kl_math.kl_penalty`."""


class KLController(Protocol):
    """What the learner reads and steers of the in-reward coefficient (`KLInReward.controller`;
    the built-ins are `asyncrl.algorithms.kl_math`'s)."""

    value: float
    """The coefficient now (a checkpoint stores it: `learner.trainer.restored_kl_coef`)."""
    estimator: str
    """The `asyncrl.algorithms.kl_math.kl_penalty` kind the penalty uses."""

    def update(self, current_kl: float, n_steps: int) -> None:
        """Steer `value` after a step whose mean sequence KL was `current_kl` over `n_steps`
        sequences."""
        ...


class KLInReward(Variant):
    """A KL penalty in the per-token reward (module docstring)."""

    needs_reference: ClassVar[bool] = False
    stateful: ClassVar[bool] = False
    """The coefficient changes during training, so it is state that a resumed run restores
    from the checkpoint (`adaptive`); otherwise the configured `coef` is the coefficient."""

    def controller(self) -> KLController | None:
        """The coefficient's controller, or None: no penalty."""
        return None


KL_IN_REWARD: Registry[type[KLInReward]] = Registry(
    "KL in the reward", "asyncrl.algorithms.kl_in_reward"
)
"""`algorithm.kl_in_reward` names one of these."""


def kl_in_reward(cls: type[KLInReward]) -> type[KLInReward]:
    """Declare the decorated `KLInReward` class under its `type`."""
    return declare(KL_IN_REWARD)(cls)


@kl_in_reward
class NoKLInReward(KLInReward):
    """No KL in the reward."""

    type: Literal["none"] = "none"


@kl_in_reward
class FixedKLInReward(KLInReward):
    """reward_t -= coef x KL_t(policy || reference), a constant coefficient."""

    type: Literal["fixed"] = "fixed"
    needs_reference: ClassVar[bool] = True
    coef: float = Field(0.001, ge=0)
    """The coefficient of the in-reward KL."""
    estimator: KLKind = "kl"
    """Estimator of the in-reward KL (`asyncrl.algorithms.kl_math.kl_penalty`)."""

    def controller(self) -> KLController | None:
        from asyncrl.algorithms.kl_math import FixedKLController

        return FixedKLController(self.coef, self.estimator)


@kl_in_reward
class AdaptiveKLInReward(KLInReward):
    """reward_t -= coef x KL_t(policy || reference), the coefficient steered towards `target`
    by the adaptive controller of Ziegler et al. (2019)."""

    type: Literal["adaptive"] = "adaptive"
    needs_reference: ClassVar[bool] = True
    stateful: ClassVar[bool] = True
    coef: float = Field(0.001, ge=0)
    """The initial coefficient of the in-reward KL."""
    estimator: KLKind = "kl"
    """Estimator of the in-reward KL (`asyncrl.algorithms.kl_math.kl_penalty`)."""
    target: float = Field(0.1, gt=0)
    """Target KL."""
    horizon: int = Field(10000, ge=1)
    """Horizon of the controller."""

    def controller(self) -> KLController | None:
        from asyncrl.algorithms.kl_math import AdaptiveKLController

        return AdaptiveKLController(self.coef, self.target, self.horizon, self.estimator)


class KLLoss(Variant):
    """A KL term in the loss (module docstring)."""

    needs_reference: ClassVar[bool] = False

    def per_token(
        self, logp: torch.Tensor, ref_logp: torch.Tensor
    ) -> tuple[torch.Tensor, float] | None:
        """(per-token KL [b, T], not masked, with a gradient through `logp`; its coefficient),
        or None: no KL loss."""
        return None


KL_LOSSES: Registry[type[KLLoss]] = Registry("KL loss", "asyncrl.algorithms.kl_losses")
"""`algorithm.kl_loss` names one of these."""


def kl_loss(cls: type[KLLoss]) -> type[KLLoss]:
    """Declare the decorated `KLLoss` class under its `type`."""
    return declare(KL_LOSSES)(cls)


@kl_loss
class NoKLLoss(KLLoss):
    """No KL term in the loss."""

    type: Literal["none"] = "none"


@kl_loss
class ReferenceKLLoss(KLLoss):
    """loss += coef x KL(policy || reference), aggregated as the policy loss (GRPO style)."""

    type: Literal["reference"] = "reference"
    needs_reference: ClassVar[bool] = True
    coef: float = Field(0.001, ge=0)
    """Coefficient of the KL loss."""
    estimator: KLKind = "low_var_kl"
    """Estimator of the KL loss (`asyncrl.algorithms.kl_math.kl_penalty`)."""

    def per_token(self, logp, ref_logp):
        from asyncrl.algorithms.kl_math import kl_penalty

        return kl_penalty(logp, ref_logp, self.estimator), self.coef
