"""The rollout server's asyncio link to the replay: prompt leases out, trajectories in.

Invariant: a trajectory stays in the outbox until the replay acknowledges it (accepted,
duplicate or late all count as acknowledged). Unacknowledged trajectories are sent again with
the next attempt number after `ack_timeout_s`; the replay drops the duplicates, so a lost
reply or a restarted replay socket never loses or doubles a trajectory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import Counter

import zmq
import zmq.asyncio

from asyncrl.auth import AuthError, RoleKey
from asyncrl.codec import ProtocolError
from asyncrl.protocol import Ack, Error, LeaseGrant, LeaseRequest, PromptItem, Trajectory
from asyncrl.transport import decode_signed, send_msg, setup_socket

log = logging.getLogger("asyncrl.rollout.replay_client")


class AsyncReplayClient:
    def __init__(
        self, address: str, auth: RoleKey, ack_timeout_s: float, reply_timeout_s: float = 60.0
    ):
        self.auth = auth
        self._ctx = zmq.asyncio.Context()
        self._sock = setup_socket(self._ctx, zmq.DEALER, connect=address)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.outbox: dict[str, tuple[Trajectory, float]] = {}  # traj_id -> (message, sent at)
        self.ack_timeout_s, self.reply_timeout_s = ack_timeout_s, reply_timeout_s
        # every counter present from the start: a server that never got a lease still reports 0
        self.counters: Counter[str] = Counter(
            dict.fromkeys(["sent", "acked", "resent", "ack_accepted", "errors"], 0)
        )
        self._tasks: list[asyncio.Task] = []

    def start(self) -> list[asyncio.Task]:
        """Start the reply reader and the resender; the caller watches these tasks."""
        self._tasks = [
            asyncio.create_task(self._read_replies(), name="replay-reader"),
            asyncio.create_task(self._resend_unacked(), name="replay-resender"),
        ]
        return self._tasks

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

    async def put(self, traj: Trajectory) -> None:
        """Send a trajectory and keep it until acknowledged."""
        self.outbox[traj.traj_id] = (traj, time.monotonic())
        self.counters["sent"] += 1
        await send_msg(self._sock, traj, auth=self.auth)

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
                if self.outbox.pop(msg.traj_id, None) is not None:
                    self.counters["acked"] += 1
                    self.counters[f"ack_{msg.status}"] += 1
                    if msg.status == "rejected":
                        log.error(
                            "replay rejected trajectory %s as untrainable (see its log)",
                            msg.traj_id,
                        )
            elif isinstance(msg, LeaseGrant):
                fut = self._waiting.get(msg.request_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
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
        for t in self._tasks:
            t.cancel()
        self._sock.close(linger=0)
        self._ctx.term()
