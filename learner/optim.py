"""The optimizer (AdamW) and its learning-rate schedule: linear warmup, then constant or cosine
decay (`learner.lr_schedule`, `learner.warmup_steps`).

The optimizer is torch's fused AdamW (one kernel over all parameters instead of a Python loop
over them: a fixed cost per step that a small model feels). The rate is a pure function of the learner step (the version being trained), so a resumed run
continues the schedule exactly where the checkpoint left it, with no scheduler state to save.
"""

from __future__ import annotations

import math

import torch

from asyncrl.config import LearnerConfig


def lr_factor(step: int, lc: LearnerConfig, total_steps: int) -> float:
    """Multiplier of the base learning rate for learner step `step` (0-based):
    (step + 1) / (warmup + 1) during warmup; then 1, or a cosine from 1 down to
    `min_lr_ratio` reached at step `total_steps - 1`."""
    warmup = lc.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if lc.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - 1 - warmup))
    return lc.min_lr_ratio + (1.0 - lc.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def setup_optimizer(model: torch.nn.Module, lr: float, lc: LearnerConfig) -> torch.optim.AdamW:
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    return torch.optim.AdamW(
        trainable, lr=lr, betas=lc.betas, weight_decay=lc.weight_decay, fused=True
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
