"""A blocking client of the replay service (learner rank 0, the launcher, tests).

Rollout servers use the asyncio client in `rollout_servers.replay_client`; this one is for
callers that have nothing else to do while they wait. Replies are matched by request id, so a
late reply to an abandoned request is discarded rather than mistaken for the current one.
Requests are signed with this process's role key and replies checked with it (`asyncrl.wire.auth`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import msgpack
import zmq

from asyncrl.wire.auth import RoleKey
from asyncrl.wire.codec import BYTES_PER_NODE, count_nodes, encode
from asyncrl.wire.protocol import (
    Ack,
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
from asyncrl.wire.samples import Batch, BatchRequest
from asyncrl.wire.sockets import decode_signed, send_msg, setup_socket

EVAL_PART_BYTES = 120 * 1024
"""Most bytes one part of an evaluation job weighs on the wire: under the replay's default limit
for a client's message (`replay.max_client_message_mb`, 128 KiB), with room for the
authentication frame. That limit keeps any one message from holding the replay's loop for long
(decoding a prompt-heavy message costs up to ~0.7 s per MiB on a loaded CPU)."""

log = logging.getLogger("asyncrl.wire.replay_client")


def eval_parts(job_id: str, prompts: list[PromptItem], part_bytes: int) -> list[EvalSubmit]:
    """`prompts` as the parts of job `job_id`, each at most `part_bytes` on the wire and
    holding at most `part_bytes // BYTES_PER_NODE` values (the receiver's bound, `decode`);
    every part but the last says `more`. ValueError naming a prompt that alone weighs more."""
    parts: list[EvalSubmit] = []
    start, step = 0, max(1, len(prompts))
    while start < len(prompts) or not parts:
        chunk = prompts[start : start + step]
        part = EvalSubmit(2**31 - 1, job_id, chunk, more=start + len(chunk) < len(prompts))
        frames = encode(part)
        size = sum(len(f) for f in frames)
        # bytes standing for values: a part within both bounds weighs at most part_bytes
        size = max(size, count_nodes(msgpack.unpackb(frames[0]), 2**31) * BYTES_PER_NODE)
        if size <= part_bytes:
            parts.append(part)
            start += len(chunk)
        elif len(chunk) > 1:  # a smaller part, sized by what this one weighed
            step = max(1, min(len(chunk) - 1, int(len(chunk) * part_bytes / size * 0.9)))
        else:
            raise ValueError(
                f"evaluation prompt {chunk[0].group_id!r} alone weighs {size} bytes on the wire "
                f"(or holds {size // BYTES_PER_NODE} values), over the {part_bytes} bytes of one "
                "part (replay.max_client_message_mb)"
            )
    return parts


def _numbered(part: EvalSubmit, request_id: int) -> EvalSubmit:
    return dataclasses.replace(part, request_id=request_id)


class BatchWaitTimeout(RuntimeError):
    """The learner waited `trainer.batch_wait_timeout_s` for a batch that never came."""


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
        self,
        learner_version: int,
        num_groups: int,
        should_stop: Callable[[], bool] = lambda: False,
        give_up_s: float = 0.0,
        report_every_s: float = 300.0,
    ) -> Batch | None:
        """Block until the replay hands over `num_groups` whole groups trainable at
        `learner_version`; None if `should_stop()` turns true while waiting. Every
        `report_every_s` of waiting the replay's counters are logged; after `give_up_s`
        (0: never) a `BatchWaitTimeout` names them: every process alive but no batch coming
        (no trajectory arriving, or none the bound lets through) is a stuck run, not a slow one."""
        stale, started = 0, time.monotonic()
        reported = started
        while not should_stop():
            batch = self._request(lambda i: BatchRequest(i, learner_version, num_groups), Batch)
            stale += batch.stale_dropped
            if batch.traj_ids:
                return dataclasses.replace(batch, stale_dropped=stale)
            now = time.monotonic()
            if give_up_s and now - started >= give_up_s:
                raise BatchWaitTimeout(
                    f"no batch for version {learner_version} in {now - started:.0f} s "
                    f"(trainer.batch_wait_timeout_s={give_up_s:g}); replay: {self._counts()}"
                )
            if now - reported >= report_every_s:
                reported = now
                log.warning(
                    "waiting %.0f s for a batch for version %d; replay: %s",
                    now - started,
                    learner_version,
                    self._counts(),
                )
        return None

    def _counts(self) -> str:
        """The replay's counters in one line (or why they could not be read)."""
        try:
            counts = self.stats()
        except (RuntimeError, zmq.ZMQError) as e:
            return f"(its stats did not come: {e})"
        return ", ".join(f"{k}={v:g}" for k, v in sorted(counts.items()))

    def publish_version(self, version: int) -> None:
        self._request(lambda i: VersionUpdate(i, version), Ack)

    def submit_eval(
        self, job_id: str, prompts: list[PromptItem], part_bytes: int = EVAL_PART_BYTES
    ) -> None:
        """Queue an evaluation job, in parts of at most `part_bytes` (`eval_parts`); servers
        sample its prompts before any training prompt."""
        for part in eval_parts(job_id, prompts, part_bytes):
            self._request(functools.partial(_numbered, part), Ack)

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
