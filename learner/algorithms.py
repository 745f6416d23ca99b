"""Advantage estimators and policy losses (pure tensor functions, no model, no I/O).

Conventions: tensors are [B, T] over token positions of the response, `mask` is 1 on tokens the
policy sampled (the loss mask) and 0 on prompt, padding and tool output. Rewards are per
sequence, [B]; `group_index` [B] numbers the prompt group of each sequence.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantage, one value per sequence:

        A_i = (r_i - mean_{j in g(i)} r_j) / (std_{j in g(i)} r_j + eps)     (norm_by_std)
        A_i =  r_i - mean_{j in g(i)} r_j                                   (Dr.GRPO)

    std is the unbiased sample std (as in verl); a group of size 1 has mean r_i and std 0, so
    its advantage is 0: a lone sample carries no relative signal.
    """
    rewards = rewards.float()
    num_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    count = torch.zeros(num_groups).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros(num_groups).index_add_(0, group_index, rewards) / count
    centered = rewards - mean[group_index]
    if not norm_by_std:
        return centered
    sq = torch.zeros(num_groups).index_add_(0, group_index, centered**2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return centered / (std[group_index] + eps)


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token, summed over `mask` (the caller normalises):

        r = exp(logp - logp_old),   l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))

    `advantages` is [B, T] (a per-sequence advantage broadcast over its tokens). Returns the
    masked sum of l and token-level statistics (clip fraction, ratio mean/max), each summed or
    maxed over masked tokens so they can be combined across micro-batches and ranks.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    m = mask.to(per_token.dtype)
    with torch.no_grad():
        stats = {
            "clipped_tokens": ((clipped > unclipped).to(m.dtype) * m).sum(),
            "ratio_sum": (ratio * m).sum(),
            "ratio_max": torch.where(m > 0, ratio, torch.zeros_like(ratio)).max()
            if m.numel()
            else torch.zeros(()),
        }
    return (per_token * m).sum(), stats
