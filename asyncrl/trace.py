"""Timeline spans for `asyncrl plot`: what each process did, when, for how long.

Each process appends one JSON line per span to `run_dir/trace/<process>.jsonl`:
`{"name", "cat", "ts" (unix seconds), "dur" (seconds), "args"}`. Writes are buffered and
thread-safe (the engine's sampling thread and the weight receiver record spans too) and cost a
dict and a list append on the hot path.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class SpanWriter:
    def __init__(self, path: str | Path, flush_every: int = 64):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._flush_every = flush_every

    def record(self, name: str, cat: str, start: float, dur: float, **args: Any) -> None:
        line = json.dumps({"name": name, "cat": cat, "ts": start, "dur": dur, "args": args})
        with self._lock:
            self._pending.append(line)
            if len(self._pending) >= self._flush_every:
                self._flush_locked()

    @contextmanager
    def span(self, name: str, cat: str, **args: Any):
        start = time.time()
        try:
            yield
        finally:
            self.record(name, cat, start, time.time() - start, **args)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._pending:
            with self.path.open("a") as f:
                f.write("\n".join(self._pending) + "\n")
            self._pending.clear()
