"""The update's metrics, each declared once: its name, what it reads from a micro-batch and how it
is reduced across micro-batches, ranks and mini-batches.

`UPDATE_METRICS` declares the policy update's metrics (read from a `MicroStep`), `CRITIC_METRICS`
the critic's (read from a `CriticStep`). From them follow the packing of every metric into one
SUM tensor and one MAX tensor (one all-reduce each per mini-batch, whatever the number of
metrics) and the final values, so a new metric is one `UpdateMetric(...)` line here plus its
test; nothing indexes a slot by hand.

Reductions (`Reduction`):
- `token_mean`: the sum over the mini-batch's loss tokens (all micro-batches, all ranks) over
  their number: a mean per token, or a fraction when the value counts tokens;
- `loss_mean`: the same sum over the loss denominator of `algorithm.loss_agg_mode` (tokens or
  sequences), so it is the loss the optimizer saw;
- `sum`: the plain sum;
- `max`: the largest value of any micro-batch on any rank.

Across the mini-batches of a step (`across`): their mean, their max (`max` metrics), or the first
mini-batch's (a value that the first optimizer step changes, as the learner-vs-engine KL).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import torch
import torch.distributed as dist

Reduction = Literal["token_mean", "loss_mean", "sum", "max"]


@dataclass(frozen=True)
class MicroStep:
    """What a metric may read from one micro-batch of the policy update; tensors [b, T] over its
    target tokens, detached."""

    mask: torch.Tensor
    """The loss mask times the row weights (0 on filler rows): what a token counts."""
    logp: torch.Tensor
    """The learner's log-probs."""
    behaviour: torch.Tensor
    """The engine's log-probs (the behaviour policy's)."""
    anchor: torch.Tensor
    """What the ratio is taken against: proximal with a decoupled correction, else behaviour."""
    entropy: torch.Tensor
    """The policy's entropy per token."""
    kl_ref: torch.Tensor | None
    """The KL loss's per-token KL to the reference policy (None: no KL loss)."""
    loss_sum: torch.Tensor
    """The aggregated loss's numerator (`learner.losses.aggregate_loss`)."""
    loss_stats: dict[str, torch.Tensor]
    """The policy loss's stats (`asyncrl.algorithms.policy_losses.PolicyLoss.loss`)."""

    @property
    def ratio(self) -> torch.Tensor:
        return torch.exp(self.logp - self.anchor)


@dataclass(frozen=True)
class CriticStep:
    """What a critic metric may read from one micro-batch of the critic's update; tensors [b, T]
    over its target tokens."""

    mask: torch.Tensor
    """The loss mask times the row weights (0 on filler rows)."""
    values: torch.Tensor
    """The critic's values (with a gradient: detach what you keep)."""
    loss: torch.Tensor
    """The value loss per token (`learner.losses.value_token_loss`), 0 off the mask."""
    loss_stats: dict[str, torch.Tensor]
    """The value loss's stats (`tokens`, `clipped_tokens`)."""


Step = TypeVar("Step", MicroStep, CriticStep)


@dataclass(frozen=True)
class UpdateMetric(Generic[Step]):
    """One metric of the update (module docstring)."""

    name: str
    reduce: Reduction
    value: Callable[[Step], torch.Tensor | None]
    """A micro-batch's contribution: a sum over its tokens (a max for `max`), a scalar tensor;
    None when the metric does not apply to this run (it is then not reported)."""
    across: Literal["mean", "max", "first"] = "mean"
    """How the values of a step's mini-batches combine."""


def _masked_sum(x: torch.Tensor, s: MicroStep) -> torch.Tensor:
    return (x * s.mask).sum()


UPDATE_METRICS: tuple[UpdateMetric[MicroStep], ...] = (
    UpdateMetric("loss", "loss_mean", lambda s: s.loss_sum),
    UpdateMetric("clip_frac", "token_mean", lambda s: s.loss_stats["clipped_tokens"]),
    UpdateMetric("ratio_mean", "token_mean", lambda s: _masked_sum(s.ratio, s)),
    UpdateMetric("ratio_max", "max", lambda s: (s.ratio * (s.mask > 0)).max(), across="max"),
    UpdateMetric(
        "logprob_abs_diff", "token_mean", lambda s: _masked_sum((s.logp - s.behaviour).abs(), s)
    ),
    UpdateMetric("entropy", "token_mean", lambda s: _masked_sum(s.entropy, s)),
    UpdateMetric(
        "dual_clip_frac",
        "token_mean",
        lambda s: s.loss_stats.get("dual_clipped_tokens", torch.zeros((), device=s.mask.device)),
    ),
    UpdateMetric(
        "kl_loss_ref",
        "token_mean",
        lambda s: None if s.kl_ref is None else _masked_sum(s.kl_ref, s),
    ),
    # k3 KL(behaviour || learner) before the step's first optimizer step: the engine's
    # numerical mismatch plus policy lag (with max_staleness=0, the mismatch alone)
    UpdateMetric("mismatch_kl", "token_mean", lambda s: _mismatch_kl_sum(s), across="first"),
)
"""The policy update's metrics, in the order they are logged."""


CRITIC_METRICS: tuple[UpdateMetric[CriticStep], ...] = (
    UpdateMetric("value_loss", "token_mean", lambda s: s.loss.sum()),
    UpdateMetric("value_clip_frac", "token_mean", lambda s: s.loss_stats["clipped_tokens"]),
    UpdateMetric("value_mean", "token_mean", lambda s: (s.values * s.mask).sum()),
)
"""The critic's metrics (gae), in the order they are logged; its token counts are the loss
mask's before any rejection."""


def _mismatch_kl_sum(s: MicroStep) -> torch.Tensor:
    from asyncrl.algorithms.loss_math import mismatch_kl

    return mismatch_kl(s.logp, s.behaviour, s.mask) * s.mask.sum()


class MetricSums(Generic[Step]):
    """The metrics of one mini-batch, accumulated over its micro-batches: the sums in one tensor
    and the maxima in another, one slot per declaration. A maximum starts at -inf, so a `max`
    metric whose values are all negative reports the largest of them; one that no value
    raised above -inf (no data) reports 0."""

    def __init__(self, metrics: Sequence[UpdateMetric[Step]], device: torch.device) -> None:
        self.metrics: tuple[UpdateMetric[Step], ...] = tuple(metrics)
        self._sums = torch.zeros(len(self.metrics), device=device)
        self._maxima = torch.full((len(self.metrics),), -math.inf, device=device)
        self._seen = torch.zeros(len(self.metrics), dtype=torch.bool)

    @torch.no_grad()
    def add(self, step: Step) -> None:
        """Add one micro-batch's contribution of every metric."""
        for i, metric in enumerate(self.metrics):
            value = metric.value(step)
            if value is None:
                continue
            self._seen[i] = True
            if metric.reduce == "max":
                self._maxima[i] = torch.maximum(self._maxima[i], value.float())
            else:
                self._sums[i] += value.float()

    def all_reduce(self, world: int) -> None:
        """Sum the sums and take the max of the maxima over the ranks (every rank, in step)."""
        if world > 1:
            dist.all_reduce(self._sums)
            dist.all_reduce(self._maxima, op=dist.ReduceOp.MAX)

    def values(self, tokens: float, loss_denominator: float) -> dict[str, float]:
        """Each metric that applied, reduced as declared (after `all_reduce`)."""
        per = {"token_mean": max(tokens, 1.0), "loss_mean": max(loss_denominator, 1e-8), "sum": 1.0}
        out = {}
        for i, metric in enumerate(self.metrics):
            if not self._seen[i]:
                continue
            if metric.reduce == "max":
                top = float(self._maxima[i])
                out[metric.name] = top if top > -math.inf else 0.0
            else:
                out[metric.name] = float(self._sums[i]) / per[metric.reduce]
        return out


def combine_mini_batches(
    steps: Sequence[dict[str, float]], metrics: Sequence[UpdateMetric[Any]]
) -> dict[str, float]:
    """One value per metric from the values of a step's mini-batches, as each metric's `across`
    says; a metric not declared here (grad_norm, critic_grad_norm) is averaged."""
    across = {m.name: m.across for m in metrics}
    out: dict[str, float] = {}
    for name in steps[0] if steps else ():
        values = [s[name] for s in steps]
        how = across.get(name, "mean")
        if how == "first":
            out[name] = values[0]
        elif how == "max":
            out[name] = max(values)
        else:
            out[name] = sum(values) / len(values)
    return out
