"""Whether a sample can be trained on: the replay's check of every trajectory it is sent, for
training (`replay.buffer.GroupBuffer.add`) or evaluation (`replay.service`), before it is kept.

A trajectory that decoded (the codec bounds each field) may still be unfit to train on: arrays
of uneven lengths, a mask that is not 0/1, a NaN or 1e39 reward, a token id outside the
vocabulary or a sample longer than the model's context. Any one of them would poison a group's
advantages or crash the learner, so the sample is refused (`MalformedTrajectory`) and its
sender is answered `Ack(rejected)`, which stops its resends.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from asyncrl.wire.bounds import MAX_ABS_REWARD, finite32, plausible_reward
from asyncrl.wire.samples import Trajectory


class MalformedTrajectory(ValueError):
    """A trajectory that decoded but cannot be trained on (inconsistent arrays, bad index)."""


@dataclass(frozen=True)
class TokenLimits:
    """What the run's model can take: token ids below `vocab_size`, at most `max_tokens`
    prompt and response tokens together (its context)."""

    vocab_size: int
    max_tokens: int

    @classmethod
    def of_model(cls, model_path: str | None) -> TokenLimits | None:
        """From a Hugging Face model directory's config.json (None: no model, no limits)."""
        if model_path is None:
            return None
        config = json.loads((Path(model_path) / "config.json").read_text())
        context = next(
            (config[k] for k in ("max_position_embeddings", "n_positions") if k in config), None
        )
        if "vocab_size" not in config or context is None:
            raise ValueError(f"{model_path}/config.json names no vocab_size or context length")
        return cls(int(config["vocab_size"]), int(context))


def check_trajectory(traj: Trajectory, limits: TokenLimits | None = None) -> None:
    """Raise MalformedTrajectory unless the arrays are 1-D, the response arrays have one length,
    the mask is 0/1, sampled tokens carry a version >= 0 and finite log-probs, the reward and
    the baseline (NaN: absent) are within MAX_ABS_REWARD, the metrics are finite in float32
    (the dtype the batch stores them in: a NaN or 1e39 reward would poison the whole group's
    advantages), and, with `limits`, every token id is in the vocabulary and the sample fits
    the model's context (an id out of range, or a 5M-token sample, would crash the learner)."""
    arrays = {
        "prompt_ids": traj.prompt_ids,
        "response_ids": traj.response_ids,
        "loss_mask": traj.loss_mask,
        "behaviour_logprobs": traj.behaviour_logprobs,
        "versions": traj.versions,
    }
    for name, arr in arrays.items():
        if arr.ndim != 1:
            raise MalformedTrajectory(f"{name} must be 1-D, got shape {list(arr.shape)}")
    lengths = {name: len(arr) for name, arr in arrays.items() if name != "prompt_ids"}
    if len(set(lengths.values())) != 1:
        raise MalformedTrajectory(f"response arrays differ in length: {lengths}")
    if traj.loss_mask.size and traj.loss_mask.max() > 1:
        raise MalformedTrajectory("loss_mask must be 0 or 1")
    sampled = traj.loss_mask == 1
    if sampled.any() and traj.versions[sampled].min() < 0:
        raise MalformedTrajectory("a sampled token has a negative policy version")
    if not np.isfinite(traj.behaviour_logprobs[sampled]).all():
        raise MalformedTrajectory("a sampled token has a non-finite behaviour log-prob")
    if not plausible_reward(traj.reward):
        raise MalformedTrajectory(f"reward {traj.reward} is not finite within ±{MAX_ABS_REWARD:g}")
    if not (math.isnan(traj.baseline_reward) or plausible_reward(traj.baseline_reward)):
        raise MalformedTrajectory(f"baseline_reward {traj.baseline_reward} is out of range")
    bad = [k for k, v in traj.metrics.items() if not finite32(v)]
    if bad:
        raise MalformedTrajectory(f"metrics {bad[:5]} are not finite in float32")
    if limits is not None:
        _check_tokens(traj, limits)
    if not traj.traj_id or not traj.group_id:
        raise MalformedTrajectory("traj_id and group_id must be non-empty")


def _check_tokens(traj: Trajectory, limits: TokenLimits) -> None:
    total = len(traj.prompt_ids) + len(traj.response_ids)
    if total > limits.max_tokens:
        raise MalformedTrajectory(f"{total} tokens > the model's context of {limits.max_tokens}")
    for name in ("prompt_ids", "response_ids"):
        ids = getattr(traj, name)
        if ids.size and not (int(ids.min()) >= 0 and int(ids.max()) < limits.vocab_size):
            raise MalformedTrajectory(f"{name} outside the vocabulary 0..{limits.vocab_size - 1}")
