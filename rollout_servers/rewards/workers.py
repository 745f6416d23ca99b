"""The reward computer's worker processes: plain `python -c` subprocesses speaking JSON over a
private socketpair (`RewardComputer` drives them; `computer.worker_main` is what they run).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

FnRef = tuple[str, str, str]
"""How a worker finds a function: ("module", module, qualname) or ("path", file, name)."""

_BOOT_TIMEOUT_S = 60.0
"""A worker that has not said "ready" by then (interpreter start plus imports) is broken."""
_WORKER_BOOT = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
    "from rollout_servers.rewards.computer import worker_main; worker_main(int(sys.argv[2]))"
)


def _send(conn: Connection, obj: Any) -> None:
    """JSON frames only: nothing read from a socket is ever unpickled (DESIGN.md), and reward
    arguments and results are JSON by nature (strings, numbers, JSON-decoded extra_info)."""
    conn.send_bytes(json.dumps(obj, allow_nan=True).encode())


def _recv(conn: Connection) -> Any:
    return json.loads(conn.recv_bytes())


class _Worker:
    """One worker process and its socket. A pool thread uses it for one call at a time; `stop`
    may come from any thread (close), hence the lock.

    Workers are plain `python -c` subprocesses, not multiprocessing children: those re-import
    the host's `__main__` (slow, and side effects in scripts without a main guard), and fork
    would copy the rollout server's threads and CUDA state. A start costs ~0.1 s, off the loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._retired = False

    def start(self) -> bool:
        """Start the process unless it runs; False once the worker is retired."""
        with self._lock:
            if self._retired:
                return False
            if self._proc is None:
                mine, theirs = socket.socketpair()
                with theirs:
                    self._proc = subprocess.Popen(
                        [
                            sys.executable,
                            "-c",
                            _WORKER_BOOT,
                            json.dumps(sys.path),
                            str(theirs.fileno()),
                        ],
                        pass_fds=(theirs.fileno(),),
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,  # a terminal's Ctrl-C is the parent's to handle
                    )
                self._conn = Connection(mine.detach())
                self._ready = False
            return True

    def call_many(self, items: list[tuple[FnRef, dict[str, Any]]], timeout_s: float) -> list:
        """One result per item, in order: ("ok", score, extras) | (failure kind, detail, {});
        never raises. An item past `timeout_s` (or whose run kills the worker) fails alone: the
        worker is replaced and the items after it are sent again."""
        results: list[tuple[Any, ...] | None] = [None] * len(items)
        encoded: list[tuple[int, str]] = []
        for i, item in enumerate(items):
            try:  # an item that cannot be encoded fails before any byte is written
                encoded.append((i, json.dumps(item, allow_nan=True)))
            except Exception as e:
                results[i] = ("exception", f"arguments cannot be sent: {type(e).__name__}: {e}", {})
        while encoded:
            done = self._run(encoded, timeout_s, results)
            encoded = encoded[done:]
        return results

    def _run(self, encoded: list[tuple[int, str]], timeout_s: float, results: list) -> int:
        """Send `encoded` as one batch and collect answers into `results` until one fails;
        returns how many items have a result (the failed one included)."""
        first = encoded[0][0]
        if not self.start():
            for i, _ in encoded:
                results[i] = ("closed", "the reward computer is closed", {})
            return len(encoded)
        conn, proc = self._conn, self._proc
        assert conn is not None and proc is not None
        try:
            if not self._ready:  # a fresh worker's boot never counts against the timeout
                if not conn.poll(_BOOT_TIMEOUT_S) or _recv(conn) != "ready":
                    self.stop()
                    results[first] = ("crash", f"worker not up within {_BOOT_TIMEOUT_S}s", {})
                    return 1
                self._ready = True
            conn.send_bytes(("[" + ",".join(text for _, text in encoded) + "]").encode())
        except (EOFError, OSError) as e:
            self.stop()
            results[first] = ("crash", f"worker unreachable ({type(e).__name__})", {})
            return 1
        for n, (i, _) in enumerate(encoded):
            try:
                if not conn.poll(timeout_s):
                    self.stop()
                    results[i] = ("timeout", f"no result within {timeout_s}s; worker replaced", {})
                    return n + 1
                results[i] = tuple(_recv(conn))
            except (EOFError, OSError) as e:
                self.stop()
                results[i] = (
                    "crash",
                    f"worker died ({type(e).__name__}, exit code {proc.poll()})",
                    {},
                )
                return n + 1
        return len(encoded)

    def stop(self, retire: bool = False) -> None:
        """Kill the process (it may be running a hung function); `retire` forbids restarts."""
        with self._lock:
            self._retired = self._retired or retire
            if self._proc is not None:
                self._proc.kill()
                self._proc.wait()
                self._proc = None
            if self._conn is not None:
                self._conn.close()
                self._conn = None
