"""The rollout server's link to the reward-model fleet (`rollout_servers.rewards.model_client`),
against scripted reward-model servers on real ZeroMQ sockets: the calls of one event-loop turn
leave as one request; a server that does not answer has its request resent to the next one; a
reply to a request already settled is dropped, so nothing is scored twice; an unparsable item,
a reply of the wrong length and a fleet that never answers all score 0.0, are counted, and
every call returns."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import zmq
import zmq.asyncio

from asyncrl.wire.auth import Keyring, new_secret, role_key
from asyncrl.wire.protocol import ChatMessage
from asyncrl.wire.reward_protocol import ScoreItem, ScoreRequest, Scores
from asyncrl.wire.sockets import decode_frames, free_ports, send_msg, setup_socket, tcp_address
from rollout_servers.rewards.model_client import RewardModelClient

pytestmark = pytest.mark.integration

Reply = Callable[[ScoreRequest, int], list[Scores]]
"""What a scripted server answers to (request, how many it saw before): the replies it sends."""


def _by_length(request: ScoreRequest, _: int) -> list[Scores]:
    scores = [float(len(item.response)) for item in request.items]
    return [Scores(request.request_id, scores, [""] * len(scores))]


class ScriptedServer:
    """A reward-model server's socket: checks each request's signature, records it, answers
    as `reply` says."""

    def __init__(self, address: str, secret: bytes, reply: Reply = _by_length) -> None:
        self.keyring, self.reply = Keyring(secret, num_servers=2), reply
        self.ctx = zmq.asyncio.Context()
        self.sock = setup_socket(self.ctx, zmq.ROUTER, bind=address)
        self.requests: list[ScoreRequest] = []
        self.identities: list[bytes] = []  # the ROUTER identity each request came from
        self.delay_s = 0.0  # how long it "scores" each request before it answers
        self.task = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, auth, *frames = await self.sock.recv_multipart()
            role = self.keyring.verify(auth, frames)
            request = decode_frames(frames)
            seen = len(self.requests)
            self.requests.append(request)
            self.identities.append(identity)
            answers, key = self.reply(request, seen), self.keyring.key(role)
            if self.delay_s:  # each request "scored" on its own, as a batching server would
                asyncio.ensure_future(self._answer_later(answers, identity, key))
                continue
            for answer in answers:
                await send_msg(self.sock, answer, identity, auth=key)

    async def _answer_later(self, answers: list[Scores], identity: bytes, key) -> None:
        await asyncio.sleep(self.delay_s)
        for answer in answers:
            await send_msg(self.sock, answer, identity, auth=key)

    def close(self) -> None:
        self.task.cancel()
        self.sock.close(linger=0)
        self.ctx.term()


def _item(response: str) -> ScoreItem:
    return ScoreItem([ChatMessage("user", "2+2?")], response, "asyncrl/arith", "4")


def _setup(n: int, timeout_s: float = 5.0, resend_s: float = 1.0):
    secret = new_secret()
    addresses = [tcp_address("127.0.0.1", p) for p in free_ports(count=n)]
    client = RewardModelClient(addresses, role_key(secret, "server_0"), timeout_s, resend_s)
    client.start()
    return secret, addresses, client


async def test_the_calls_of_one_turn_leave_as_one_request_and_each_gets_its_score():
    secret, (address,), client = _setup(1)
    server = ScriptedServer(address, secret)
    try:
        results = await asyncio.gather(*(client.score(_item("x" * k)) for k in range(1, 6)))
        assert results == [(float(k), "") for k in range(1, 6)]
        assert len(server.requests) == 1 and len(server.requests[0].items) == 5
        assert client.counters["requests"] == 1 and client.counters["items"] == 5
    finally:
        client.close()
        server.close()


async def test_an_unanswered_request_is_resent_to_the_next_server_and_a_late_reply_dropped():
    """The first server holds its reply until the second has answered the resend: the item
    gets one score, the first server's late reply is counted and dropped."""
    secret, (a, b), client = _setup(2, timeout_s=10.0, resend_s=0.5)
    answered = asyncio.Event()
    late: list[Scores] = []

    def hold(request: ScoreRequest, _: int) -> list[Scores]:
        late.extend(_by_length(request, 0))
        return []

    def answer(request: ScoreRequest, seen: int) -> list[Scores]:
        answered.set()
        return [Scores(request.request_id, [7.0], [""])]

    first, second = ScriptedServer(a, secret, hold), ScriptedServer(b, secret, answer)
    try:
        assert await client.score(_item("abc")) == (7.0, "")
        assert client.counters["resent"] == 1 and answered.is_set()
        identity = first.identities[0]
        await send_msg(first.sock, late[0], identity, auth=None)  # unsigned: refused
        await send_msg(first.sock, late[0], identity, auth=first.keyring.key("server_0"))
        await _until(lambda: client.counters["late_replies"] == 1)  # signed, but settled
        assert client.counters["bad_replies"] == 1
        assert client.counters["items"] == client.counters["settled"] == 1  # scored once
    finally:
        client.close()
        first.close()
        second.close()


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


async def test_a_fleet_that_never_answers_scores_0_and_counts_a_timeout():
    secret, (address,), client = _setup(1, timeout_s=1.0, resend_s=0.3)
    server = ScriptedServer(address, secret, lambda request, seen: [])
    try:
        results = await asyncio.gather(client.score(_item("a")), client.score(_item("b")))
        assert results == [(0.0, "timeout"), (0.0, "timeout")]
        assert client.counters["timeout"] == 2 and client.counters["requests_timed_out"] == 1
        assert len(server.requests) >= 2  # resent (to the same, only, server)
        assert not client._requests  # nothing left waiting
    finally:
        client.close()
        server.close()


async def test_an_item_the_model_could_not_score_and_a_reply_of_the_wrong_length():
    secret, (address,), client = _setup(1, timeout_s=1.5, resend_s=5.0)

    def reply(request: ScoreRequest, seen: int) -> list[Scores]:
        if len(request.items) == 2:
            return [Scores(request.request_id, [1.0, 0.0], ["", "no score in the answer"])]
        return [Scores(request.request_id, [1.0, 2.0], ["", ""])]  # one item, two scores

    server = ScriptedServer(address, secret, reply)
    try:
        results = await asyncio.gather(client.score(_item("a")), client.score(_item("b")))
        assert results == [(1.0, ""), (0.0, "no score in the answer")]
        assert client.counters["error"] == 1
        assert await client.score(_item("c")) == (0.0, "timeout")  # never a wrong score
        assert client.counters["bad_replies"] == 1 and client.counters["timeout"] == 1
    finally:
        client.close()
        server.close()


async def test_close_settles_every_waiting_call():
    secret, (address,), client = _setup(1, timeout_s=30.0, resend_s=10.0)
    server = ScriptedServer(address, secret, lambda request, seen: [])
    try:
        waiting = asyncio.ensure_future(client.score(_item("a")))
        await _until(lambda: len(server.requests) == 1)
        client.close()
        assert await waiting == (0.0, "closed")
    finally:
        server.close()


async def test_a_slow_model_is_not_resent_every_request_once_its_pace_is_known():
    """A server that takes 0.5 s a request, against resend_s=0.2: the first request, before
    any reply was seen, is resent once (its second answer dropped as late); after that the
    client waits 3 x the slowest recent reply, and the next requests leave once each."""
    secret, (address,), client = _setup(1, timeout_s=10.0, resend_s=0.2)
    server = ScriptedServer(address, secret)
    server.delay_s = 0.5
    try:
        assert await client.score(_item("ab")) == (2.0, "")
        assert client.counters["resent"] >= 1 and client.reply_s >= 0.2
        resent = client.counters["resent"]
        for text in ("abc", "abcd", "abcde"):
            assert await client.score(_item(text)) == (float(len(text)), "")
        assert client.counters["resent"] == resent
    finally:
        client.close()
        server.close()
