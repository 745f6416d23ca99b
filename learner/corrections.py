"""The configured off-policy correction and rejection applied to the whole batch
(`off_policy_corrections`): the variants of `algorithm.correction` and `algorithm.rejection`
(`asyncrl.algorithms.corrections`, their math in `asyncrl.algorithms.correction_math`). It reads
the `AlgorithmConfig`, which the core's math may not import (the config sits above the
algorithms in `CORE_ORDER`).
"""

from __future__ import annotations

import torch

from asyncrl.algorithms.loss_math import mismatch_kl
from asyncrl.config import AlgorithmConfig


def off_policy_corrections(
    algo: AlgorithmConfig,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    metrics: dict[str, float],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(importance weights, rejection mask) behaviour -> proximal over the WHOLE batch, as
    `algorithm.correction` and `algorithm.rejection` ask (None: not asked), with their metrics
    added to `metrics`. Every rank holds the whole batch and the same proximal log-probs, so
    every rank computes the same."""
    metrics["proximal_behaviour_kl"] = float(mismatch_kl(proximal, behaviour, mask))
    weights = algo.correction.batch_weights(proximal, behaviour, mask, metrics)
    keep = algo.rejection.keep_mask(proximal, behaviour, mask, metrics)
    return weights, keep
