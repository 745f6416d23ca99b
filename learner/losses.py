"""The value loss, loss aggregation and the entropy (pure tensor functions). The policy losses'
math is the core's (`asyncrl.algorithms.loss_math`), as are the off-policy corrections'
(`asyncrl.algorithms.correction_math`) and the KL terms' (`asyncrl.algorithms.kl_math`).

Conventions (as in `asyncrl.algorithms.loss_math`): tensors are [B, T] over response token
positions and `mask` is 1 on tokens the policy sampled; only the current model's outputs carry a
gradient. A token loss returns `(per_token_loss [B, T], stats)`, 0 where mask is 0 and not
reduced (reduce it with `aggregate_loss`); stats are detached scalar sums.
"""

from __future__ import annotations

import torch

AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


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
