import dataclasses
import random

import numpy as np
import pytest

from asyncrl.wire.protocol import ChatMessage, PromptItem
from asyncrl.wire.samples import Trajectory
from replay.admission import AdmissionController
from replay.buffer import GroupBuffer, sample_version, to_batch
from replay.sample_checks import MalformedTrajectory


def _item(group_id: str, n: int = 2) -> PromptItem:
    return PromptItem(group_id, n, "src", [ChatMessage("user", "1+1=")], "2", "{}")


def _traj(group_id: str, index: int, versions=(3, 3), mask=None, traj_id=None, **kw) -> Trajectory:
    r = len(versions)
    mask = np.ones(r, np.uint8) if mask is None else np.asarray(mask, np.uint8)
    fields = dict(
        traj_id=traj_id or f"{group_id}/{index}",
        attempt=0,
        group_id=group_id,
        sample_index=index,
        server_id=0,
        prompt_ids=np.array([1, 2, 3], np.int32),
        response_ids=np.arange(r, dtype=np.int32) + 10,
        loss_mask=mask,
        behaviour_logprobs=np.full(r, -0.5, np.float32),
        versions=np.where(mask == 1, np.asarray(versions, np.int32), -1).astype(np.int32),
        reward=1.0,
        finish_reason="stop",
        baseline_reward=float("nan"),
        metrics={},
    )
    fields.update(kw)
    return Trajectory(**fields)


def _fill(buf: GroupBuffer, group_id: str, version: int, n: int = 2, lease_version: int = 0):
    buf.open_group(_item(group_id, n), now=0.0, lease_version=lease_version)
    for i in range(n):
        assert buf.add(_traj(group_id, i, versions=(version, version))) == "accepted"


def test_group_is_ready_only_when_all_samples_arrived():
    buf = GroupBuffer()
    buf.open_group(_item("g", n=3), now=0.0, lease_version=0)
    buf.add(_traj("g", 0))
    buf.add(_traj("g", 2))
    assert (buf.num_ready, buf.num_in_flight) == (0, 1)
    assert buf.pop_batch(learner_version=3, num_groups=1, max_staleness=0) == ([], 0)
    buf.add(_traj("g", 1))
    assert (buf.num_ready, buf.num_in_flight) == (1, 0)
    groups, stale = buf.pop_batch(3, 1, 0)
    assert stale == 0 and [s.sample_index for s in groups[0].samples] == [0, 1, 2]
    assert len(buf) == 0


def test_whole_groups_oldest_lease_first_and_never_a_partial_batch():
    buf = GroupBuffer()
    for g in ["a", "b", "c"]:
        buf.open_group(_item(g), now=0.0, lease_version=0)
    for g in ["c", "a"]:  # complete out of lease order
        for i in range(2):
            buf.add(_traj(g, i))
    assert buf.pop_batch(3, num_groups=3, max_staleness=0) == ([], 0)
    assert buf.num_ready == 2  # nothing was taken by the refused request
    groups, _ = buf.pop_batch(3, num_groups=2, max_staleness=0)
    assert [g.item.group_id for g in groups] == ["a", "c"]
    for i in range(2):
        buf.add(_traj("b", i))
    groups, _ = buf.pop_batch(3, num_groups=1, max_staleness=0)
    assert [g.item.group_id for g in groups] == ["b"]


@pytest.mark.parametrize(
    ("max_staleness", "version", "learner_version", "kept"),
    [
        (0, 5, 5, True),
        (0, 4, 5, False),
        (0, 6, 5, True),  # newer than the learner (a server already on the next version)
        (2, 3, 5, True),
        (2, 2, 5, False),
        (2, 5, 5, True),
    ],
)
def test_staleness_boundary(max_staleness, version, learner_version, kept):
    buf = GroupBuffer()
    _fill(buf, "g", version)
    groups, stale = buf.pop_batch(learner_version, 1, max_staleness)
    assert (len(groups), stale) == ((1, 0) if kept else (0, 1))
    assert len(buf) == 0  # a stale group is dropped, not kept for later


def test_oldest_sampled_token_decides_and_unsampled_tokens_do_not():
    buf = GroupBuffer()
    buf.open_group(_item("g"), now=0.0, lease_version=0)
    buf.add(_traj("g", 0, versions=(5, 5, 5)))
    # a two-segment sample: its first segment was sampled at version 4; tool tokens (mask 0)
    # carry no version
    buf.add(_traj("g", 1, versions=(4, 0, 5), mask=(1, 0, 1)))
    assert buf.pop_batch(learner_version=5, num_groups=1, max_staleness=0) == ([], 1)


def test_sample_without_sampled_tokens_counts_at_its_lease_version():
    no_tokens = _traj("g", 0, versions=(7, 7), mask=(0, 0))
    assert sample_version(no_tokens, lease_version=2) == 2
    buf = GroupBuffer()
    buf.open_group(_item("g", n=1), now=0.0, lease_version=2)
    buf.add(no_tokens)
    assert buf.pop_batch(learner_version=3, num_groups=1, max_staleness=0) == ([], 1)


def test_stale_groups_are_dropped_even_when_no_batch_is_served():
    buf = GroupBuffer()
    _fill(buf, "old", version=0)
    _fill(buf, "new", version=3)
    groups, stale = buf.pop_batch(learner_version=3, num_groups=2, max_staleness=1)
    assert (groups, stale) == ([], 1)
    assert buf.num_ready == 1


def test_duplicates_by_id_whatever_the_attempt_and_by_filled_slot():
    buf = GroupBuffer()
    buf.open_group(_item("g"), now=0.0, lease_version=0)
    t = _traj("g", 0)
    assert buf.add(t) == "accepted"
    assert buf.add(t) == "duplicate"
    assert buf.add(_traj("g", 0, attempt=3)) == "duplicate"  # a resend
    assert buf.add(_traj("g", 0, traj_id="other")) == "duplicate"  # slot already filled
    assert buf.add(_traj("g", 1)) == "accepted"
    groups, _ = buf.pop_batch(3, 1, 0)
    assert [s.traj_id for s in groups[0].samples] == ["g/0", "g/1"]


def test_late_for_unknown_consumed_or_expired_groups():
    buf = GroupBuffer()
    assert buf.add(_traj("never-leased", 0)) == "late"
    _fill(buf, "done", version=3)
    buf.pop_batch(3, 1, 0)
    assert buf.add(_traj("done", 0)) == "duplicate"  # a resend of a trained sample
    assert buf.add(_traj("done", 1, traj_id="fresh")) == "late"
    buf.open_group(_item("slow"), now=0.0, lease_version=0)
    buf.add(_traj("slow", 0))
    assert buf.expire(now=5.0, lease_timeout_s=10.0) == []
    assert [p.group_id for p in buf.expire(now=10.5, lease_timeout_s=10.0)] == ["slow"]
    assert buf.add(_traj("slow", 1)) == "late"
    assert len(buf) == 0


def test_expire_keeps_ready_groups():
    buf = GroupBuffer()
    _fill(buf, "ready", version=3)
    assert buf.expire(now=1e9, lease_timeout_s=1.0) == []
    assert buf.num_ready == 1


def test_forgotten_ids_never_let_a_trajectory_through_twice():
    buf = GroupBuffer(seen_ids_limit=1)
    buf.open_group(_item("g", n=3), now=0.0, lease_version=0)
    assert buf.add(_traj("g", 0)) == "accepted"
    assert buf.add(_traj("g", 1)) == "accepted"  # evicts "g/0" from the id record
    assert buf.add(_traj("g", 2, traj_id="g/0")) == "duplicate"  # still caught by its group


@pytest.mark.parametrize(
    "bad",
    [
        dict(versions=np.array([3], np.int32)),  # shorter than the response
        dict(loss_mask=np.array([2, 1], np.uint8)),
        dict(versions=np.array([-1, 3], np.int32)),  # sampled token without a version
        dict(behaviour_logprobs=np.array([np.nan, 0], np.float32)),
        dict(reward=float("nan")),
        dict(prompt_ids=np.zeros((2, 2), np.int32)),
        dict(traj_id=""),
    ],
)
def test_malformed_trajectories_are_refused(bad):
    buf = GroupBuffer()
    buf.open_group(_item("g"), now=0.0, lease_version=0)
    with pytest.raises(MalformedTrajectory):
        buf.add(dataclasses.replace(_traj("g", 0), **bad))
    assert buf.add(_traj("g", 0)) == "accepted"  # a refused message does not burn the id


def test_sample_index_outside_the_group_is_refused():
    buf = GroupBuffer()
    buf.open_group(_item("g", n=2), now=0.0, lease_version=0)
    with pytest.raises(MalformedTrajectory):
        buf.add(_traj("g", 2))


def test_to_batch_keeps_groups_consecutive_with_offsets():
    buf = GroupBuffer()
    buf.open_group(_item("a"), now=0.0, lease_version=0)
    buf.add(_traj("a", 1, versions=(3,)))
    buf.add(_traj("a", 0, versions=(3, 3, 3)))
    _fill(buf, "b", version=3)
    groups, _ = buf.pop_batch(3, 2, 0)
    batch = to_batch(request_id=9, groups=groups, stale_dropped=4)
    assert batch.traj_ids == ["a/0", "a/1", "b/0", "b/1"]
    assert batch.group_ids == ["a", "a", "b", "b"]
    assert batch.prompt_offsets.tolist() == [0, 3, 6, 9, 12]
    assert batch.response_offsets.tolist() == [0, 3, 4, 6, 8]
    assert batch.response_ids.tolist() == [10, 11, 12, 10, 10, 11, 10, 11]
    assert batch.versions.dtype == np.int32 and batch.loss_mask.dtype == np.uint8
    assert (batch.request_id, batch.stale_dropped) == (9, 4)


def test_capacity_back_pressure_with_admission():
    adm = AdmissionController(max_staleness=10, groups_per_batch=2, capacity_groups=3)
    buf = GroupBuffer()
    k = adm.grantable(0, wanted=5, held=len(buf))
    assert k == 3
    for i in range(k):
        buf.open_group(_item(f"g{i}"), now=0.0, lease_version=0)
    adm.on_issued(k)
    assert adm.grantable(0, 5, held=len(buf)) == 0  # full: the server waits
    for g in ["g0", "g1"]:
        for i in range(2):
            buf.add(_traj(g, i))
    assert adm.grantable(0, 5, held=len(buf)) == 0  # ready groups still hold capacity
    buf.pop_batch(3, 2, 10)
    assert adm.grantable(0, 5, held=len(buf)) == 2


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_random_schedule_keeps_the_invariants(max_staleness):
    """Leases from lagging servers, out-of-order samples, resends, version bumps, expiries, in
    random order: no returned sample is too stale, no trajectory is returned twice, and
    admission's count always equals groups trained plus groups held."""
    rng = random.Random(max_staleness)
    n, b = 2, 2
    adm = AdmissionController(max_staleness, groups_per_batch=b, capacity_groups=8)
    buf = GroupBuffer()
    learner_version, now, next_group, trained, dropped = 0, 0.0, 0, 0, 0
    pending: list[Trajectory] = []
    returned: list[str] = []
    for _ in range(3000):
        now += 1.0
        action = rng.random()
        if action < 0.2:
            server_version = max(0, learner_version - rng.randint(0, 2))
            k = adm.grantable(server_version, rng.randint(1, 3), held=len(buf))
            for _ in range(k):
                gid = f"g{next_group}"
                next_group += 1
                buf.open_group(_item(gid, n), now=now, lease_version=server_version)
                v = server_version + rng.randint(0, 1)
                pending += [_traj(gid, i, versions=(v, v + 1)) for i in range(n)]
            adm.on_issued(k)
        elif action < 0.7 and pending:
            t = pending.pop(rng.randrange(len(pending)))
            buf.add(t)
            if rng.random() < 0.2:  # lost ack: the sender tries again later
                pending.append(t)
        elif action < 0.9:
            groups, stale = buf.pop_batch(learner_version, b, max_staleness)
            adm.on_never_trained(stale)
            dropped += stale
            for g in groups:
                for s in g.samples:
                    assert learner_version - sample_version(s, g.lease_version) <= max_staleness
                    returned.append(s.traj_id)
            if groups:
                trained += len(groups)
                learner_version += 1
        else:
            adm.on_never_trained(len(buf.expire(now, lease_timeout_s=40.0)))
        assert adm.issued == trained + len(buf)
    assert trained >= 20, "the schedule must make progress"
    # synchronous RL: admission alone leaves nothing to drop; otherwise the check must bite
    assert dropped == 0 if max_staleness == 0 else dropped > 0
    assert len(returned) == len(set(returned))


def test_batch_carries_sample_metrics_with_nan_where_missing():
    buf = GroupBuffer()
    buf.open_group(_item("g", 2), now=0.0, lease_version=0)
    buf.add(_traj("g", 0, metrics={"turns": 2.0, "tool_calls": 1.0}))
    buf.add(_traj("g", 1, metrics={"turns": 1.0}))
    groups, _ = buf.pop_batch(learner_version=3, num_groups=1, max_staleness=2)
    batch = to_batch(7, groups, 0)
    assert batch.metric_names == ["tool_calls", "turns"]
    values = batch.metric_values.reshape(2, 2)
    assert values[0].tolist() == [1.0, 2.0]
    assert np.isnan(values[1, 0]) and values[1, 1] == 1.0


def test_in_flight_groups_are_counted_per_server():
    buf = GroupBuffer()
    for i, server in enumerate([0, 0, 1]):
        buf.open_group(_item(f"g{i}", n=1), 0.0, 0, server_id=server)
    assert (buf.in_flight_of(0), buf.in_flight_of(1), buf.in_flight_of(2)) == (2, 1, 0)
    assert buf.add(_traj("g0", 0)) == "accepted"  # complete: no longer in flight
    assert buf.expire(now=10.0, lease_timeout_s=1.0)  # g1 and g2 expire
    assert (buf.in_flight_of(0), buf.in_flight_of(1)) == (0, 0)
