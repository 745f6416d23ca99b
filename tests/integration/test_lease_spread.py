"""Lease spread through the real replay service and sockets: a server alone takes the whole
window; when a new version opens it, the first server to ask at that version gets only its
share while the other server (held at the old version) is asking; a server that stops asking
leaves the whole window to the one that asks; each batch reports how its groups spread."""

from __future__ import annotations

import pytest
import zmq
from replay_peers import ask, dealer, recv, running_replay, send
from replay_peers import trajectory as _traj

from asyncrl.config import Config
from asyncrl.wire.protocol import Ack, LeaseGrant, LeaseRequest, PromptItem, VersionUpdate
from asyncrl.wire.samples import Batch, BatchRequest

pytestmark = pytest.mark.integration

B = 4  # groups per batch; with max_staleness 0 the window is one batch


def _config(**replay: float) -> Config:
    return Config.model_validate(
        {
            "rollout": {"n": 2, "num_servers": 2, "max_concurrent_groups": 16},
            "data": {"train_batch_size": B},
            # held requests must outlive each step below
            "replay": {"max_staleness": 0, "wait_timeout_s": 30.0, **replay},
        }
    )


def _replies(sock: zmq.Socket, count: int) -> dict[int, list[PromptItem]]:
    """The next `count` lease grants on `sock`, by request id."""
    grants = [recv(sock) for _ in range(count)]
    assert all(isinstance(g, LeaseGrant) for g in grants)
    return {g.request_id: g.prompts for g in grants}


def _held(sock: zmq.Socket) -> None:
    assert not sock.poll(150), "the request must be held"


def _train(learner: zmq.Socket, version: int, *leased: tuple[int, list[PromptItem]]) -> Batch:
    """Complete the groups leased to each (server, prompts) at `version`; take them as a batch."""
    for server, prompts in leased:
        for p in prompts:
            for i in range(p.n):
                ack = ask(learner, _traj(p.group_id, i, version, server_id=server))
                assert isinstance(ack, Ack) and ack.status == "accepted"
    batch = ask(learner, BatchRequest(100 + version, version, B))
    assert isinstance(batch, Batch) and len(set(batch.group_ids)) == B
    return batch


def test_leases_spread_over_the_servers_that_ask():
    with (
        running_replay(_config()) as address,
        dealer(address) as s0,
        dealer(address) as s1,
        dealer(address) as learner,
    ):
        # version 0: server 0 asks alone and may take the whole window
        first = ask(s0, LeaseRequest(1, 0, 0, 8)).prompts
        assert len(first) == B
        send(s1, LeaseRequest(2, 1, 0, 8))
        _held(s1)  # the window of version 0 is spent
        send(s0, LeaseRequest(3, 0, 0, 8))
        _held(s0)
        batch = _train(learner, 0, (0, first))
        assert batch.fleet["batch_servers"] == 1 and batch.fleet["batch_top_server_frac"] == 1
        assert isinstance(ask(learner, VersionUpdate(4, 1)), Ack)

        # version 1: server 0 applies it first; server 1, held at version 0, still asks
        send(s0, LeaseRequest(5, 0, 1, 8))  # supersedes request 3
        grants = _replies(s0, 2)
        assert grants[3] == [] and len(grants[5]) == B // 2  # its share, not the window
        send(s0, LeaseRequest(6, 0, 1, 8))
        _held(s0)  # at its share while server 1 asks
        send(s1, LeaseRequest(7, 1, 1, 8))  # server 1 applied version 1: supersedes request 2
        grants1 = _replies(s1, 2)
        assert grants1[2] == [] and len(grants1[7]) == B // 2
        batch = _train(learner, 1, (0, grants[5]), (1, grants1[7]))
        assert batch.fleet["batch_servers"] == 2 and batch.fleet["batch_top_server_frac"] == 0.5
        assert isinstance(ask(learner, VersionUpdate(8, 2)), Ack)

        # version 2: server 1 no longer asks (say it is at its own limit): server 0, asking
        # alone, takes the whole window again
        send(s0, LeaseRequest(9, 0, 2, 8))  # supersedes request 6
        grants = _replies(s0, 2)
        assert grants[6] == [] and len(grants[9]) == B


def test_expired_leases_are_re_issued_across_the_servers_waiting():
    """Held requests answered when something frees the window (here: leases expire) get a
    share each, not all for the first in line."""
    with (
        running_replay(_config(lease_timeout_s=0.5)) as address,
        dealer(address) as s0,
        dealer(address) as s1,
    ):
        assert len(ask(s0, LeaseRequest(1, 0, 0, 8)).prompts) == B  # alone: the whole window
        send(s1, LeaseRequest(2, 1, 0, 8))
        send(s0, LeaseRequest(3, 0, 0, 8))
        _held(s1)
        # server 0's leases expire unfinished: both held requests share the freed window
        assert [len(_replies(sock, 1)[i]) for sock, i in ((s1, 2), (s0, 3))] == [B // 2] * 2
