"""Serve until the process is told to stop: the one way a service process (the replay,
`replay.service.run_replay`; a reward-model server, `reward_models.server`) runs its
`asyncrl.wire.router.RouterService` loop and ends it.

SIGTERM or SIGINT sets the loop's stop event (the loop sees it within
`asyncrl.wire.router.POLL_INTERVAL_S`); then, whether the loop stopped or raised, the service is
closed, the signal handlers that were there before are put back, and the final counters are
written atomically to the run's stats file and summed up in one log line.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from asyncrl.metrics import write_json_atomic

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a service (the launchers send SIGTERM; a terminal sends SIGINT)."""


class Served(Protocol):
    """A service loop: run until `stop` is set, report and close."""

    def run(self, stop: threading.Event | None = None) -> dict[str, float]:
        """Serve until `stop` is set; the final counters."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters and gauges now."""
        ...

    def close(self, linger_ms: int = 100) -> None:
        """Close the socket (answers already sent get `linger_ms` to leave)."""
        ...


def serve_until_signal(
    service: Served,
    stats_path: Path,
    summarize: Callable[[dict[str, float]], str],
    name: str,
    log: logging.Logger,
) -> None:
    """Run `service` until SIGTERM or SIGINT; then close it, restore the previous signal
    handlers, write its final counters to `stats_path` (atomically) and log
    "`name` done: `summarize(counters)`", also when the loop raised."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in STOP_SIGNALS}
    try:
        service.run(stop)
    finally:
        counters = service.stats()
        service.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        write_json_atomic(stats_path, counters)
        log.info("%s done: %s", name, summarize(counters))
