"""The off-policy corrections' tensor math behaviour -> proximal (pure torch): importance
weights, their truncation and batch normalisation, rejection masks, and the decoupled weighting of
a token loss. The variants that `algorithm.correction` and `algorithm.rejection` name
(`asyncrl.algorithms.corrections`) call them; `learner.corrections.off_policy_corrections`
applies the configured ones to the whole batch.

Conventions as `asyncrl.algorithms.loss_math`: [B, T] over response token positions, `mask` 1 on
the tokens the policy sampled, everything detached except a loss's `logp`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from asyncrl.algorithms.advantages import masked_mean
from asyncrl.algorithms.loss_math import (
    MAX_LOG_RATIO,
    masked_log_ratio,
    ppo_clip_token_loss,
)
from asyncrl.algorithms.rejection_rules import rejection_problem


def truncated_weights(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    level: Literal["token", "sequence"],
    cap: float | None,
    batch_normalize: bool,
    metrics: dict[str, float],
) -> torch.Tensor:
    """The `truncated_is` correction's weights over the WHOLE batch (`importance_weights` at
    `level` truncated at `cap`, then, with `batch_normalize`, made to average 1), with the
    metrics of the untruncated ones."""
    weights = importance_weights(proximal, behaviour, mask, level, cap)
    raw = importance_weights(proximal, behaviour, mask, level, None)
    n = mask.sum().clamp(min=1)
    metrics.update(
        is_weight_mean=float((raw * mask).sum() / n),
        is_weight_max=float((raw * mask).max()),
        is_truncated_frac=float(((raw > weights) * mask).sum() / n),
    )
    if batch_normalize:  # the whole batch, every rank alike: see its doc
        weights, norm = normalize_importance_weights(weights, mask, level)
        metrics.update(
            is_batch_norm_factor=float(norm),
            is_norm_weight_max=float((weights * mask).max()),
        )
    return weights


def rejection_keep(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    level: Literal["token", "sequence"],
    metric: Literal["ratio", "k1", "k2", "k3"],
    low: float | None,
    high: float | None,
    agg: Literal["mean", "sum", "max"],
    metrics: dict[str, float],
) -> torch.Tensor:
    """The `token` and `sequence` rejections' `rejection_mask` over the WHOLE batch, with the
    fractions of tokens and sequences it drops."""
    keep, rs = rejection_mask(proximal, behaviour, mask, level, metric, low, high, agg)
    metrics["masked_token_frac"] = float(rs["rejected_fraction"])
    metrics["masked_seq_frac"] = float(rs["rejected_sequences"] / rs["sequences"].clamp(min=1))
    return keep


@torch.no_grad()
def importance_weights(
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    level: Literal["token", "sequence"] = "token",
    cap: float | None = None,
) -> torch.Tensor:
    """Importance weights from the behaviour policy (the engine that sampled) to the proximal
    policy, detached, 0 off the mask:

        token:     w_{i,t} = min(exp(prox_t - behav_t), cap)
        sequence:  w_{i,t} = min(exp(sum_{t' sampled} (prox_t' - behav_t')), cap)   (broadcast)

    A cap truncates the weight (truncated IS, "TIS"); the exponent is clamped to [-20, 20].
    To reject rather than truncate tokens with large weights, use `rejection_mask`.
    """
    log_w = masked_log_ratio(proximal_logp.float(), behaviour_logp, mask)
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    elif level != "token":
        raise ValueError(f"unknown importance-weight level {level!r}; valid: token, sequence")
    w = torch.exp(log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    if cap is not None:
        w = w.clamp(max=cap)
    return w * (mask > 0).to(w.dtype)


@torch.no_grad()
def normalize_importance_weights(
    weights: torch.Tensor, mask: torch.Tensor, level: Literal["token", "sequence"]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights / mean, mean): `importance_weights` (truncated already) made to average 1 over
    the batch (verl's `rollout_is_batch_normalize`); the mean is over sampled tokens (token)
    or over sequences with a sampled token, one weight each (sequence). As verl: a mean
    <= 1e-8 leaves them alone (mean 1), and `mask` is the loss mask before rejection. Call it
    on the WHOLE batch, as `Learner.compute_advantages` does on every rank before the update
    (verl: on the driver's batch before the mini-batch split); a micro-batch's mean would make
    the loss depend on how the batch is cut."""
    m = (mask > 0).to(weights.dtype)
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown importance-weight level {level!r}; valid: token, sequence")
    if level == "token":
        mean = (weights * m).sum() / m.sum().clamp(min=1.0)
    else:  # each row's weight is the same on all its tokens: their mean is the row's weight
        mean = masked_mean(masked_mean(weights, m, dim=-1), m.sum(-1) > 0)
    if mean <= 1e-8:
        return weights, torch.ones((), dtype=weights.dtype, device=weights.device)
    return weights / mean, mean


@torch.no_grad()
def rejection_mask(
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    level: Literal["token", "sequence"],
    metric: Literal["ratio", "k1", "k2", "k3"],
    low: float | None = None,
    high: float | None = None,
    agg: Literal["mean", "sum", "max"] = "mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked importance sampling: a float [B, T] mask, 1 on sampled tokens that are kept.

    With log r = prox - behav on a sampled token (r = p_prox / p_behav, the token drawn from the
    behaviour policy), the per-token metrics are Schulman's estimators of KL(behav || prox):

        ratio = r,   k1 = -log r,   k2 = 0.5 (log r)^2,   k3 = (r - 1) - log r

    At the sequence level, ratio is the sequence IS ratio exp(sum_t log r_t) and k1/k2/k3 are
    aggregated over the sequence's sampled tokens by `agg`: their mean, sum or max (verl's
    rollout_rs `seq_mean_k*`, `seq_sum_k*`, `seq_max_k*`; the combinations refused are
    `asyncrl.algorithms.rejection_rules.rejection_problem`'s); a sequence is kept or rejected whole. A token or
    sequence is rejected when its value < low or > high (either bound optional; ratio bounds
    must be > 0 and are compared in log space, so a huge sequence ratio cannot overflow).
    Stats: tokens, rejected_tokens, rejected_fraction, sequences (with a sampled token),
    rejected_sequences (all of whose sampled tokens are rejected).
    """
    if metric not in ("ratio", "k1", "k2", "k3"):
        raise ValueError(f"unknown rejection metric {metric!r}; valid: ratio, k1, k2, k3")
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown rejection level {level!r}; valid: token, sequence")
    if (why := rejection_problem(level, metric, agg)) is not None:
        raise ValueError(f"rejection {level}/{metric}/{agg}: {why}")
    sampled = mask > 0
    log_r = masked_log_ratio(proximal_logp.float(), behaviour_logp.float(), mask)
    value, low_b, high_b = _rejection_metric(log_r, sampled, level, metric, agg, low, high)
    reject = torch.zeros_like(sampled)
    if low_b is not None:
        reject |= value < low_b
    if high_b is not None:
        reject |= value > high_b
    keep = (sampled & ~reject).float()
    tokens = sampled.float().sum()
    rejected = (sampled & reject).float().sum()
    has_token = sampled.any(-1)
    stats = {
        "tokens": tokens,
        "rejected_tokens": rejected,
        "rejected_fraction": rejected / tokens.clamp(min=1.0),
        "sequences": has_token.float().sum(),
        "rejected_sequences": (has_token & ~(keep > 0).any(-1)).float().sum(),
    }
    return keep, stats


def _rejection_metric(
    log_r: torch.Tensor,
    sampled: torch.Tensor,
    level: str,
    metric: str,
    agg: str,
    low: float | None,
    high: float | None,
) -> tuple[torch.Tensor, float | None, float | None]:
    """(the metric per token [B, T], a sequence's value on each of its tokens; the bounds in its
    space): ratio in log space, so a huge sequence ratio cannot overflow."""
    if metric == "ratio":
        if (low is not None and low <= 0) or (high is not None and high <= 0):
            raise ValueError("ratio bounds must be > 0")
        value = log_r.sum(-1, keepdim=True).expand_as(log_r) if level == "sequence" else log_r
        low_b = None if low is None else math.log(low)
        high_b = None if high is None else math.log(high)
        return value, low_b, high_b
    if metric == "k1":
        value = -log_r
    elif metric == "k2":
        value = 0.5 * log_r**2
    else:
        value = torch.exp(log_r) - 1.0 - log_r
    if level == "sequence":
        value = _sequence_aggregate(value, sampled, agg)[:, None].expand_as(log_r)
    return value, low, high


def _sequence_aggregate(value: torch.Tensor, sampled: torch.Tensor, agg: str) -> torch.Tensor:
    """[B]: the mean, sum or max of `value` over each row's sampled tokens (0 with none)."""
    if agg == "mean":
        return masked_mean(value, sampled.float(), dim=-1)
    if agg == "sum":
        return torch.where(sampled, value, torch.zeros((), device=value.device)).sum(-1)
    top = torch.where(sampled, value, torch.full((), -math.inf, device=value.device)).amax(-1)
    return torch.where(sampled.any(-1), top, torch.zeros((), device=value.device))


def behaviour_weighted(
    loss: torch.Tensor,
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decoupled PPO's correction of a token loss taken against the proximal policy: each
    token's loss times its detached behaviour -> proximal importance weight, `is_weights`
    when given (from `importance_weights`: token or sequence level, possibly truncated), else
    the untruncated token weight exp(prox - behav) (AReaL). Any policy loss alike."""
    if is_weights is None:
        is_weights = importance_weights(proximal_logp, behaviour_logp, mask, "token", None)
    return loss * is_weights.detach().to(loss.dtype)


def decoupled_ppo_token_loss(
    logp: torch.Tensor,
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (AReaL, Fu et al. 2025): the trust region is taken around the proximal
    policy (the learner's weights before this update) while the tokens were sampled by an older
    behaviour policy, corrected by a detached importance weight (`behaviour_weighted`):

        r = exp(logp - prox),   w = sg[exp(prox - behav)] (or the given `is_weights`)
        l = w * max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))      (+ dual clip as PPO)

    With behav = prox = sg[logp] and nothing clipped, l = -A r and dl/dlogp = -A.
    Departures from AReaL:
      1. `is_weights` (from `importance_weights`) may be token- or sequence-level and truncated
         (TIS); AReaL's `behav_imp_weight_cap` instead rejects tokens whose weight exceeds the
         cap: reproduce it with `rejection_mask(..., "token", "ratio", high=cap)` on the mask.
    Stats: those of `ppo_clip_token_loss` (clip relative to the proximal policy), plus
    is_weight_sum, is_weight_max and behaviour_k3_sum (sum of the k3 estimate of
    KL(behav || prox) over tokens: how stale the samples are).
    """
    if is_weights is None:
        is_weights = importance_weights(proximal_logp, behaviour_logp, mask, "token", None)
    loss, stats = ppo_clip_token_loss(
        logp, proximal_logp, advantages, mask, clip_low, clip_high, clip_c
    )
    m = (mask > 0).to(loss.dtype)
    w = is_weights.detach().to(loss.dtype) * m
    with torch.no_grad():
        log_r = masked_log_ratio(proximal_logp.float(), behaviour_logp.float(), mask)
        stats["is_weight_sum"] = w.sum()
        stats["is_weight_max"] = w.amax() if w.numel() else torch.zeros((), device=w.device)
        stats["behaviour_k3_sum"] = ((torch.exp(log_r) - 1.0 - log_r) * m).sum()
    return behaviour_weighted(loss, proximal_logp, behaviour_logp, mask, w), stats
