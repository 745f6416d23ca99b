"""Step metrics: named stage timers and a JSON-lines writer (one line per learner step)."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class StageTimer:
    """Times named stages of one loop iteration: `with timer("update"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.spans: list[tuple[str, float, float]] = []  # (stage, unix start, seconds)

    @contextmanager
    def __call__(self, name: str):
        wall, start = time.time(), time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + took
            self.spans.append((name, wall, took))


class JsonlWriter:
    """Appends one JSON object per line and flushes, so readers (the progress display, plots)
    see every step as soon as it is written."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every complete line of a JSON-lines file (a half-written last line is ignored)."""
    out: list[dict[str, Any]] = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def peak_rss_mb() -> float:
    """Peak resident set size of this process, MiB.

    Read from VmHWM (per address space) where available: Linux `ru_maxrss` also carries the
    high-water mark of the forked parent image from before `exec`, which would charge the
    launcher's memory to every child."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write JSON so a reader never sees half a file."""
    write_bytes_atomic(path, json.dumps(obj, indent=1).encode())


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to a temporary file next to `path`, then rename it over `path`: a reader
    (or a process killed meanwhile) never leaves or sees half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(p)
