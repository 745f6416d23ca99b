"""Policy losses, off-policy corrections, the value loss and loss aggregation (pure tensor
functions; the KL terms are in `learner.kl`).

The policy losses `algorithm.policy_loss` can name are declared in `asyncrl.algorithms.policy_losses`; the
built-ins' functions are `ppo_policy_loss` and `gspo_policy_loss` here.

Conventions (as in `asyncrl.algorithms.advantages`): tensors are [B, T] over response token positions and
`mask` is 1 on tokens the policy sampled. Losses are minimised: an advantage A > 0 pushes the
token's log-prob up. Only `logp` (the learner's current log-probs) carries a gradient; old,
proximal, behaviour and reference log-probs, advantages and importance weights are targets and
are detached here.

Every token loss returns `(per_token_loss [B, T], stats)`: the loss is 0 where mask is 0 and is
not reduced (reduce it with `aggregate_loss`). Stats are detached scalar tensors that add up
across micro-batches and ranks (all-reduce SUM), except `*_max` (all-reduce MAX): divide a
`*_sum` or `*_tokens` entry by `tokens` for a mean or a fraction.

Log-ratios are computed only on masked tokens (0 elsewhere, so padding holding -inf cannot
turn into nan) and clamped before `exp` as verl 0.9.1 does: token ratios to [-20, 20], GSPO's
sequence ratio to at most 10; a clamped value carries no gradient.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from asyncrl.algorithms.advantages import masked_mean
from asyncrl.algorithms.policy_losses import PolicyLossInputs
from asyncrl.config.learner import rejection_problem

AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
MAX_LOG_RATIO = 20.0
"""Token log-ratios are clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO] before exp (verl's bound)."""
MAX_GSPO_LOG_RATIO = 10.0
"""GSPO's sequence log-ratio is clamped to at most this (verl's `compute_policy_loss_gspo`)."""


def _log_ratio(num: torch.Tensor, den: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """num - den on masked tokens, 0 elsewhere (num may carry a gradient, den is detached)."""
    return torch.where(mask > 0, num - den.detach(), torch.zeros((), device=num.device))


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    m: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """max(-A r, -A clip(r)), then for A < 0 min(., -A clip_c); masked, with PPO stats."""
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"dual-clip constant clip_c must be > 1, got {clip_c}")
    adv = advantages.detach().to(ratio.dtype)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(m, dtype=torch.bool)
    if clip_c is not None:
        floor = -adv * clip_c
        dual_active = (adv < 0) & (loss > floor)
        loss = torch.where(adv < 0, torch.minimum(loss, floor), loss)
    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "tokens": m.sum(),
            "clipped_tokens": ((clipped > unclipped).to(m.dtype) * m).sum(),
            "dual_clipped_tokens": (dual_active.to(m.dtype) * m).sum(),
            "ratio_sum": (r * m).sum(),
            "ratio_max": torch.where(m > 0, r, torch.zeros_like(r)).amax()
            if m.numel()
            else torch.zeros((), device=m.device),
        }
    return loss * m, stats


def ppo_clip_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token (Schulman et al. 2017), with optional dual clip (Ye et al.
    2020) for negative advantages:

        r = exp(logp - old_logp),   l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        l = min(l, -A clip_c)       if A < 0 and clip_c is not None  (clip_c > 1)

    Stats: tokens, clipped_tokens (the clipped branch is strictly larger), dual_clipped_tokens
    (A < 0 and the -A clip_c bound is active), ratio_sum, ratio_max.
    """
    m = (mask > 0).to(logp.dtype)
    log_ratio = _log_ratio(logp, old_logp, mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return _clipped_surrogate(torch.exp(log_ratio), advantages, m, clip_low, clip_high, clip_c)


def gspo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (Zheng et al. 2025): PPO clipping on the length-normalised sequence ratio.

        s_i     = exp((1 / |y_i|) sum_{t sampled} (logp_t - old_logp_t))
        s_{i,t} = sg[s_i] exp(logp_t - sg[logp_t])          (value s_i, gradient s_i dlogp_t)
        l_{i,t} = max(-A_{i,t} s_{i,t}, -A_{i,t} clip(s_{i,t}, 1 - clip_low, 1 + clip_high))

    Aggregated with `seq-mean-token-mean` this is the paper's objective (and its gradient);
    with A constant over a sequence it equals GSPO's sequence-level loss. Clipping acts on
    whole sequences, so clip ranges are tiny: the paper uses clip_low = 3e-4, clip_high = 4e-4.
    Departures from the paper:
      1. The sequence log-ratio is clamped to at most MAX_GSPO_LOG_RATIO (10) before exp, and a
         clamped row gets no gradient, as in verl 0.9.1 (the clamp acts on s_{i,t}'s log).
    Stats as `ppo_clip_token_loss` (no dual clip; ratio_* are over the sequence ratio per
    token).
    """
    m = (mask > 0).to(logp.dtype)
    log_ratio = _log_ratio(logp, old_logp, mask)
    seq_log_ratio = log_ratio.sum(-1) / m.sum(-1).clamp(min=1.0)
    live = torch.where(mask > 0, logp, torch.zeros((), device=logp.device))
    token_log_ratio = seq_log_ratio.detach()[:, None] + (live - live.detach())
    ratio = torch.exp(token_log_ratio.clamp(max=MAX_GSPO_LOG_RATIO))
    return _clipped_surrogate(ratio, advantages, m, clip_low, clip_high, None)


def ppo_policy_loss(x: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss `ppo` (`asyncrl.algorithms.policy_losses`): `ppo_clip_token_loss` with dual clip."""
    return ppo_clip_token_loss(
        x.logp, x.old_logp, x.advantages, x.mask, x.clip_low, x.clip_high, x.clip_c
    )


def gspo_policy_loss(x: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss `gspo`: `gspo_token_loss` (no dual clip: `clip_c` is not used)."""
    return gspo_token_loss(x.logp, x.old_logp, x.advantages, x.mask, x.clip_low, x.clip_high)


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
    log_w = _log_ratio(proximal_logp.float(), behaviour_logp, mask)
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
    `asyncrl.config.learner.rejection_problem`'s); a sequence is kept or rejected whole. A token or
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
    log_r = _log_ratio(proximal_logp.float(), behaviour_logp.float(), mask)
    if metric == "ratio":
        if (low is not None and low <= 0) or (high is not None and high <= 0):
            raise ValueError("ratio bounds must be > 0")
        value = log_r.sum(-1, keepdim=True).expand_as(log_r) if level == "sequence" else log_r
        low_b = None if low is None else math.log(low)
        high_b = None if high is None else math.log(high)
    else:
        if metric == "k1":
            value = -log_r
        elif metric == "k2":
            value = 0.5 * log_r**2
        else:
            value = torch.exp(log_r) - 1.0 - log_r
        if level == "sequence":
            value = _sequence_aggregate(value, sampled, agg)[:, None].expand_as(log_r)
        low_b, high_b = low, high
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
        log_r = _log_ratio(proximal_logp.float(), behaviour_logp.float(), mask)
        stats["is_weight_sum"] = w.sum()
        stats["is_weight_max"] = w.amax() if w.numel() else torch.zeros((), device=w.device)
        stats["behaviour_k3_sum"] = ((torch.exp(log_r) - 1.0 - log_r) * m).sum()
    return behaviour_weighted(loss, proximal_logp, behaviour_logp, mask, w), stats


def value_token_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss per token, as verl 0.9.1's `compute_value_loss` (before its
    aggregation):

        V_clip = clip(V, V_old - clip, V_old + clip)
        l      = 0.5 max((V - R)^2, (V_clip - R)^2)

    Only `values` carries a gradient. Stats: tokens, clipped_tokens (the clipped term strictly
    larger, verl's vf_clipfrac numerator).
    """
    m = (mask > 0).to(values.dtype)
    old, ret = old_values.detach(), returns.detach()
    clipped = old + (values - old).clamp(-clip, clip)
    unclipped_sq, clipped_sq = (values - ret) ** 2, (clipped - ret) ** 2
    loss = 0.5 * torch.maximum(unclipped_sq, clipped_sq) * m
    with torch.no_grad():
        stats = {
            "tokens": m.sum(),
            "clipped_tokens": ((clipped_sq > unclipped_sq).float() * m).sum(),
        }
    return loss, stats


def aggregate_denominator(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The denominator of `aggregate_loss` for `mask` (detached): the number of sampled tokens
    for `token-mean`, the number of sequences with at least one sampled token for `seq-*`.
    Compute it over the WHOLE batch (all micro-batches, all ranks) and divide the summed
    numerators by it."""
    if mode not in AGGREGATION_MODES:
        raise ValueError(
            f"unknown aggregation mode {mode!r}; valid: {', '.join(AGGREGATION_MODES)}"
        )
    sampled = (mask > 0).float()
    if mode == "token-mean":
        return sampled.sum()
    return (sampled.sum(-1) > 0).float().sum()


def aggregate_loss(
    per_token_loss: torch.Tensor, mask: torch.Tensor, mode: str, horizon: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a loss reduction into (differentiable numerator, detached denominator):

        token-mean               sum_{i,t} m l                 / #tokens
        seq-mean-token-sum       sum_i (sum_t m l)             / #sequences
        seq-mean-token-mean      sum_i (sum_t m l / n_i)       / #sequences
        seq-mean-token-sum-norm  sum_i (sum_t m l / horizon)   / #sequences   (Dr.GRPO)

    n_i = sum_t m_{i,t}; #sequences counts only sequences with a sampled token; `horizon` is a
    constant (e.g. the max response length), required for the last mode. Why the split: every
    mode is a ratio of sums, and a mean over a micro-batch is not the mean over the batch. The
    learner sums numerators over micro-batches and ranks and divides by the denominator of the
    whole batch (`aggregate_denominator`), so micro-batching and data parallelism give exactly
    the loss of one big batch. seq-mean-token-sum-norm is verl 0.9.1's: the sequence mean of
    token sums divided by a constant (verl's `loss_scale_factor`, by default the padded response
    width; the learner passes the batch's response width).
    """
    if mode == "seq-mean-token-sum-norm" and (horizon is None or horizon <= 0):
        raise ValueError("seq-mean-token-sum-norm needs a positive constant `horizon`")
    denominator = aggregate_denominator(mask, mode)
    m = (mask > 0).to(per_token_loss.dtype)
    token_sums = (per_token_loss * m).sum(-1)
    if mode == "seq-mean-token-mean":
        numerator = (token_sums / m.sum(-1).clamp(min=1.0)).sum()
    elif mode == "seq-mean-token-sum-norm":
        assert horizon is not None
        numerator = token_sums.sum() / horizon
    else:
        numerator = token_sums.sum()
    return numerator, denominator


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, in the logits' dtype:

        z' = z - max_v z_v,   H = -sum_v p_v log p_v = logsumexp(z') - sum_v p_v z'_v

    Shifting by the max avoids the cancellation of logsumexp(z) - sum p z at large logits, and
    the form never takes log of an underflowed probability; -inf logits (a masked vocabulary)
    contribute 0 to value and gradient.
    """
    shifted = logits - logits.detach().amax(dim=-1, keepdim=True)
    p = torch.softmax(shifted, dim=-1)
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    finite = torch.where(p > 0, shifted, zero)
    return torch.logsumexp(shifted, dim=-1) - (p * finite).sum(-1)


@torch.no_grad()
def mismatch_kl(
    learner_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """k3 estimate of KL(behaviour || learner) averaged over sampled tokens (a metric: does the
    learner reproduce the engine's log-probs for the same weights?):

        r = exp(learner - behav),   mean_{t sampled} ((r - 1) - log r)     (0 with no tokens)
    """
    log_r = _log_ratio(learner_logp.float(), behaviour_logp.float(), mask)
    return masked_mean(torch.exp(log_r) - 1.0 - log_r, mask)
