"""A blocking client of the replay service (learner rank 0, the launcher, tests).

Rollout servers use the asyncio client in `rollout_servers.replay_client`; this one is for
callers that have nothing else to do while they wait. Replies are matched by request id, so a
late reply to an abandoned request is discarded rather than mistaken for the current one.
Requests are signed with this process's role key and replies checked with it (`asyncrl.auth`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import zmq

from asyncrl.auth import RoleKey
from asyncrl.protocol import (
    Ack,
    Batch,
    BatchRequest,
    CheckpointRequest,
    DeclareDead,
    Error,
    EvalPoll,
    EvalResults,
    EvalSubmit,
    PromptItem,
    ServerHealth,
    Stats,
    StatsRequest,
    VersionUpdate,
)
from asyncrl.transport import decode_signed, send_msg, setup_socket


class ReplayUnavailable(RuntimeError):
    """The replay did not answer in time."""


class _Reply(Protocol):
    """A reply of the replay, matched to its request by id."""

    @property
    def request_id(self) -> int: ...


_R = TypeVar("_R", bound=_Reply)


class ReplayClient:
    def __init__(
        self,
        address: str,
        auth: RoleKey,
        reply_timeout_s: float = 60.0,
        max_bytes: int = 1 << 30,
    ):
        self.auth = auth
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = setup_socket(self._ctx, zmq.DEALER, connect=address)
        self._ids = itertools.count(1)
        self.address, self.reply_timeout_s, self.max_bytes = address, reply_timeout_s, max_bytes

    def _request(self, make: Callable[[int], Any], reply_type: type[_R]) -> _R:
        request_id = next(self._ids)
        send_msg(self._sock, make(request_id), auth=self.auth)
        deadline = time.monotonic() + self.reply_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self._sock.poll(int(left * 1000)):
                break
            reply = decode_signed(self._sock.recv_multipart(), self.auth, self.max_bytes)
            if isinstance(reply, Error):
                raise RuntimeError(f"replay rejected {reply_type.__name__} request: {reply.reason}")
            if isinstance(reply, reply_type) and reply.request_id == request_id:
                return reply
        raise ReplayUnavailable(
            f"replay at {self.address} did not answer within {self.reply_timeout_s:.0f}s"
        )

    def fetch_batch(
        self, learner_version: int, num_groups: int, should_stop: Callable[[], bool] = lambda: False
    ) -> Batch | None:
        """Block until the replay hands over `num_groups` whole groups trainable at
        `learner_version`; None if `should_stop()` turns true while waiting."""
        stale = 0
        while not should_stop():
            batch = self._request(lambda i: BatchRequest(i, learner_version, num_groups), Batch)
            stale += batch.stale_dropped
            if batch.traj_ids:
                return dataclasses.replace(batch, stale_dropped=stale)
        return None

    def publish_version(self, version: int) -> None:
        self._request(lambda i: VersionUpdate(i, version), Ack)

    def submit_eval(self, job_id: str, prompts: list[PromptItem]) -> None:
        """Queue an evaluation job; servers sample its prompts before any training prompt."""
        self._request(lambda i: EvalSubmit(i, job_id, prompts), Ack)

    def poll_eval(self, job_id: str) -> EvalResults:
        return self._request(lambda i: EvalPoll(i, job_id), EvalResults)

    def checkpoint(self, path: str, version: int) -> None:
        """Ask the replay to save its whole state at `version` (the version last published)
        to `path`, for a learner checkpoint (`replay.checkpoint`); returns once it is written."""
        self._request(lambda i: CheckpointRequest(i, path, version), Ack)

    def declare_dead(self, server_id: int, epoch: int, reason: str) -> None:
        """Tell the replay that `epoch` of `server_id` is dead (learner rank 0, once it gave up
        on it in a weight sync): its leases are re-issued and the launcher restarts it."""
        self._request(lambda i: DeclareDead(i, server_id, epoch, reason[:500]), Ack)

    def stats(self) -> dict[str, float]:
        return self._request(lambda i: StatsRequest(i), Stats).counters

    def server_health(self) -> list[ServerHealth]:
        """Every rollout server the replay has heard a heartbeat from: its epoch, whether it
        is alive, how long it has been silent (`replay.health`)."""
        return self._request(lambda i: StatsRequest(i), Stats).servers

    def server_epochs(self) -> dict[int, int]:
        """server id -> the epoch (restart count) of every rollout server alive now; servers
        declared dead are left out (a restarted one is back with a higher epoch). One round
        trip (a stats request), cheap enough for every learner step."""
        return {s.server_id: s.epoch for s in self.server_health() if s.alive}

    def close(self) -> None:
        self._sock.close(linger=0)
