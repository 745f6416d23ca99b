"""The rollout server's asyncio link to the replay: prompt leases out, trajectories in.

Invariant: a trajectory stays in the outbox until the replay acknowledges it (accepted,
duplicate or late all count as acknowledged). Unacknowledged trajectories are sent again with
the next attempt number after `ack_timeout_s`; the replay drops the duplicates, so a lost
reply or a restarted replay socket never loses or doubles a trajectory.

Liveness: every `heartbeat_s` the client sends a `Heartbeat` with its server id and epoch (its
restart count); the replay declares a server silent for `launch.server_timeout_s` dead
(`replay.health`). When the replay refuses a heartbeat (this epoch was declared dead, or a newer
one replaced it) the heartbeat task raises, and the server, which watches the client's tasks,
stops: the launcher restarts it, or has already.

Trajectories put in the same event-loop turn (a group's samples finish together) leave as one
`Trajectories` message, answered by one `Acks`: one header, signature and reply for the lot
instead of one each. Resends go one `Trajectory` at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import Counter, deque

import zmq
import zmq.asyncio

from asyncrl.config import LaunchConfig
from asyncrl.wire.auth import AuthError, RoleKey, role_epoch, server_index
from asyncrl.wire.bounds import MAX_TRAJECTORIES_PER_MESSAGE
from asyncrl.wire.protocol import (
    Ack,
    Error,
    GroupFailed,
    Heartbeat,
    LeaseGrant,
    LeaseRequest,
    PromptItem,
)
from asyncrl.wire.samples import Acks, Trajectories, Trajectory, packable
from asyncrl.wire.sockets import decode_signed, send_msg, setup_socket
from asyncrl.wire.validation import ProtocolError

log = logging.getLogger("asyncrl.rollout.replay_client")

MESSAGE_BYTES = 8 << 20
"""Trajectories sent together are split into messages of at most about this many array bytes,
and of half the replay's limit (`replay.max_message_mb`) where that is less."""

DEFAULT_HEARTBEAT_S: float = LaunchConfig.model_fields["heartbeat_s"].default


class AsyncReplayClient:
    def __init__(
        self,
        address: str,
        auth: RoleKey,
        ack_timeout_s: float,
        reply_timeout_s: float = 60.0,
        max_message_bytes: int = 64 << 20,
        server_id: int | None = None,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    ):
        """`server_id` (default: the index of `auth`'s `server_<i>` role; None for another
        role: no heartbeats) and the epoch of `auth`'s role (`server_<i>@<e>`: e, else 0; the
        replay takes a heartbeat's epoch only when that epoch's key signed it) are what the
        heartbeats carry; they leave every `heartbeat_s` (`launch.heartbeat_s`)."""
        self.auth = auth
        self.server_id = server_index(auth.role) if server_id is None else server_id
        self.epoch = role_epoch(auth.role)
        self.heartbeat_s = heartbeat_s
        self._heartbeat_ids: deque[int] = deque(maxlen=16)  # the latest heartbeats' request ids
        self._refused = asyncio.Event()  # the replay refused a heartbeat: this epoch is over
        self._ctx = zmq.asyncio.Context()
        self._sock = setup_socket(self._ctx, zmq.DEALER, connect=address)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.outbox: dict[str, tuple[Trajectory, float]] = {}  # traj_id -> (message, sent at)
        self.ack_timeout_s, self.reply_timeout_s = ack_timeout_s, reply_timeout_s
        # every counter present from the start: a server that never got a lease still reports 0
        self.counters: Counter[str] = Counter(
            dict.fromkeys(["sent", "acked", "resent", "ack_accepted", "errors", "heartbeats"], 0)
        )
        self._tasks: list[asyncio.Task] = []
        self._unsent: list[Trajectory] = []  # put in this event-loop turn, not yet sent
        self._sending: set[asyncio.Task] = set()
        self._part_bytes = min(MESSAGE_BYTES, max_message_bytes // 2)

    def start(self) -> list[asyncio.Task]:
        """Start the reply reader, the resender and (for a server) the heartbeat; the caller
        watches these tasks (the heartbeat's raises once the replay refuses it)."""
        self._tasks = [
            asyncio.create_task(self._read_replies(), name="replay-reader"),
            asyncio.create_task(self._resend_unacked(), name="replay-resender"),
        ]
        if self.server_id is not None:
            self._tasks.append(asyncio.create_task(self._heartbeat(), name="replay-heartbeat"))
        return self._tasks

    async def _heartbeat(self) -> None:
        assert self.server_id is not None
        while not self._refused.is_set():
            request_id = next(self._ids)
            self._heartbeat_ids.append(request_id)
            beat = Heartbeat(request_id, self.server_id, self.epoch)
            await send_msg(self._sock, beat, auth=self.auth)
            self.counters["heartbeats"] += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._refused.wait(), self.heartbeat_s)
        raise RuntimeError(
            f"the replay refused the heartbeat of server_{self.server_id} epoch {self.epoch}: "
            "it declared this epoch dead (silent for launch.server_timeout_s) or a newer epoch "
            "replaced it; stopping"
        )

    async def lease(
        self,
        server_id: int,
        version: int,
        max_groups: int,
        busy_s: float = 0.0,
        apply_s: float = 0.0,
        uptime_s: float = 0.0,
    ) -> list[PromptItem]:
        """Ask for up to max_groups prompts (the replay may hold the request, then answer).
        The cumulative engine-busy, weight-apply and uptime seconds ride along for metrics."""
        request_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        request = LeaseRequest(
            request_id, server_id, version, max_groups, busy_s, apply_s, uptime_s
        )
        await send_msg(self._sock, request, auth=self.auth)
        try:
            grant: LeaseGrant = await asyncio.wait_for(fut, self.reply_timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(
                f"replay did not answer a lease request within {self.reply_timeout_s}s"
            ) from None
        finally:
            self._waiting.pop(request_id, None)
        return grant.prompts

    async def group_failed(self, group_id: str, error: str) -> None:
        """Tell the replay this server could not sample the group (`GroupFailed`, its lease
        ends). Not waited for: if the message is lost, the lease expires instead
        (`replay.lease_timeout_s`)."""
        if self.server_id is None:
            raise ValueError("only a rollout server leases groups")
        msg = GroupFailed(next(self._ids), self.server_id, group_id, error[:500])
        await send_msg(self._sock, msg, auth=self.auth)
        self.counters["groups_reported_failed"] += 1

    async def put(self, traj: Trajectory) -> None:
        """Send a trajectory and keep it until acknowledged. The puts of one event-loop turn
        leave together, sent by the client itself (a putter cancelled meanwhile changes
        nothing); a failed send leaves them in the outbox, sent again after ack_timeout_s."""
        self.outbox[traj.traj_id] = (traj, time.monotonic())
        self.counters["sent"] += 1
        self._unsent.append(traj)
        if len(self._unsent) == 1:  # the turn's other callbacks run (and put) first
            asyncio.get_running_loop().call_soon(self._send_turn)

    def _send_turn(self) -> None:
        trajs, self._unsent = self._unsent, []
        task = asyncio.get_running_loop().create_task(self._send_all(trajs))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_all(self, trajs: list[Trajectory]) -> None:
        alone = [[t] for t in trajs if not packable(t)]  # the replay rejects it: on its own
        try:
            for part in _split([t for t in trajs if packable(t)], self._part_bytes) + alone:
                msg = part[0] if len(part) == 1 else Trajectories.pack(part)
                await send_msg(self._sock, msg, auth=self.auth)
        except Exception as e:  # a closed socket at shutdown, ...: the resender tries again
            self.counters["send_errors"] += 1
            log.error("sending trajectories failed (%s); they stay in the outbox", e)

    def _acknowledged(self, traj_id: str, status: str) -> None:
        if self.outbox.pop(traj_id, None) is None:
            return
        self.counters["acked"] += 1
        self.counters[f"ack_{status}"] += 1
        if status == "rejected":
            log.error("replay rejected trajectory %s as untrainable (see its log)", traj_id)

    async def _read_replies(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                msg = decode_signed(frames, self.auth)
            except AuthError as e:  # nothing this server sends can succeed: say so at once
                log.error("%s", e)
                for fut in self._waiting.values():
                    if not fut.done():
                        fut.set_exception(RuntimeError(str(e)))
                continue
            except ProtocolError as e:
                self.counters["bad_replies"] += 1
                log.error("undecodable reply from replay: %s", e)
                continue
            if isinstance(msg, Ack) and msg.traj_id:
                self._acknowledged(msg.traj_id, msg.status)
            elif isinstance(msg, Ack) and msg.request_id in self._heartbeat_ids:
                if msg.status == "rejected":
                    self._refused.set()
            elif isinstance(msg, Acks):
                for traj_id, status in zip(msg.traj_ids, msg.statuses, strict=True):
                    self._acknowledged(traj_id, status)
            elif isinstance(msg, LeaseGrant):
                waiter = self._waiting.get(msg.request_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(msg)
            elif isinstance(msg, Error):
                self.counters["errors"] += 1
                log.error("replay rejected a message: %s", msg.reason)

    async def _resend_unacked(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.ack_timeout_s / 2))
            now = time.monotonic()
            for traj_id, (traj, sent_at) in list(self.outbox.items()):
                if now - sent_at < self.ack_timeout_s or traj_id not in self.outbox:
                    continue
                again = dataclasses.replace(traj, attempt=traj.attempt + 1)
                self.outbox[traj_id] = (again, now)
                self.counters["resent"] += 1
                await send_msg(self._sock, again, auth=self.auth)

    async def drain(self, timeout_s: float) -> int:
        """Wait until everything sent is acknowledged (or timeout); returns what is left."""
        deadline = time.monotonic() + timeout_s
        while self.outbox and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(self.outbox)

    def close(self) -> None:
        for t in [*self._tasks, *self._sending]:
            t.cancel()
        self._sock.close(linger=0)
        self._ctx.term()


def _split(trajs: list[Trajectory], max_bytes: int) -> list[list[Trajectory]]:
    """Consecutive runs of `trajs`, each of at most `max_bytes` array bytes (or one sample) and
    MAX_TRAJECTORIES_PER_MESSAGE samples."""
    parts: list[list[Trajectory]] = [[]]
    size = 0
    for traj in trajs:
        # int32 prompt ids; per response token an id, a mask byte, a log-prob and a version
        n = 4 * len(traj.prompt_ids) + 13 * len(traj.response_ids)
        full = len(parts[-1]) == MAX_TRAJECTORIES_PER_MESSAGE
        if parts[-1] and (size + n > max_bytes or full):
            parts.append([])
            size = 0
        parts[-1].append(traj)
        size += n
    return [part for part in parts if part]
