"""Reading a sandboxed run's output pipes within bounds, and classifying how the run ended."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass, field

from rollout_servers.sandbox.config import _REAP_GRACE_S, _TAIL_BYTES, Status


@dataclass
class _Capture(asyncio.Protocol):
    """One output pipe: keeps the first `keep` bytes, counts the rest, and sets `flood` once the
    pipes sharing `budget` wrote more than it. Never buffers more than `keep` bytes."""

    keep: int
    budget: list[int]  # bytes the pipes of one run may still write before `flood` (shared)
    flood: asyncio.Event
    head: bytearray = field(default_factory=bytearray)
    dropped: int = 0
    tail: bytes = b""  # last bytes seen, for the MemoryError check
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    def data_received(self, data: bytes) -> None:
        room = max(self.keep - len(self.head), 0)
        self.head += data[:room]
        self.dropped += max(len(data) - room, 0)
        self.tail = (self.tail + data[-_TAIL_BYTES:])[-_TAIL_BYTES:]
        self.budget[0] -= len(data)
        if self.budget[0] < 0:
            self.flood.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()

    def text(self) -> str:
        text = self.head.decode("utf-8", errors="replace")
        return f"{text}\n... [truncated {self.dropped} bytes]" if self.dropped else text


async def _read_into(capture: _Capture, read_fd: int) -> asyncio.ReadTransport:
    """Feed the pipe `read_fd` to `capture` as data arrives; the transport owns the fd."""
    reader = os.fdopen(read_fd, "rb", buffering=0)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(lambda: capture, reader)
    return transport


async def _wait_closed(*captures: _Capture) -> None:
    """Wait for end-of-file on the pipes: everything that held them is dead by now."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(c.closed.wait() for c in captures)), _REAP_GRACE_S)


def _classify(ending: str, returncode: int | None, err_tail: bytes) -> tuple[Status, int | None]:
    """Status and exit code of a run. bwrap and the prelude's supervisor report a signal death
    as 128+N, so exit codes 129..192 of the code itself also read as signals."""
    if ending in ("timeout", "cpu"):
        return "timeout", None
    if ending == "oom":
        return "oom", None
    if ending == "flood" or returncode is None:
        return "killed", None
    signum = -returncode if returncode < 0 else None
    if 128 < returncode <= 128 + 64:
        signum = returncode - 128
    if signum is not None:
        return ("timeout" if signum == signal.SIGXCPU else "killed"), None
    if returncode == 0:
        return "ok", 0
    if returncode == 1 and err_tail.rstrip().rsplit(b"\n", 1)[-1].startswith(b"MemoryError"):
        return "oom", 1
    return "error", returncode
