"""`RewardModelClient`: a rollout server's asyncio link to the reward-model fleet
(`reward_models/`, started by the launcher with `reward.model.path`).

Responses scored in the same turn of the event loop (a group's samples finish together) leave
as one `ScoreRequest`, to the reward-model server with the fewest items in flight. Invariants:
- **Nothing hangs, nothing raises into an agent loop.** A response not scored within
  `timeout_s` of its first send scores 0.0 and is counted (`timeout`); one the reward model
  could not score (`Scores.errors`: a judge's answer without a score) scores 0.0 and is counted
  (`error`). Every `score` call returns.
- **Nothing is lost to a dead server.** A request not answered within `resend_s` is sent again,
  to the next server (the one it went to may be dead, or restarted on the same address). ZeroMQ
  also delivers what waited in a socket's queue once a restarted server is back. A slow model
  is not a dead one: the wait before a resend is at least `SLOW_REPLY_FACTOR` times the
  slowest recent reply (`reply_s`, decaying), so a judge that takes 30 s a request is not
  sent every request twice, which would double its load.
- **Nothing is scored twice into a trajectory.** Scoring is a pure function of an item, so a
  resent request is simply scored again; the first reply to a request id settles it and any
  later one is dropped (`late_replies`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass

import zmq
import zmq.asyncio

from asyncrl.wire.auth import AuthError, RoleKey
from asyncrl.wire.protocol import Error
from asyncrl.wire.reward_protocol import MAX_SCORE_ITEMS, ScoreItem, ScoreRequest, Scores
from asyncrl.wire.sockets import decode_signed, send_msg, setup_socket
from asyncrl.wire.validation import ProtocolError

log = logging.getLogger("asyncrl.rollout.reward_model")

REPLY_BYTES = 16 << 20  # a Scores reply is a few bytes per item: anything larger is refused
SLOW_REPLY_FACTOR = 3.0
"""A request is resent after max(resend_s, this x the slowest recent reply)."""
REPLY_DECAY = 0.9
"""Each reply moves `reply_s` to max(this reply, this factor x `reply_s`)."""


@dataclass
class _Request:
    items: list[ScoreItem]
    answers: list[asyncio.Future]  # one per item: (score, error)
    first_sent: float
    last_sent: float
    target: int  # the server it was last sent to
    sends: int = 1


class RewardModelClient:
    """Scores items on the reward-model servers at `addresses` (see the module docstring)."""

    def __init__(
        self, addresses: list[str], auth: RoleKey, timeout_s: float, resend_s: float
    ) -> None:
        if not addresses:
            raise ValueError("RewardModelClient needs at least one reward-model server address")
        self.auth, self.timeout_s, self.resend_s = auth, timeout_s, resend_s
        self.reply_s = 0.0  # the slowest recent reply (first send to answer), decaying
        self.counters: Counter[str] = Counter()
        self._ctx = zmq.asyncio.Context()
        self._socks = [setup_socket(self._ctx, zmq.DEALER, connect=a) for a in addresses]
        self._in_flight = [0] * len(addresses)  # items sent to each server, not yet answered
        self._ids = itertools.count(1)
        self._unsent: list[tuple[ScoreItem, asyncio.Future]] = []
        self._requests: dict[int, _Request] = {}
        self._tasks: list[asyncio.Task] = []
        self._sending: set[asyncio.Task] = set()

    def start(self) -> list[asyncio.Task]:
        """Start a reply reader per server and the resender (the caller watches them)."""
        self._tasks = [
            asyncio.create_task(self._read_replies(i), name=f"reward-model-reader-{i}")
            for i in range(len(self._socks))
        ]
        self._tasks.append(asyncio.create_task(self._resend(), name="reward-model-resender"))
        return self._tasks

    async def score(self, item: ScoreItem) -> tuple[float, str]:
        """(score, error) of one item: error is "" when the reward model scored it, else why
        the score is 0.0 (counted). Always returns, within about `timeout_s`."""
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self._unsent.append((item, answer))
        if len(self._unsent) == 1:  # the turn's other callers add theirs first
            asyncio.get_running_loop().call_soon(self._send_turn)
        return await answer

    def _send_turn(self) -> None:
        unsent, self._unsent = self._unsent, []
        for start in range(0, len(unsent), MAX_SCORE_ITEMS):
            part = unsent[start : start + MAX_SCORE_ITEMS]
            target = min(range(len(self._socks)), key=self._in_flight.__getitem__)
            now = time.monotonic()
            request = _Request([i for i, _ in part], [a for _, a in part], now, now, target)
            request_id = next(self._ids)
            self._requests[request_id] = request
            self._in_flight[target] += len(part)
            self.counters["requests"] += 1
            self.counters["items"] += len(part)
            self._spawn_send(request_id, request)

    def _spawn_send(self, request_id: int, request: _Request) -> None:
        msg = ScoreRequest(request_id, request.items)
        task = asyncio.get_running_loop().create_task(self._send(request.target, msg))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, target: int, msg: ScoreRequest) -> None:
        try:
            await send_msg(self._socks[target], msg, auth=self.auth)
        except Exception as e:  # a closed socket at shutdown, ...: the resender tries again
            self.counters["send_errors"] += 1
            log.error("sending a score request failed (%s); it will be resent", e)

    def _settle(self, request_id: int, results: list[tuple[float, str]]) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            self.counters["late_replies"] += 1  # answered already (a resend) or timed out
            return
        self._in_flight[request.target] -= len(request.items)
        self.counters["settled"] += len(request.items)  # once per item: `items` at the end
        if results and results[0][1] not in ("timeout", "closed"):  # a reply: how long it took
            took = time.monotonic() - request.first_sent  # (an answer to a resend may be
            # the first send's: the longer wait is the safe one to learn)
            self.reply_s = max(took, REPLY_DECAY * self.reply_s)
        for answer, (score, error) in zip(request.answers, results, strict=True):
            if error:  # timeout, closed, or the reward model's own reason (counted as error)
                self.counters[error if error in ("timeout", "closed") else "error"] += 1
            if not answer.done():
                answer.set_result((score, error))

    async def _read_replies(self, index: int) -> None:
        sock = self._socks[index]
        while True:
            frames = await sock.recv_multipart()
            try:
                msg = decode_signed(frames, self.auth, max_bytes=REPLY_BYTES)
            except (AuthError, ProtocolError) as e:
                self.counters["bad_replies"] += 1
                if self.counters["bad_replies"] <= 10:
                    log.error("reward-model server %d sent a reply we refuse: %s", index, e)
                continue
            if isinstance(msg, Error):
                self.counters["refused"] += 1
                if self.counters["refused"] <= 10:
                    log.error("reward-model server %d refused a request: %s", index, msg.reason)
                continue
            if not isinstance(msg, Scores):
                self.counters["bad_replies"] += 1
                continue
            request = self._requests.get(msg.request_id)
            if request is not None and len(msg.scores) != len(request.items):
                self.counters["bad_replies"] += 1
                log.error("reward-model server %d answered %d scores for %d items",
                          index, len(msg.scores), len(request.items))  # fmt: skip
                continue  # resent, then timed out: never a wrong score on a trajectory
            self._settle(msg.request_id, list(zip(msg.scores, msg.errors, strict=True)))

    async def _resend(self) -> None:
        """Every tick: time out what is past `timeout_s`, resend what is past `resend_s`."""
        tick = min(0.5, self.resend_s / 2, self.timeout_s / 2)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for request_id, request in list(self._requests.items()):
                if now - request.first_sent >= self.timeout_s:
                    self._settle(request_id, [(0.0, "timeout")] * len(request.items))
                    self.counters["requests_timed_out"] += 1
                elif now - request.last_sent >= max(
                    self.resend_s, SLOW_REPLY_FACTOR * self.reply_s
                ):
                    self._in_flight[request.target] -= len(request.items)
                    request.target = (request.target + 1) % len(self._socks)
                    self._in_flight[request.target] += len(request.items)
                    request.last_sent, request.sends = now, request.sends + 1
                    self.counters["resent"] += 1
                    self._spawn_send(request_id, request)

    def close(self) -> None:
        """Stop; a call still waiting scores 0.0, counted as `closed` (so once closed, every
        item sent has been settled: `items == settled`)."""
        for request_id in list(self._requests):
            self._settle(request_id, [(0.0, "closed")] * len(self._requests[request_id].items))
        for _, answer in self._unsent:
            if not answer.done():
                answer.set_result((0.0, "closed"))
        for t in [*self._tasks, *self._sending]:
            t.cancel()
        for sock in self._socks:
            with contextlib.suppress(zmq.ZMQError):
                sock.close(linger=0)
        self._ctx.term()
