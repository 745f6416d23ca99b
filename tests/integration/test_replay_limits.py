"""The replay against a client that would stall it and a server that would forge its epoch
(issue 30): per-role size limits before anything is decoded, evaluation jobs in parts, and
epochs bound to the keys the launcher hands out."""

from __future__ import annotations

import msgpack
import pytest
from replay_peers import KEYRING, ask, dealer, running_replay

from asyncrl.config import Config
from asyncrl.wire.auth import server_role
from asyncrl.wire.protocol import Ack, ChatMessage, Error, Heartbeat, PromptItem, StatsRequest
from asyncrl.wire.replay_client import ReplayClient

pytestmark = pytest.mark.integration


def _cfg(**replay: float) -> Config:
    return Config.model_validate({"rollout": {"num_servers": 2}, "replay": replay})


def test_a_clients_message_over_its_limit_is_refused_before_it_is_decoded():
    """The same undecodable 64 KiB is `oversized` from a client (limit 16 KiB: never decoded,
    its signature never computed) and `malformed` from a server (limit 64 MiB: decoded)."""
    junk = [msgpack.packb({"v": 1, "type": "eval_submit", "fields": "x" * 65536})]
    with running_replay(_cfg(max_client_message_mb=1 / 64)) as address, dealer(address) as sock:
        reply = ask(sock, junk, role="client")
        assert isinstance(reply, Error)
        assert reply.reason.startswith("oversized message") and "for a client" in reply.reason
        assert isinstance(ask(sock, junk, role="server_1"), Error)
        counters = ask(sock, StatsRequest(1), role="client").counters
        assert (counters["rejected_oversized"], counters["rejected_malformed"]) == (1, 1)


def test_an_evaluation_job_larger_than_a_clients_limit_arrives_in_parts():
    prompts = [
        PromptItem(f"j/{i}", 1, "d", [ChatMessage("user", "q" * 200)], "1", {}, eval_job="j")
        for i in range(300)
    ]
    with running_replay(_cfg(max_client_message_mb=1 / 64)) as address:
        client = ReplayClient(address, KEYRING.key("client"), reply_timeout_s=10.0)
        try:
            client.submit_eval("j", prompts, part_bytes=16000)
            results = client.poll_eval("j")
            stats = client.stats()
        finally:
            client.close()
    assert results.expected == 300 and stats["eval_jobs"] > 4  # one per part
    assert stats["rejected_oversized"] == 0 and stats["eval_jobs_held_mb"] > 0


def test_a_forged_epoch_cannot_lock_a_server_out_and_the_launchers_next_epoch_rejoins():
    """Server 0's own key can only speak for epoch 0; 2**31-1 is refused and changes nothing,
    and epoch 1, signed with the key the launcher hands that restart, replaces epoch 0."""
    with running_replay(_cfg()) as address, dealer(address) as sock:
        assert ask(sock, Heartbeat(1, 0, 0), role="server_0") == Ack(1, "", "ok")
        for role in ("server_0", server_role(0, 1)):  # its own key; next epoch's key, too far
            forged = ask(sock, Heartbeat(2, 0, 2**31 - 1), role=role)
            assert isinstance(forged, Error) and "may not speak for epoch" in forged.reason
        reply = ask(sock, StatsRequest(3), role="client")
        assert [(s.epoch, s.alive) for s in reply.servers] == [(0, True)]
        assert reply.counters["rejected_forbidden"] == 2
        assert ask(sock, Heartbeat(4, 0, 1), role=server_role(0, 1)) == Ack(4, "", "ok")
        reply = ask(sock, StatsRequest(5), role="client")
        assert [(s.epoch, s.alive) for s in reply.servers] == [(1, True)]
        assert reply.counters["server_epochs_replaced"] == 1
        old = ask(sock, Heartbeat(6, 0, 0), role="server_0")  # the replaced epoch is told so
        assert old == Ack(6, "", "rejected")


def test_an_evaluation_job_is_its_submitters_alone():
    """Another client (another ZeroMQ identity, the same client key) can neither poll a job
    nor add a part to it (red-team finding 4 of issue 30)."""
    prompts = [PromptItem(f"j/{i}", 1, "d", [], "1", {}, eval_job="j") for i in range(3)]
    with running_replay(_cfg()) as address:
        owner = ReplayClient(address, KEYRING.key("client"), reply_timeout_s=10.0)
        other = ReplayClient(address, KEYRING.key("client"), reply_timeout_s=10.0)
        try:
            owner.submit_eval("j", prompts)
            with pytest.raises(RuntimeError, match="another sender"):
                other.poll_eval("j")
            extra = [PromptItem("j/x", 1, "d", [], "1", {}, eval_job="j")]
            with pytest.raises(RuntimeError, match="another sender"):
                other.submit_eval("j", extra)
            assert owner.poll_eval("j").expected == 3
            assert owner.stats()["rejected_forbidden"] == 2
        finally:
            owner.close()
            other.close()
