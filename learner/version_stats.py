"""Per-step metrics of the policy versions in a batch: staleness by each sample's oldest sampled
token (the rule the replay enforces), and how many versions a sample spans (more than one when
a version is applied in flight, `rollout.weight_update_mode=inflight`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_UNSAMPLED = 2**31 - 1  # above any version: a masked-out token never counts as the oldest


def oldest_versions(versions: torch.Tensor, loss_mask: torch.Tensor, version: int) -> torch.Tensor:
    """[B]: each sample's oldest sampled token's version (`version` when none is sampled)."""
    sampled = versions.long().masked_fill(loss_mask == 0, _UNSAMPLED)
    return sampled.min(dim=1).values.clamp(max=version)


def version_stats(
    versions: torch.Tensor, loss_mask: torch.Tensor, version: int, max_staleness: int
) -> dict[str, Any]:
    """`versions`, `loss_mask`: [B, T] of one batch trained at learner `version`."""
    sampled = versions.long().masked_fill(loss_mask == 0, _UNSAMPLED)
    staleness = (version - oldest_versions(versions, loss_mask, version)).float()
    ordered = sampled.sort(dim=1).values
    starts = (ordered[:, 1:] != ordered[:, :-1]) & (ordered[:, 1:] != _UNSAMPLED)
    spans = starts.sum(dim=1) + (ordered[:, 0] != _UNSAMPLED).long()
    return {
        "staleness_mean": float(staleness.mean()),
        "staleness_max": float(staleness.max()),
        "staleness_hist": np.bincount(
            staleness.long().cpu().numpy(), minlength=max_staleness + 1
        ).tolist(),
        "versions_per_sample": float(spans.float().mean()),
        "multi_version_frac": float((spans > 1).float().mean()),
    }
