"""Giving up on a frozen server during a weight sync (`learner.sync_fleet`, `replay.health`):
which members the learner stops waiting for, and what the replay does when it declares one
dead (`DeclareDead`). The broadcast's side, with real processes and gloo, is in
`tests/integration/test_sync_rejoin.py`."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from asyncrl.config import Config
from asyncrl.wire.auth import role_key
from asyncrl.wire.protocol import DeclareDead, Heartbeat, LeaseRequest, ServerHealth
from asyncrl.wire.sockets import free_port
from learner.sync_fleet import SyncFleet, SyncFleetSpec
from replay.health import FleetHealth


def test_the_learner_declares_only_the_epoch_alive_dead():
    counters: Counter[str] = Counter()
    health = FleetHealth(30.0, counters)
    health.observe(0, 2, now=0.0)
    assert not health.declare(0, 1)  # an older epoch: the one alive is left alone
    assert not health.declare(1, 0)  # never heard from
    assert health.declare(0, 2) and health.epochs() == {}
    assert not health.declare(0, 2)  # already dead: counted once
    assert counters["servers_declared_dead_by_learner"] == 1
    assert counters["servers_declared_dead"] == 0  # that counter is for silence
    assert health.observe(0, 2, now=1.0)[0] == "refused"  # woken up, it is told to stop
    assert health.observe(0, 3, now=2.0)[0] == "replaced"  # its restart is alive again
    assert health.epochs() == {0: 3}


def test_the_replay_takes_back_the_leases_of_a_server_the_learner_declares_dead():
    from asyncrl.wire.auth import new_secret
    from asyncrl.wire.router import Peer
    from replay.service import setup_replay_service

    cfg = Config.model_validate(
        {"rollout": {"n": 2, "num_servers": 2}, "data": {"train_batch_size": 2}}
    )
    service = setup_replay_service(cfg, "inproc://test-give-up", None, secret=new_secret())
    try:
        servers = [Peer(f"s{i}".encode(), f"server_{i}") for i in range(2)]
        for i, peer in enumerate(servers):
            service._on_heartbeat(peer, Heartbeat(1, i, 0))
            service._on_lease_request(peer, LeaseRequest(2, i, 0, 1))
        assert service.buffer.in_flight_of(1) == 1
        learner = Peer(b"l", "learner")
        service._on_declare_dead(learner, DeclareDead(3, 1, 1, "a newer epoch than alive"))
        assert service.health.epochs() == {0: 0, 1: 0}  # not that epoch: nothing happened
        service._on_declare_dead(learner, DeclareDead(4, 1, 0, "silent for 10.2 s"))
        assert service.health.epochs() == {0: 0}
        assert service.buffer.in_flight_of(1) == 0  # its lease goes to the next that asks
        assert service.buffer.in_flight_of(0) == 1
        stats = service.stats()
        assert stats["servers_declared_dead_by_learner"] == 1
        assert stats["dead_server_leases"] == 1
    finally:
        service.close()


class _Replay:
    """The replay's report as `SyncFleet` asks for it."""

    def __init__(self) -> None:
        self.report: list[ServerHealth] = []
        self.fails = False

    def __call__(self) -> list[ServerHealth]:
        if self.fails:
            raise TimeoutError("replay at tcp://... did not answer within 60s")
        return list(self.report)


def test_the_members_given_up_are_the_silent_the_dead_and_the_replaced():
    replay = _Replay()
    spec = SyncFleetSpec(
        host="127.0.0.1",
        port=free_port(),
        num_servers=5,
        device=torch.device("cpu"),
        bucket_bytes=1 << 20,
        timeout_s=5.0,
        first_join_s=5.0,
        give_up_s=10.0,
    )
    fleet = SyncFleet(
        spec=spec, server_epochs=dict, learner_key=role_key(b"s" * 32, "learner"), health=replay
    )
    for key in [(0, 0), (1, 0), (2, 1), (3, 0), (4, 2)]:
        fleet.broadcaster.members[key] = None  # only the keys are read
    replay.report = [
        ServerHealth(0, 0, True, 9.9, 0),  # heard from lately (draining, receiving): waited for
        ServerHealth(1, 0, True, 10.0, 0),  # silent for the bound
        ServerHealth(2, 2, True, 0.0, 0),  # a newer epoch heartbeats: member epoch 1 is over
        ServerHealth(3, 0, False, 31.0, 0),  # declared dead by the replay
        ServerHealth(4, 1, False, 50.0, 0),  # an older epoch's entry: epoch 2 not heard yet
    ]
    given_up = fleet._silent_members()
    assert sorted(given_up) == [(1, 0), (2, 1), (3, 0)]
    assert "silent for 10.0 s" in given_up[(1, 0)]
    assert given_up[(2, 1)] == "epoch 2 replaces it"
    replay.fails = True  # no answer is no news: the op timeout still bounds the wait
    assert fleet._silent_members() == {}


def test_the_give_up_bound_must_outlast_a_heartbeat():
    Config.model_validate({"launch": {"heartbeat_s": 2.0, "sync_give_up_s": 2.5}})
    with pytest.raises(ValueError, match="launch.sync_give_up_s=2.0 must be longer than"):
        Config.model_validate({"launch": {"heartbeat_s": 2.0, "sync_give_up_s": 2.0}})
