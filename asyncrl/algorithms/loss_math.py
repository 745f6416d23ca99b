"""The policy losses' tensor math (pure torch): PPO's clipped surrogate with dual clip and
GSPO-token, the masked log-ratio and its clamps, and the learner-vs-behaviour KL metric. The
variants of `asyncrl.algorithms.policy_losses` call them; the value loss and the loss aggregation
are the learner's (`learner.losses`).

Conventions (as in `asyncrl.algorithms.advantages`): tensors are [B, T] over response token
positions and `mask` is 1 on tokens the policy sampled. Losses are minimised: an advantage A > 0
pushes the token's log-prob up. Only `logp` (the learner's current log-probs) carries a gradient;
old, proximal, behaviour and reference log-probs, advantages and importance weights are targets
and are detached here.

Every token loss returns `(per_token_loss [B, T], stats)`: the loss is 0 where mask is 0 and is
not reduced (reduce it with `learner.losses.aggregate_loss`). Stats are detached scalar tensors
that add up across micro-batches and ranks (all-reduce SUM), except `*_max` (all-reduce MAX):
divide a `*_sum` or `*_tokens` entry by `tokens` for a mean or a fraction.

Log-ratios are computed only on masked tokens (0 elsewhere, so padding holding -inf cannot
turn into nan) and clamped before `exp` as verl 0.9.1 does: token ratios to [-20, 20], GSPO's
sequence ratio to at most 10; a clamped value carries no gradient.
"""

from __future__ import annotations

import torch

from asyncrl.algorithms.advantages import masked_mean

MAX_LOG_RATIO = 20.0
"""Token log-ratios are clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO] before exp (verl's bound)."""
MAX_GSPO_LOG_RATIO = 10.0
"""GSPO's sequence log-ratio is clamped to at most this (verl's `compute_policy_loss_gspo`)."""


def masked_log_ratio(num: torch.Tensor, den: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
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
    log_ratio = masked_log_ratio(logp, old_logp, mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
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
    log_ratio = masked_log_ratio(logp, old_logp, mask)
    seq_log_ratio = log_ratio.sum(-1) / m.sum(-1).clamp(min=1.0)
    live = torch.where(mask > 0, logp, torch.zeros((), device=logp.device))
    token_log_ratio = seq_log_ratio.detach()[:, None] + (live - live.detach())
    ratio = torch.exp(token_log_ratio.clamp(max=MAX_GSPO_LOG_RATIO))
    return _clipped_surrogate(ratio, advantages, m, clip_low, clip_high, None)


@torch.no_grad()
def mismatch_kl(
    learner_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """k3 estimate of KL(behaviour || learner) averaged over sampled tokens (a metric: does the
    learner reproduce the engine's log-probs for the same weights?):

        r = exp(learner - behav),   mean_{t sampled} ((r - 1) - log r)     (0 with no tokens)
    """
    log_r = masked_log_ratio(learner_logp.float(), behaviour_logp.float(), mask)
    return masked_mean(torch.exp(log_r) - 1.0 - log_r, mask)
