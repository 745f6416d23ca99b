"""Held requests (`replay.held`): one typed queue per request kind, each superseded, timed out
and answered as the module docstring says, and answered as soon as an event that may free them
is counted (`Changes`); the replay's components as `setup_replay_components` wires them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from fake_trajectories import one_token_trajectory

from asyncrl.config import Config
from asyncrl.wire.protocol import Heartbeat, LeaseGrant, LeaseRequest, PromptItem
from asyncrl.wire.router import Peer
from asyncrl.wire.samples import Batch, BatchRequest
from replay.components import ReplayComponents, setup_replay_components
from replay.held import UNBLOCKING_EVENTS, Changes, HeldBatches, HeldLeases

SECRET = bytes(32)
A, B = Peer(b"a", "server_0"), Peer(b"b", "server_1")
LEARNER = Peer(b"l", "learner")


CONFIG = Config.model_validate(
    {
        "rollout": {"n": 2, "num_servers": 2, "max_concurrent_groups": 4},
        "data": {"train_batch_size": 2},
        "replay": {"max_staleness": 0},
    }
)
"""2 servers, groups of 2 samples, batches of 2 groups, strictly on-policy: a window of 2."""


def _parts() -> ReplayComponents:
    return setup_replay_components(CONFIG, SECRET)


class Outbox:
    """What a queue sent, to whom (the service's `_send`, recorded)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []

    def __call__(self, peer: Peer, msg: Any) -> None:
        self.sent.append((peer.identity, msg))

    def take(self) -> list[tuple[bytes, Any]]:
        sent, self.sent = self.sent, []
        return sent


def _fill(parts: ReplayComponents, item: PromptItem) -> None:
    """Both samples of `item`'s group, sampled at version 0 by server 0."""
    for i in range(item.n):
        traj = one_token_trajectory(item.group_id, i)
        assert parts.buffer.add(traj) == "accepted"


def test_every_unblocking_event_is_a_counter_the_replay_keeps():
    assert set(UNBLOCKING_EVENTS) <= set(_parts().counters)


def test_a_change_is_seen_once_and_only_an_unblocking_event_is_one():
    counters: Counter[str] = Counter()
    changes = Changes(counters)
    assert not changes.since_last_look()
    counters["empty_grants"] += 1  # an answer, not an event that frees anything
    assert not changes.since_last_look()
    counters["accepted"] += 1
    assert changes.since_last_look()
    assert not changes.since_last_look()
    counters["servers_declared_dead"] += 1
    assert changes.since_last_look()


def _held_lease(parts: ReplayComponents, out: Outbox) -> HeldLeases:
    """Server 0 took the whole window (2 groups at version 0): server 1's request is held."""
    held = HeldLeases(out, parts.counters, wait_s=1.0)
    held.grant_or_hold(A, LeaseRequest(1, 0, 0, 2), parts.leases, now=0.0)
    assert [(who, len(msg.prompts)) for who, msg in out.take()] == [(b"a", 2)]
    held.grant_or_hold(B, LeaseRequest(2, 1, 0, 2), parts.leases, now=0.0)
    assert len(held) == 1 and out.take() == []
    return held


@pytest.mark.parametrize(
    "server_id, identity",
    [(1, b"another identity"), (5, b"b"), (1, None)],
    ids=["same server", "same identity", "epoch over"],
)
def test_a_held_lease_request_is_superseded_by_server_or_identity(server_id, identity):
    parts, out = _parts(), Outbox()
    held = _held_lease(parts, out)
    held.supersede(0, b"nobody")  # neither its server nor its identity: it stays
    assert len(held) == 1
    held.supersede(server_id, identity)
    assert out.take() == [(b"b", LeaseGrant(2, []))] and len(held) == 0
    assert parts.counters["empty_grants"] == 1


def test_a_held_lease_request_is_answered_empty_at_its_deadline():
    parts, out = _parts(), Outbox()
    held = _held_lease(parts, out)
    assert held.earliest_deadline() == 1.0
    held.time_out(now=0.999)
    assert out.take() == [] and len(held) == 1
    held.time_out(now=1.0)
    assert out.take() == [(b"b", LeaseGrant(2, []))] and held.earliest_deadline() == float("inf")


def test_a_held_lease_request_is_granted_once_slots_are_freed():
    parts, out = _parts(), Outbox()
    held = _held_lease(parts, out)
    held.answer(parts.leases)
    assert out.take() == [] and len(held) == 1  # nothing changed: still nothing to grant
    parts.leases.reissue_server(0, "server_0 declared dead")  # its 2 slots are free
    held.answer(parts.leases)
    [(who, grant)] = out.take()
    assert who == b"b" and grant.request_id == 2 and len(grant.prompts) == 2 and len(held) == 0


def test_a_request_for_no_group_is_answered_at_once():
    parts, out = _parts(), Outbox()
    held = HeldLeases(out, parts.counters, wait_s=1.0)
    held.grant_or_hold(A, LeaseRequest(1, 0, 0, 0), parts.leases, now=0.0)
    assert out.take() == [(b"a", LeaseGrant(1, []))] and len(held) == 0
    assert parts.counters["empty_grants"] == 0  # answered, not an empty answer after a wait


def test_a_held_batch_request_tells_the_groups_dropped_as_stale_while_it_waited():
    parts, out = _parts(), Outbox()
    _fill(parts, parts.leases.grant(LeaseRequest(1, 0, 0, 1))[0])  # one group at version 0
    held = HeldBatches(out, parts.counters, wait_s=1.0)
    held.serve_or_hold(LEARNER, BatchRequest(7, 1, 2), parts.batches, now=0.0)
    assert out.take() == [] and len(held) == 1  # the group was too stale for version 1
    assert parts.counters["stale_dropped"] == 1 and parts.admission.issued == 0
    held.supersede(b"l")  # the learner asks again: the older request is answered empty
    [(who, empty)] = out.take()
    assert who == b"l" and isinstance(empty, Batch) and empty.request_id == 7
    assert empty.traj_ids == [] and empty.stale_dropped == 1
    assert parts.counters["empty_batches"] == 1


def test_a_held_batch_request_is_served_once_its_groups_are_ready():
    parts, out = _parts(), Outbox()
    items = parts.leases.grant(LeaseRequest(1, 0, 0, 2))
    held = HeldBatches(out, parts.counters, wait_s=1.0)
    held.serve_or_hold(LEARNER, BatchRequest(7, 0, 2), parts.batches, now=0.0)
    assert len(held) == 1
    for item in items:
        _fill(parts, item)
    held.answer(parts.batches)
    [(who, batch)] = out.take()
    assert who == b"l" and batch.request_id == 7 and len(batch.traj_ids) == 4
    assert batch.group_ids == [items[0].group_id] * 2 + [items[1].group_id] * 2
    assert batch.fleet["batch_servers"] == 1.0 and len(held) == 0
    assert parts.counters["batches_served"] == 1 and parts.counters["samples_served"] == 4


def test_the_service_answers_a_held_request_on_the_tick_after_the_change():
    from replay.service import setup_replay_service

    service = setup_replay_service(CONFIG, "inproc://test-held-tick", None, secret=SECRET)
    try:
        service._on_lease_request(A, LeaseRequest(1, 0, 0, 2))  # the whole window
        service._on_lease_request(B, LeaseRequest(2, 1, 0, 2))
        assert service.stats()["held_lease_requests"] == 1
        service.poll_once(0.0)
        assert service.stats()["held_lease_requests"] == 1  # nothing changed
        service._on_heartbeat(A, Heartbeat(3, 0, 0))
        service._on_heartbeat(A, Heartbeat(4, 0, 1))  # server 0 restarted: its leases go back
        assert service.stats()["held_lease_requests"] == 1  # answered by the loop, not here
        service.poll_once(0.0)
        stats = service.stats()
        assert stats["held_lease_requests"] == 0 and stats["leases_granted"] == 4
        assert stats["empty_grants"] == 0
    finally:
        service.close()
