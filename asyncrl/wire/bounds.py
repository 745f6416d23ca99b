"""The bounds every wire message's `validate()` holds its fields to (`asyncrl.wire.protocol`).

They sit far above any honest message and below what would hurt a receiver: ids that fit a log
line, counts and indices that travel as int32, rewards whose group statistics cannot overflow.
Each check raises the codec's `ProtocolError` with a text naming the field.
"""

from __future__ import annotations

import math

import numpy as np

from asyncrl.wire.codec import check

MAX_ID_CHARS = 256  # traj_id, group_id, job_id, data_source, agent names
MAX_SAMPLES_PER_PROMPT = 1024  # PromptItem.n
MAX_METRICS = 256  # Trajectory.metrics entries
MAX_TRAJECTORIES_PER_MESSAGE = 4096  # Trajectories
MAX_INDEX = 2**31 - 1  # server ids, sample indices, versions, counts (they travel as int32)
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_ABS_REWARD = 1e6
"""Largest |reward| a sample may carry. Finite in float32 is not enough: two rewards of 3e38
in one group overflow the group's mean and std; no reward of an LM task comes near this."""


def check_id(value: str, name: str, empty_ok: bool = False) -> None:
    """An id or name: 1..MAX_ID_CHARS characters (0.. with `empty_ok`)."""
    check(
        (empty_ok or bool(value)) and len(value) <= MAX_ID_CHARS,
        f"{name} must have {0 if empty_ok else 1}..{MAX_ID_CHARS} characters, got {len(value)}",
    )


def check_index(value: int, name: str, low: int = 0) -> None:
    """A count, index, id or version: low..MAX_INDEX."""
    check(low <= value <= MAX_INDEX, f"{name} {value} outside {low}..{MAX_INDEX}")


def check_seconds(value: float, name: str) -> None:
    """A duration: finite and >= 0."""
    check(math.isfinite(value) and value >= 0, f"{name} must be finite and >= 0, got {value}")


def check_offsets(offsets: np.ndarray, b: int, total: int, name: str) -> None:
    """Offsets of `b` samples into a flat array of `total` elements: b + 1 of them, rising from
    0 to `total` (sample i owns [offsets[i], offsets[i + 1]])."""
    check(offsets.shape == (b + 1,), f"{name} must have shape [{b + 1}]")
    check(
        offsets[0] == 0 and offsets[-1] == total and bool((np.diff(offsets) >= 0).all()),
        f"{name} must rise from 0 to {total}",
    )


def finite32(value: float) -> bool:
    """Whether `value` stays a finite number once stored as float32 (1e39 does not)."""
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def plausible_reward(value: float) -> bool:
    """Whether `value` can be a reward: finite, |value| <= MAX_ABS_REWARD."""
    return math.isfinite(value) and abs(value) <= MAX_ABS_REWARD
