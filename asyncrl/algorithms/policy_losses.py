"""Policy losses, each declared once: a name (`algorithm.policy_loss`) and its token-loss function.

`POLICY_LOSSES` is the one registry of policy losses. The learner looks the configured loss up
here and applies it the same way whatever it is: against the behaviour log-probs, or, with
`algorithm.decoupled`, against the proximal ones with the behaviour -> proximal importance
weights multiplied in (`learner.update`). Config validation reads the registered names, so
adding a loss is one declaration, `@policy_loss("name")` over a function in a user's module (or
an entry point in the `asyncrl.algorithms.policy_losses` group, as `asyncrl.registry` describes), plus
its test. No loss needs more than its function declared: the off-policy correction, the
rejection mask and the loss aggregation act on any token loss alike.

This module does not import torch: the built-ins name their functions by import path (the
tensor math is in `learner.losses`, imported by the learner's process on first use), so
validating a config, which every process and the launcher do first, costs no torch import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.registry import Registry

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a policy loss may read; every tensor [b, T] over one micro-batch's target tokens
    (the layout of `learner.losses`)."""

    logp: torch.Tensor
    """The learner's log-probs of the sampled tokens; the only tensor with a gradient."""
    old_logp: torch.Tensor
    """The log-probs the ratio is taken against: the behaviour policy's (the engine's), or the
    proximal policy's with `algorithm.decoupled`."""
    advantages: torch.Tensor
    mask: torch.Tensor
    """> 0 on tokens that count (sampled, kept by the rejection mask, in a real row)."""
    clip_low: float
    """`algorithm.clip_ratio_low`: the ratio's lower bound is 1 - this."""
    clip_high: float
    """`algorithm.clip_ratio_high`: the ratio's upper bound is 1 + this."""
    clip_c: float | None
    """`algorithm.clip_ratio_c`: dual-clip bound for negative advantages (None: off)."""


PolicyLossFn = Callable[[PolicyLossInputs], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
"""-> (per-token loss [b, T], 0 off the mask and not reduced; stats). Stats are detached scalar
sums; the learner reads `clipped_tokens` and, when present, `dual_clipped_tokens`."""

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "asyncrl.algorithms.policy_losses")
"""`algorithm.policy_loss` names one of these."""


def policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Declare the decorated function as the policy loss `name` (a later declaration of a name
    replaces the earlier one, so a user may override a built-in)."""
    return POLICY_LOSSES.register(name)


POLICY_LOSSES.register("ppo", "learner.losses:ppo_policy_loss")
POLICY_LOSSES.register("gspo", "learner.losses:gspo_policy_loss")
