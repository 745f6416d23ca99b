"""Policy losses, each declared once: a `PolicyLoss` variant (`asyncrl.algorithms.variants`) with
its `type` (what `algorithm.policy_loss` names), its own fields and its token loss.

`POLICY_LOSSES` is the one registry of policy losses. The learner takes the configured variant
and applies it the same way whatever it is: against the behaviour log-probs, or, with a decoupled
`algorithm.correction`, against the proximal ones with the behaviour -> proximal importance
weights multiplied in (`learner.update`). Adding a loss is one declaration, `@policy_loss` over a
`PolicyLoss` subclass in a user's module (or an entry point in the
`asyncrl.algorithms.policy_losses` group, as `asyncrl.registry` describes), plus its test. No
loss needs more than its class: the off-policy correction, the rejection mask and the loss
aggregation act on any token loss alike.

The built-ins' tensor math is `asyncrl.algorithms.loss_math`'s, imported when a loss is computed
(not at module level), so validating a config imports no torch.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from asyncrl.algorithms.variants import Variant, declare
from asyncrl.registry import Registry

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a policy loss reads; every tensor [b, T] over one micro-batch's target tokens (the
    layout of `asyncrl.algorithms.loss_math`)."""

    logp: torch.Tensor
    """The learner's log-probs of the sampled tokens; the only tensor with a gradient."""
    old_logp: torch.Tensor
    """The log-probs the ratio is taken against: the behaviour policy's (the engine's), or the
    proximal policy's with a decoupled `algorithm.correction`."""
    advantages: torch.Tensor
    mask: torch.Tensor
    """> 0 on tokens that count (sampled, kept by the rejection mask, in a real row)."""


class PolicyLoss(Variant):
    """A policy loss: its fields are its own hyperparameters."""

    @abstractmethod
    def loss(self, x: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(per-token loss [b, T], 0 off the mask and not reduced; stats). Stats are detached
        scalar sums; the learner reads `clipped_tokens` and, when present,
        `dual_clipped_tokens`."""


POLICY_LOSSES: Registry[type[PolicyLoss]] = Registry(
    "policy loss", "asyncrl.algorithms.policy_losses"
)
"""`algorithm.policy_loss` names one of these."""


def policy_loss(cls: type[PolicyLoss]) -> type[PolicyLoss]:
    """Declare the decorated `PolicyLoss` class under its `type` (a later declaration of a name
    replaces the earlier one, so a user may override a built-in)."""
    return declare(POLICY_LOSSES)(cls)


@policy_loss
class PPOLoss(PolicyLoss):
    """PPO's clipped surrogate per token, with dual clip (`asyncrl.algorithms.loss_math.ppo_clip_token_loss`)."""

    type: Literal["ppo"] = "ppo"
    clip_ratio_low: float = Field(0.2, ge=0, le=1)
    """The ratio's lower bound is 1 - this."""
    clip_ratio_high: float = Field(0.2, ge=0)
    """The ratio's upper bound is 1 + this (raise it for clip-higher / DAPO)."""
    clip_ratio_c: float | None = Field(3.0, gt=1.0)
    """Dual-clip bound for negative advantages (None disables it)."""

    def loss(self, x: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from asyncrl.algorithms.loss_math import ppo_clip_token_loss

        return ppo_clip_token_loss(
            x.logp,
            x.old_logp,
            x.advantages,
            x.mask,
            self.clip_ratio_low,
            self.clip_ratio_high,
            self.clip_ratio_c,
        )


@policy_loss
class GSPOLoss(PolicyLoss):
    """GSPO-token: PPO clipping on the length-normalised sequence ratio, no dual clip
    (`asyncrl.algorithms.loss_math.gspo_token_loss`). Clipping acts on whole sequences, so its ranges are
    tiny: the paper uses 3e-4 and 4e-4."""

    type: Literal["gspo"] = "gspo"
    clip_ratio_low: float = Field(0.2, ge=0, le=1)
    """The sequence ratio's lower bound is 1 - this."""
    clip_ratio_high: float = Field(0.2, ge=0)
    """The sequence ratio's upper bound is 1 + this."""

    def loss(self, x: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from asyncrl.algorithms.loss_math import gspo_token_loss

        return gspo_token_loss(
            x.logp, x.old_logp, x.advantages, x.mask, self.clip_ratio_low, self.clip_ratio_high
        )
