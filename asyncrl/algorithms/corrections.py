"""Off-policy corrections and rejection masks, each declared once as a variant
(`asyncrl.algorithms.variants`): `algorithm.correction` names an `OffPolicyCorrection`,
`algorithm.rejection` a `Rejection`.

A correction says what the ratio of the policy loss is taken against and how the token losses
are weighted:
- `none`: against the behaviour log-probs (the engine's), as verl's bypass mode; no weights.
  The default: in the staleness study (docs/off_policy.md, tiny task, two seeds) no correction
  ended above plain PPO clipped against the behaviour policy, at any staleness.
- `decoupled`: decoupled PPO (AReaL): against a proximal policy the learner recomputes before
  the update, each token's loss weighted by its untruncated behaviour -> proximal weight.
- `truncated_is`: decoupled, with truncated importance weights per token or per sequence,
  optionally normalised over the batch (verl's rollout_is).

A rejection drops tokens or whole sequences whose behaviour-vs-proximal divergence is out of
bounds (verl's rollout_rs): `none`, `token` or `sequence`.

Adding either is one declaration (`@off_policy_correction` / `@rejection` over a class) plus its
test; the learner recomputes the proximal log-probs when a variant says it needs them and calls
its methods on the whole batch (`learner.corrections.off_policy_corrections`). The tensor math is
`asyncrl.algorithms.correction_math`'s, imported when it runs (no torch import to validate a
config).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import pydantic
from pydantic import Field

from asyncrl.algorithms.rejection_rules import rejection_problem
from asyncrl.algorithms.variants import Variant, declare
from asyncrl.registry import Registry

if TYPE_CHECKING:
    import torch


class OffPolicyCorrection(Variant):
    """What the ratio is taken against and how token losses are weighted (module docstring)."""

    decoupled: ClassVar[bool] = False
    """The ratio is taken against the proximal policy (recomputed before the update) and each
    token's loss is weighted behaviour -> proximal: by `batch_weights`, or, when that gives
    None, by the untruncated token weight (`asyncrl.algorithms.correction_math.behaviour_weighted`)."""

    @property
    def needs_proximal(self) -> bool:
        return self.decoupled

    def batch_weights(
        self,
        proximal: torch.Tensor,
        behaviour: torch.Tensor,
        mask: torch.Tensor,
        metrics: dict[str, float],
    ) -> torch.Tensor | None:
        """Importance weights over the WHOLE batch [B, T] (every rank alike), their metrics
        added to `metrics`; None: none of this variant's own."""
        return None


OFF_POLICY_CORRECTIONS: Registry[type[OffPolicyCorrection]] = Registry(
    "off-policy correction", "asyncrl.algorithms.corrections"
)
"""`algorithm.correction` names one of these."""


def off_policy_correction(cls: type[OffPolicyCorrection]) -> type[OffPolicyCorrection]:
    """Declare the decorated `OffPolicyCorrection` class under its `type`."""
    return declare(OFF_POLICY_CORRECTIONS)(cls)


@off_policy_correction
class NoCorrection(OffPolicyCorrection):
    """PPO clipped against the behaviour policy (verl's bypass mode)."""

    type: Literal["none"] = "none"


@off_policy_correction
class DecoupledCorrection(OffPolicyCorrection):
    """Decoupled PPO (AReaL): clip around the proximal policy, weight each token's loss by its
    untruncated behaviour -> proximal weight."""

    type: Literal["decoupled"] = "decoupled"
    decoupled: ClassVar[bool] = True


@off_policy_correction
class TruncatedIS(OffPolicyCorrection):
    """Decoupled PPO with truncated importance weights behaviour -> proximal (verl's
    rollout_is, TIS)."""

    type: Literal["truncated_is"] = "truncated_is"
    decoupled: ClassVar[bool] = True
    level: Literal["token", "sequence"] = "token"
    """One weight per token, or one per sequence (the product of its token ratios)."""
    cap: float | None = Field(2.0, gt=0)
    """Truncate the weights at this (None: no truncation)."""
    batch_normalize: bool = False
    """Divide the (truncated) weights by their mean over the whole batch, per token or per
    sequence as `level` says, so they average 1 (verl's rollout_is_batch_normalize)."""

    def batch_weights(self, proximal, behaviour, mask, metrics):
        from asyncrl.algorithms.correction_math import truncated_weights

        return truncated_weights(
            proximal, behaviour, mask, self.level, self.cap, self.batch_normalize, metrics
        )


class Rejection(Variant):
    """A rejection mask on behaviour-vs-proximal divergence (module docstring)."""

    @property
    def needs_proximal(self) -> bool:
        return True

    def keep_mask(
        self,
        proximal: torch.Tensor,
        behaviour: torch.Tensor,
        mask: torch.Tensor,
        metrics: dict[str, float],
    ) -> torch.Tensor | None:
        """[B, T], 1 on the sampled tokens kept, over the WHOLE batch (every rank alike), its
        metrics added to `metrics`; None: nothing rejected."""
        return None


REJECTIONS: Registry[type[Rejection]] = Registry("rejection", "asyncrl.algorithms.rejections")
"""`algorithm.rejection` names one of these."""


def rejection(cls: type[Rejection]) -> type[Rejection]:
    """Declare the decorated `Rejection` class under its `type`."""
    return declare(REJECTIONS)(cls)


@rejection
class NoRejection(Rejection):
    """Every sampled token counts."""

    type: Literal["none"] = "none"

    @property
    def needs_proximal(self) -> bool:
        return False


class _Bounds(Rejection):
    metric: Literal["ratio", "k1", "k2", "k3"] = "ratio"
    """Quantity the bounds apply to, per token: ratio = r, k1 = -log r, k2 = 0.5 (log r)^2,
    k3 = (r - 1) - log r, with r = p_proximal / p_behaviour."""
    low: float | None = None
    """Reject when the metric is below this."""
    high: float | None = None
    """Reject when the metric is above this."""

    @pydantic.model_validator(mode="after")
    def _meaningful(self) -> _Bounds:
        """Refuse at config load what would only fail at the first step or reject nothing: an
        aggregation that means nothing (`rejection_problem`), no bound at all (a proximal
        forward for nothing), a ratio bound <= 0 (ratios are positive, compared in log space),
        low > high (every token rejected)."""
        if (why := self._combination_problem()) is not None:
            raise ValueError(why)
        if self.low is None and self.high is None:
            raise ValueError(
                "needs low or high (or both): with neither it rejects nothing and still pays "
                "for a proximal forward (use type=none)"
            )
        for name in ("low", "high"):
            bound = getattr(self, name)
            if self.metric == "ratio" and bound is not None and bound <= 0:
                raise ValueError(f"{name}={bound}: a ratio bound must be > 0 (metric=ratio)")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low={self.low} > high={self.high}: it would reject every token")
        return self

    def _combination_problem(self) -> str | None:
        """Why this level, metric and aggregation mean nothing together (None: they do)."""
        return None

    def _keep(
        self,
        level: Literal["token", "sequence"],
        agg: Literal["mean", "sum", "max"],
        proximal,
        behaviour,
        mask,
        metrics,
    ):
        from asyncrl.algorithms.correction_math import rejection_keep

        return rejection_keep(
            proximal, behaviour, mask, level, self.metric, self.low, self.high, agg, metrics
        )


@rejection
class TokenRejection(_Bounds):
    """Drop the sampled tokens whose metric is out of bounds."""

    type: Literal["token"] = "token"

    def keep_mask(self, proximal, behaviour, mask, metrics):
        return self._keep("token", "mean", proximal, behaviour, mask, metrics)


@rejection
class SequenceRejection(_Bounds):
    """Drop whole sequences: ratio is the sequence ratio (the product of its token ratios),
    k1/k2/k3 are aggregated over the sequence's sampled tokens by `agg`."""

    type: Literal["sequence"] = "sequence"
    agg: Literal["mean", "sum", "max"] = "mean"
    """k1/k2/k3: the mean, sum or max over the sequence's sampled tokens (verl's rollout_rs
    seq_mean_k*, seq_sum_k*, seq_max_k2|3)."""

    def _combination_problem(self) -> str | None:
        if (why := rejection_problem("sequence", self.metric, self.agg)) is not None:
            return f"agg={self.agg} with metric={self.metric}: {why}"
        return None

    def keep_mask(self, proximal, behaviour, mask, metrics):
        return self._keep("sequence", self.agg, proximal, behaviour, mask, metrics)
