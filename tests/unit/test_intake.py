"""The sample intake (`replay.intake`): each sample ends in exactly one counter and one Ack
status; an untrainable sample of a batch fails alone."""

from __future__ import annotations

import dataclasses

from fake_trajectories import one_token_trajectory

from asyncrl.config import Config
from asyncrl.wire.protocol import LeaseRequest
from replay.components import setup_replay_components

CONFIG = Config.model_validate(
    {"rollout": {"n": 2, "max_concurrent_groups": 4}, "data": {"train_batch_size": 2}}
)


def test_each_sample_ends_in_one_counter_and_status():
    parts = setup_replay_components(CONFIG, b"s" * 32)
    [item] = parts.leases.grant(LeaseRequest(1, 0, 0, 1))
    good = one_token_trajectory(item.group_id, 0)
    bad = dataclasses.replace(one_token_trajectory(item.group_id, 1), reward=float("nan"))
    stray = one_token_trajectory("no-such-group", 0)
    assert parts.intake.take(good) == ("accepted", "")
    assert parts.intake.take(good) == ("duplicate", "")
    status, why = parts.intake.take(bad, alone=False)
    assert status == "rejected" and "reward nan" in why
    assert parts.intake.take(stray) == ("late", "")
    counted = {k: parts.counters[k] for k in ("accepted", "duplicates", "untrainable", "late")}
    assert counted == {"accepted": 1, "duplicates": 1, "untrainable": 1, "late": 1}
    assert parts.intake.take(one_token_trajectory(item.group_id, 1)) == ("accepted", "")
    assert parts.buffer.num_ready == 1  # the bad sample took no slot of its group
