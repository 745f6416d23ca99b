"""Advantage estimators: how each computes (pure tensor math, no model, no I/O).

What each estimator needs is declared once in `asyncrl.algorithms.estimators` (torch-free, so config
validation reads it without importing torch); the built-ins' compute functions are the
`_name(x: AdvantageInputs)` functions at the end of this module, and `compute_advantages` is
the one dispatch the learner calls.

Conventions: response tensors are [B, T] aligned to token positions; `mask` [B, T] is 1 on tokens
the policy sampled and 0 on prompt, padding and tool output (a multi-turn sequence has mask holes
in the middle). Rewards are per sequence, [B]; `group_index` [B] int64 numbers the prompt group
(a group may have size 1). Every [B, T] output is 0 where `mask` is 0, and nothing here carries
a gradient: advantages and returns are targets.

Token-level recursions (GAE, REINFORCE++ return-to-go) run over sampled tokens only: a mask-0
position is skipped, so the "next" token of a sampled token is the next *sampled* token of the
same sequence (tool output between two turns is part of the environment, not an action).
`compute_advantages` is the one dispatch the learner calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.algorithms.estimators import ESTIMATORS


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read; all [B] or [B, T] as in the module docstring."""

    rewards: torch.Tensor
    """[B] sequence rewards (the sum of `token_rewards` over sampled tokens)."""
    token_rewards: torch.Tensor
    """[B, T] per-token rewards: the outcome on the last sampled token, minus any KL penalty."""
    mask: torch.Tensor
    """[B, T] 1 on sampled tokens."""
    group_index: torch.Tensor
    """[B] int64 prompt group of each sequence."""
    values: torch.Tensor | None = None
    """[B, T] critic values (estimators with needs_critic)."""
    baseline_rewards: torch.Tensor | None = None
    """[B] reward of the group's greedy answer (estimators with greedy_baseline)."""
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """mean = sum(x * mask) / sum(mask), over all elements or along `dim`; 0 where the mask is
    empty. Positions with mask 0 never contribute, even when x holds inf or nan there."""
    m = mask.to(torch.float32)
    xm = torch.where(m > 0, x.to(torch.float32), torch.zeros((), device=x.device)) * m
    if dim is None:
        return xm.sum() / m.sum().clamp(min=1e-8)
    return xm.sum(dim) / m.sum(dim).clamp(min=1e-8)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Whiten x over the masked elements of the whole tensor (verl's `masked_whiten`):

        mu = sum(m x) / n,   var = sum(m (x - mu)^2) / (n - 1),   out = m (x - mu) / sqrt(var + eps)

    with n = sum(m). The variance is the unbiased (Bessel-corrected) one, as in verl.
    Departures from verl:
      1. n <= 1 gives var = 0 (so the output is 0) instead of raising.
      2. The output is multiplied by the mask (0 outside it); verl leaves that to the caller.
    """
    m = mask.to(torch.float32)
    mean = masked_mean(x, m)
    centered = torch.where(m > 0, x.to(torch.float32) - mean, torch.zeros((), device=x.device))
    n = m.sum()
    var = (centered**2 * m).sum() / (n - 1).clamp(min=1.0)
    return centered * torch.rsqrt(var + eps) * m


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's reward on its last sampled token:

        R[i, t] = r_i  if t = max{t' : mask[i, t'] = 1}  else 0

    A sequence with no sampled token gets nothing.
    """
    m = mask > 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(m, positions, torch.full_like(positions, -1)).max(dim=1).values  # [B]
    has_any = last >= 0
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    values = torch.where(has_any, rewards.to(torch.float32), torch.zeros((), device=mask.device))
    return out.scatter_(1, last.clamp(min=0)[:, None], values[:, None])


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over sampled tokens:

        delta_t = r_t + gamma V_next(t) - V_t,      A_t = delta_t + gamma lam A_next(t)
        returns_t = A_t + V_t                       (unwhitened, the value-function target)
        advantages = masked_whiten(A, mask)

    where next(t) is the next sampled position of the same sequence (V_next = A_next = 0 after
    the last one): mask-0 positions (tool output, padding) are skipped by the recursion and
    rewards and values placed on them are ignored, as in verl 0.9.1's
    `compute_gae_advantage_return`. Departures from it:
      1. Advantages and returns are 0 at mask-0 positions (verl leaves the carried values there;
         every loss masks them, so training is the same).
    """
    m = mask > 0
    r = torch.where(m, token_rewards.to(torch.float32), torch.zeros((), device=mask.device))
    v = torch.where(m, values.to(torch.float32), torch.zeros((), device=mask.device))
    batch, length = mask.shape
    next_value = torch.zeros(batch, device=mask.device)
    next_adv = torch.zeros(batch, device=mask.device)
    adv = torch.zeros(batch, length, device=mask.device)
    for t in reversed(range(length)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m[:, t], a_t, torch.zeros_like(a_t))
        next_value = torch.where(m[:, t], v[:, t], next_value)
        next_adv = torch.where(m[:, t], a_t, next_adv)
    returns = (adv + v) * m
    return masked_whiten(adv, mask), returns


def _group_sums(
    rewards: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (sum of rewards in its group, size of its group)."""
    num_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    total = torch.zeros(num_groups, device=rewards.device).index_add_(0, group_index, rewards)
    count = torch.zeros(num_groups, device=rewards.device).index_add_(
        0, group_index, torch.ones_like(rewards)
    )
    return total[group_index], count[group_index]


def grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantage, one value per sequence:

        A_i = (r_i - mean_{j in g(i)} r_j) / (std_{j in g(i)} r_j + eps)     (norm_by_std)
        A_i =  r_i - mean_{j in g(i)} r_j                                   (Dr.GRPO)

    std is the unbiased sample std (as in verl); a group of size 1 has mean r_i and std 0, so
    its advantage is 0: a lone sample carries no relative signal (verl instead uses mean 0,
    std 1 there, giving A_i = r_i).
    """
    rewards = rewards.to(torch.float32)
    total, count = _group_sums(rewards, group_index)
    centered = rewards - total / count
    if not norm_by_std:
        return centered
    sq, _ = _group_sums(centered**2, group_index)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return centered / (std + eps)


def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024), one value per sequence:

        A_i = r_i - (1 / (n_g - 1)) sum_{j in g(i), j != i} r_j

    Departures from verl 0.9.1's `compute_rloo_outcome_advantage`:
      1. A group of size 1 has no other sample to compare with, so its advantage is 0 (verl's
         loop version gives it the raw reward r_i; its `rloo_vectorized` gives 0, as here).
    """
    rewards = rewards.to(torch.float32)
    total, count = _group_sums(rewards, group_index)
    loo_mean = (total - rewards) / (count - 1).clamp(min=1)
    return torch.where(count > 1, rewards - loo_mean, torch.zeros_like(rewards))


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): discounted return-to-go over sampled tokens, whitened over the
    masked tokens of the batch:

        G_t = r_t + gamma G_next(t),    advantages = masked_whiten(G, mask)

    with next(t) the next sampled position of the sequence (G_next = 0 after the last one): the
    running return is carried through mask-0 positions and rewards placed on them are ignored,
    as in verl 0.9.1's `compute_reinforce_plus_plus_outcome_advantage` (verl 0.7 and earlier
    reset it there, cutting a later turn's reward off from earlier turns).
    """
    m = mask > 0
    r = torch.where(m, token_rewards.to(torch.float32), torch.zeros((), device=mask.device))
    running = torch.zeros(mask.shape[0], device=mask.device)
    returns = torch.zeros_like(r)
    for t in reversed(range(mask.shape[1])):
        g_t = r[:, t] + gamma * running
        running = torch.where(m[:, t], g_t, running)
        returns[:, t] = torch.where(m[:, t], g_t, torch.zeros_like(g_t))
    return masked_whiten(returns, mask)


def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++ with a group-mean baseline (verl's
    `compute_reinforce_plus_plus_baseline_outcome_advantage`):

        A_{i,t} = masked_whiten(m_{i,t} (r_i - mean_{j in g(i)} r_j), mask)

    The whitening runs over all masked tokens of the batch (token-weighted, so long sequences
    count more). Departures from verl:
      1. A group of size 1 is centred on its own reward (so it gets 0 before whitening, as in
         `grpo_advantages`); verl uses a mean of 0 there.
    """
    centered = grpo_advantages(rewards, group_index, norm_by_std=False)
    m = mask.to(torch.float32)
    return masked_whiten(centered[:, None] * m, m)


def remax_advantages(
    rewards: torch.Tensor, baseline_rewards: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """ReMax (Li et al. 2024): the reward of the greedy response to the same prompt is the
    baseline, broadcast over sampled tokens, not whitened:

        A_{i,t} = m_{i,t} (r_i - r_i^greedy)

    Departures from verl's `compute_remax_outcome_advantage`:
      1. Every sampled token gets the sequence total (r_i is the sum of the token rewards when
         `compute_advantages` is given them); verl uses the per-token return-to-go, which
         differs only when token rewards (a KL penalty) sit before the last token.
    """
    diff = rewards.to(torch.float32) - baseline_rewards.to(torch.float32)
    return diff[:, None] * mask.to(torch.float32)


# ---- the built-ins declared in asyncrl.algorithms.estimators ----------------------------------------------
def _gae(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.values is not None
    return gae_advantages(x.token_rewards, x.values, x.mask, x.gamma, x.lam)


def _grpo(x: AdvantageInputs) -> torch.Tensor:
    return grpo_advantages(x.rewards, x.group_index, norm_by_std=x.norm_adv_by_std)


def _rloo(x: AdvantageInputs) -> torch.Tensor:
    return rloo_advantages(x.rewards, x.group_index)


def _reinforce_plus_plus(x: AdvantageInputs) -> torch.Tensor:
    return reinforce_plus_plus_advantages(x.token_rewards, x.mask, x.gamma)


def _reinforce_plus_plus_baseline(x: AdvantageInputs) -> torch.Tensor:
    return reinforce_plus_plus_baseline_advantages(x.rewards, x.group_index, x.mask)


def _remax(x: AdvantageInputs) -> torch.Tensor:
    assert x.baseline_rewards is not None
    return remax_advantages(x.rewards, x.baseline_rewards, x.mask)


def compute_advantages(
    name: str,
    *,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    token_rewards: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages [B, T] (0 off the mask) and, for critic estimators, value targets [B, T]
    (else None).

    `token_rewards` is the per-token reward including any KL-in-reward penalty; when None it is
    `outcome_token_rewards(rewards, mask)`. Estimators read the sequence reward as
    `(token_rewards * mask).sum(-1)` when token_rewards is given (so a KL penalty in the reward
    reaches them), else `rewards`; a sequence-level estimator's advantage is broadcast over the
    sampled tokens. A non-finite advantage or return on a sampled token raises
    FloatingPointError naming the estimator, never reaching a step.
    """
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(ESTIMATORS)}")
    est = ESTIMATORS[name]
    compute = est.function()
    if est.needs_critic and values is None:
        raise ValueError(f"the {name} estimator needs `values` (a critic)")
    if est.greedy_baseline and baseline_rewards is None:
        raise ValueError(f"the {name} estimator needs `baseline_rewards` (greedy rewards)")
    m = mask.to(torch.float32)
    seq_rewards = rewards if token_rewards is None else (token_rewards * m).sum(-1)
    if token_rewards is None:
        token_rewards = outcome_token_rewards(rewards, mask)
    inputs = AdvantageInputs(
        seq_rewards,
        token_rewards,
        mask,
        group_index,
        values,
        baseline_rewards,
        gamma,
        lam,
        norm_adv_by_std,
    )
    out = compute(inputs)
    advantages, returns = out if isinstance(out, tuple) else (out, None)
    if est.level == "sequence":
        advantages = advantages[:, None] * m
    for what, tensor in (("advantages", advantages), ("returns", returns)):
        if tensor is not None and not bool(torch.isfinite(tensor[mask.bool()]).all()):
            source = "rewards" if not bool(torch.isfinite(seq_rewards).all()) else "the estimator"
            raise FloatingPointError(f"{name} {what} are not finite (from {source})")
    return advantages, returns
