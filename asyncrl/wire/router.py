"""An authenticated ZeroMQ ROUTER service that no message can stop: the socket of every
service a run's processes talk to (the replay, `replay.service`; the reward-model servers,
`reward_models.server`). A service subclasses `RouterService`, fills `_handlers` and drives the
socket from its own loop (`_receive` each tick; `asyncrl.wire.serve` runs that loop until the
process is told to stop); the rules of who may send what are its `Access` (`replay.access`).

`RouterService` owns the socket, the run's keyring and the counters, and takes every message to
exactly one outcome:

    handled                    a handler took it (and answered, now or later)
    rejected_malformed         it does not decode: framing, header, a field's type or range
    rejected_oversized         larger than its role's limit (the replay's: `replay.max_message_mb`,
                               `replay.max_client_message_mb` for a client), measured on the
                               raw frames before the signature is checked or anything decoded
    rejected_unauthenticated   no valid authentication frame (`asyncrl.wire.auth`); answered with
                               an unsigned Error and nothing else
    rejected_unexpected        a type this service does not accept
    rejected_forbidden         its role may not send it (the service's `Access`), or it
                               asks for something outside the run (a checkpoint path)
    rejected_invalid           it decoded but cannot be done (an unknown job, an untrainable
                               trajectory, ...); set by the handler through `_reject`
    rejected_quota             over a per-peer quota
    handler_errors             the handler raised: a bug, logged with the message type and
                               answered with Error; the loop goes on

so `received` is always the sum of the others (`accounted`); a message is counted once it is
done with, so a `Stats` reply does not count the request it answers. Replies are signed with the
key of the role that asked.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from asyncrl.wire.auth import AuthError, RoleKey, role_kind
from asyncrl.wire.codec import encode
from asyncrl.wire.protocol import Error
from asyncrl.wire.sockets import decode_frames, send_msg, setup_socket
from asyncrl.wire.validation import ProtocolError

OUTCOMES = (
    "handled",
    "rejected_malformed",
    "rejected_oversized",
    "rejected_unauthenticated",
    "rejected_unexpected",
    "rejected_forbidden",
    "rejected_invalid",
    "rejected_quota",
    "handler_errors",
)
"""The counters one received message ends in, exactly one of them (see the module docstring)."""
POLL_INTERVAL_S = 0.1
"""The longest a service's loop waits for a message, so a stop request is seen within it."""
MAX_MESSAGES_PER_TICK = 1000
"""Messages handled in one tick (`RouterService._receive`), before the service's own work."""


@dataclass(frozen=True)
class Peer:
    """The sender of one message: its ROUTER identity and the role that signed it (None: it
    could not be authenticated, so replies to it are unsigned errors)."""

    identity: bytes
    role: str | None


class Access(Protocol):
    """A service's rules for one run: who signed a message, whether it may send it, and the
    key a reply to it is signed with (the replay's: `replay.access.AccessRules`)."""

    def authenticate(self, auth_frame: bytes, frames: Sequence[bytes | memoryview]) -> str:
        """The role whose key signed `frames`; AuthError if none did."""
        ...

    def forbidden(self, role: str, msg: Any) -> str:
        """Why `role` may not send `msg` ("" when it may)."""
        ...

    def key(self, role: str) -> RoleKey:
        """The key a reply to `role` is signed with."""
        ...


def accounted(counters: dict[str, float]) -> bool:
    """Whether every message received ended in exactly one outcome counter."""
    return counters["received"] == sum(counters[k] for k in OUTCOMES)


class RouterService:
    """A bound ROUTER that authenticates, decodes, authorizes and dispatches (see above)."""

    def __init__(
        self,
        address: str,
        access: Access,
        max_bytes: dict[str, int],
        allow_remote: bool,
        counters: Counter[str],
        name: str = "the replay",
        logger: logging.Logger | None = None,
    ) -> None:
        """`max_bytes`: the largest message (all its frames) each kind of role may send
        (learner, server, client); a message is held to the limit of the role its
        authentication frame names, before anything else is done with it. `name` says who
        refuses in an Error's reason; `logger` is the service's (rejections, bugs)."""
        self.access = access
        self.name = name
        self.log = logger or logging.getLogger("asyncrl.wire.router")
        self.max_bytes = max_bytes
        largest = max(max_bytes.values())
        self.counters = counters
        self._handlers: dict[type, Callable[[Peer, Any], None]] = {}
        self._rejected = False  # the message being handled was rejected (counted as such)
        self._peer, self._kind = Peer(b"", None), "message"  # the message being handled
        self._size = 0  # its bytes on the wire (all frames after the identity)
        self._ctx = zmq.Context()
        # a frame up to twice the limit is read and answered "oversized"; for a larger one
        # ZeroMQ drops the peer's connection before buffering it (without this a forged 1.5 GB
        # frame was read whole before our size check: +2.9 GB RSS)
        self._sock = setup_socket(
            self._ctx,
            zmq.ROUTER,
            bind=address,
            allow_remote=allow_remote,
            max_frame_bytes=2 * largest,
        )

    def close(self, linger_ms: int = 100) -> None:
        self._sock.close(linger=linger_ms)
        self._ctx.term()

    def _receive(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a message, then handle those waiting, at most
        `MAX_MESSAGES_PER_TICK`; whether any arrived."""
        if not self._sock.poll(math.ceil(timeout_s * 1000)):
            return False
        for _ in range(MAX_MESSAGES_PER_TICK):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._handle(frames)
        return True

    def _handle(self, frames: list[zmq.Frame]) -> None:
        """One message, to exactly one outcome counter (see the module docstring)."""
        self._rejected = False
        self._peer, self._kind = Peer(frames[0].bytes if frames else b"", None), "message"
        try:
            self._dispatch(frames[1:])
        except Exception:  # a bug in the service: counted, logged, answered; the loop goes on
            self.counters["handler_errors"] += 1
            if self.counters["handler_errors"] <= 10:
                self.log.exception("BUG: handling a %s message raised", self._kind)
            reason = f"internal error handling {self._kind} (logged)"
            with contextlib.suppress(Exception):  # a courtesy; the count is what matters
                self._send(self._peer, Error(reason=reason))
        else:
            if not self._rejected:
                self.counters["handled"] += 1
        # counted with its outcome, so any snapshot (a Stats reply included) adds up
        self.counters["received"] += 1

    def _dispatch(self, body: list[zmq.Frame]) -> None:
        """Authenticate, decode, authorize and handle (`self._peer` and `self._kind` say who
        sent what, as far as known, should it raise)."""
        peer = self._peer
        if len(body) < 2:  # an authentication frame and a header at least
            self._reject(peer, "rejected_unauthenticated", "no authentication frame")
            return
        size, (kind, limit) = sum(len(f) for f in body), self._limit(body[0].bytes)
        self._size = size
        if size > limit:  # before the signature is computed over it, or anything decoded
            reason = f"oversized message: {size} bytes > limit {limit} for a {kind}"
            self._reject(peer, "rejected_oversized", reason)
            return
        try:
            role = self.access.authenticate(body[0].bytes, [f.buffer for f in body[1:]])
        except AuthError as e:
            self._reject(peer, "rejected_unauthenticated", f"not authenticated: {e}")
            return
        peer = self._peer = Peer(peer.identity, role)
        try:
            msg = decode_frames([f.bytes for f in body[1:]], max_bytes=limit)
        except ProtocolError as e:
            self._reject(peer, "rejected_malformed", str(e))
            return
        kind = self._kind = type(msg).TYPE
        handler = self._handlers.get(type(msg))
        if handler is None:
            self._reject(peer, "rejected_unexpected", f"{self.name} does not accept {kind!r}")
        elif reason := self.access.forbidden(role, msg):
            self._reject(peer, "rejected_forbidden", reason)
        else:
            handler(peer, msg)

    def _limit(self, auth_frame: bytes) -> tuple[str, int]:
        """(role kind, size limit) for the role `auth_frame` names; a frame that names none
        gets the smallest limit (it will fail authentication anyway, unless it is small)."""
        claimed = auth_frame.partition(b":")[0].decode("ascii", "replace")
        try:
            kind = role_kind(claimed)
        except ValueError:
            return "sender", min(self.max_bytes.values())
        return kind, self.max_bytes[kind]

    def _send(self, peer: Peer, msg: Any) -> None:
        """Reply to `peer`, signed with the key of its role (unsigned if it has none)."""
        if peer.role is None:
            self._sock.send_multipart([peer.identity, b"", *encode(msg)], copy=False)
        else:
            send_msg(self._sock, msg, peer.identity, auth=self.access.key(peer.role))

    def _reject(self, peer: Peer, counter: str, reason: str, reply: bool = True) -> None:
        reason = reason if len(reason) <= 500 else reason[:500] + "..."  # it echoes sender input
        self._rejected = True
        self.counters[counter] += 1
        n = self.counters[counter]
        if n <= 10 or n % 1000 == 0:  # enough to diagnose, never a flood
            self.log.warning("rejected message #%d (%s): %s", n, counter, reason)
        if peer.identity and reply:
            self._send(peer, Error(reason=reason))
