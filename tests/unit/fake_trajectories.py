"""A one-token trajectory for the replay's unit tests (sampled at version 0 by server 0)."""

from __future__ import annotations

import numpy as np

from asyncrl.wire.samples import Trajectory


def one_token_trajectory(
    group_id: str, i: int, reward: float = 1.0, metrics: dict[str, float] | None = None
) -> Trajectory:
    """Sample `i` of group `group_id`: prompt [1, 2], response [3] (trained), log-prob -0.5."""
    return Trajectory(
        traj_id=f"{group_id}/{i}",
        attempt=0,
        group_id=group_id,
        sample_index=i,
        server_id=0,
        prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.array([3], np.int32),
        loss_mask=np.ones(1, np.uint8),
        behaviour_logprobs=np.full(1, -0.5, np.float32),
        versions=np.zeros(1, np.int32),
        reward=float(reward),
        finish_reason="stop",
        baseline_reward=float("nan"),
        metrics=dict(metrics or {}),
    )
