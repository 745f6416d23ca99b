"""The fuzzer's side of the sockets: many DEALER identities, a window of unanswered messages,
and a count of every answer.

The replay answers every message exactly once (a reply, an `Ack`, or an `Error`; a held lease or
batch request at the latest after `replay.wait_timeout_s`), so the fuzzer never waits on one
message: it keeps at most `window` messages unanswered across all its sockets, collects answers
as they come, and writes off a message left unanswered for `answer_timeout_s` (counted: a
written-off message is a finding, the service broke its promise to answer). Answers are counted,
not matched to their messages; a message whose handling the replay reported as raising is
`forget`-ten at once.

Hooks (for an authenticated protocol, see `auth_hooks`): `prepare(frames) -> frames` is applied
to every message of the campaign's own (sign it), `fuzz_prepare` to every fuzz message (sign it,
or fuzz the signature), `unwrap(frames) -> frames` to every answer before it is decoded (check
and strip the replay's signature).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import zmq

from asyncrl.wire.codec import decode, encode
from asyncrl.wire.validation import ProtocolError

Frames = list[bytes]
Hook = Callable[[Frames], Frames]


def digest(frames: Frames) -> bytes:
    """A short digest of a message's frames (how a crash report is matched to its case)."""
    h = hashlib.blake2b(digest_size=16)
    for f in frames:
        h.update(len(f).to_bytes(8, "little"))
        h.update(f)
    return h.digest()


def identity_hook(frames: Frames) -> Frames:
    return frames


def reply_name(msg: Any) -> str:
    """How answers are counted: the message type, and an Ack's status."""
    return f"ack_{msg.status}" if msg.TYPE == "ack" else msg.TYPE


class Clients:
    """DEALER sockets with distinct identities, one window of unanswered messages."""

    def __init__(
        self,
        address: str,
        sockets: int,
        window: int,
        answer_timeout_s: float,
        prepare: Hook = identity_hook,
        fuzz_prepare: Hook = identity_hook,
        unwrap: Hook = identity_hook,
        on_reply: Callable[[Any], None] | None = None,
    ) -> None:
        self.address, self.window, self.answer_timeout_s = address, window, answer_timeout_s
        self.prepare, self.fuzz_prepare, self.unwrap = prepare, fuzz_prepare, unwrap
        self.on_reply = on_reply
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.pending: dict[zmq.Socket, deque[tuple[float, bytes, Any]]] = {}
        self.sent_on: dict[bytes, zmq.Socket] = {}  # digest -> socket, of recent messages
        self._made = 0
        self.sent = 0
        self.answered = 0
        self.unanswered: list[Any] = []  # tags of written-off messages
        self.replies: Counter[str] = Counter()
        for _ in range(sockets):
            self._open()
        self.control = self._socket(b"fuzz-control")

    # ---- sockets --------------------------------------------------------------------------
    def _socket(self, identity: bytes) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.connect(self.address)
        return sock

    def _open(self, rng: random.Random | None = None) -> None:
        self._made += 1
        identity = b"fuzz-%d" % self._made
        if rng is not None and rng.random() < 0.5:  # any bytes but a leading 0 (zmq reserves it)
            identity = bytes([rng.randrange(1, 256)]) + rng.randbytes(rng.randrange(255))
        sock = self._socket(identity)
        self.pending[sock] = deque()
        self.poller.register(sock, zmq.POLLIN)

    def recycle(self, rng: random.Random) -> None:
        """Replace one idle socket (nothing unanswered) by one with a new identity."""
        idle = [sock for sock, queue in self.pending.items() if not queue]
        if not idle:
            return
        sock = rng.choice(idle)
        del self.pending[sock]
        self.poller.unregister(sock)
        sock.close()
        self._open(rng)

    @property
    def outstanding(self) -> int:
        return sum(len(q) for q in self.pending.values())

    # ---- traffic --------------------------------------------------------------------------
    @property
    def full(self) -> bool:
        return self.outstanding >= self.window

    def send(self, frames: Frames, tag: Any, rng: random.Random) -> bytes:
        """Send on a random socket (the caller waits for room in the window first); the digest
        of the frames as sent (`prepare`d: as the replay receives them)."""
        sock = rng.choice(list(self.pending))
        frames = self.fuzz_prepare(frames)
        sock.send_multipart(frames, copy=sum(len(f) for f in frames) < 65536)
        key = digest(frames)
        self.pending[sock].append((time.monotonic(), key, tag))
        self.sent_on[key] = sock
        if len(self.sent_on) > 8192:
            del self.sent_on[next(iter(self.sent_on))]
        self.sent += 1
        return key

    def forget(self, key: bytes) -> bool:
        """Stop waiting for the answer to the message of digest `key` (the replay reported
        that handling it raised: no answer will come). Answers are counted, not matched: if
        that message's entry already went to a later message's answer, the oldest entry of
        its socket goes instead."""
        sock = self.sent_on.get(key)
        queue = self.pending.get(sock) if sock is not None else None
        if not queue:
            return False
        entry = next((e for e in queue if e[1] == key), queue[0])
        queue.remove(entry)
        return True

    def collect(self, timeout_s: float = 0.0) -> int:
        """Take every answer that arrives within `timeout_s` (at least those ready now)."""
        got = 0
        for sock, _ in self.poller.poll(int(timeout_s * 1000)):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._count(frames)
                if self.pending[sock]:
                    self.pending[sock].popleft()
                got += 1
        return got

    def _count(self, frames: Frames) -> None:
        self.answered += 1
        try:
            msg = decode(self.unwrap(frames))
        except (ProtocolError, IndexError):
            self.replies["undecodable"] += 1
            return
        self.replies[reply_name(msg)] += 1
        if self.on_reply is not None:
            self.on_reply(msg)

    def write_off(self, older_than_s: float | None = None) -> list[Any]:
        """Give up on messages unanswered for longer than `older_than_s` (default:
        `answer_timeout_s`); their tags."""
        limit = time.monotonic() - (self.answer_timeout_s if older_than_s is None else older_than_s)
        gone = []
        for queue in self.pending.values():
            while queue and queue[0][0] < limit:
                gone.append(queue.popleft()[2])
        self.unanswered += gone
        return gone

    def drain(self, quiet_s: float, timeout_s: float) -> None:
        """Wait for every unanswered message, until none is left, or no answer came for
        `quiet_s`, or `timeout_s` passed."""
        now = time.monotonic()
        deadline, last = now + timeout_s, now
        while self.outstanding and now < deadline and now - last < quiet_s:
            if self.collect(0.05):
                last = time.monotonic()
            now = time.monotonic()

    def ask(self, msg: Any, timeout_s: float) -> Any | None:
        """Send `msg` on the control socket and wait for its answer: the reply that carries its
        request id (or its trajectory id), or an Error. None: none in time. Answers to earlier
        questions that come late are counted and skipped."""
        self.control.send_multipart(self.prepare([bytes(f) for f in encode(msg)]))
        self.sent += 1
        deadline = time.monotonic() + timeout_s
        while self.control.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            frames = self.control.recv_multipart()
            self._count(frames)
            try:
                reply = decode(self.unwrap(frames))
            except (ProtocolError, IndexError):
                continue
            if _answers(reply, msg):
                return reply
        return None

    def close(self) -> None:
        for sock in [*self.pending, self.control]:
            sock.close()
        self.ctx.term()


def _answers(reply: Any, msg: Any) -> bool:
    if reply.TYPE == "error":
        return True
    if reply.TYPE == "ack" and msg.TYPE == "trajectory":
        return reply.traj_id == msg.traj_id
    return getattr(reply, "request_id", None) == getattr(msg, "request_id", None)
