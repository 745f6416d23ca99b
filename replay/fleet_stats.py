"""What the replay tells the learner about the rest of the pipeline, once per batch.

Servers report cumulative counters (engine busy time, generation paused for weights, uptime)
with every lease request; `FleetStats` keeps the latest per server and, when a batch is served,
turns the change since the previous batch into the step's fleet metrics: replay occupancy, the
servers' mean idle ratio and total generation pause, and the latency of the batch's samples.

A server that has not reported since the previous batch (it is busy with all its slots, or its
lease request is being held) keeps its interval open: its last measured idle ratio stands in
until its next report covers the whole span, so every step carries the metric.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class FleetStats:
    """Per-server counters between two batches (see the module docstring)."""

    def __init__(self) -> None:
        self._now: dict[int, tuple[float, float, float]] = {}
        self._at_last_batch: dict[int, tuple[float, float, float]] = {}
        self._last_seen: dict[int, float] = {}
        self._idle: dict[int, float] = {}  # each server's idle ratio over its latest interval
        self.forgotten = 0

    def report(
        self, server_id: int, busy_s: float, paused_s: float, uptime_s: float, now: float
    ) -> None:
        """A server's cumulative counters, as its latest lease request carried them."""
        self._now[server_id] = (busy_s, paused_s, uptime_s)
        self._last_seen[server_id] = now

    def forget_silent(self, now: float, silent_s: float) -> None:
        """Drop the servers not heard from for `silent_s` (they no longer count as idle)."""
        for server_id in [s for s, t in self._last_seen.items() if now - t > silent_s]:
            self.forget(server_id)

    def forget(self, server_id: int) -> None:
        """Drop a server's counters (silent, dead, or restarted: a new epoch counts from 0)."""
        if self._last_seen.pop(server_id, None) is None:
            return
        self._now.pop(server_id, None)
        self._at_last_batch.pop(server_id, None)
        self._idle.pop(server_id, None)
        self.forgotten += 1

    def for_batch(
        self, latencies: Iterable[float], groups_ready: int, groups_in_flight: int
    ) -> dict[str, float]:
        """The fleet metrics of the batch being served; starts the next interval."""
        lat = np.array(list(latencies))
        stats = {
            "replay_groups_ready": float(groups_ready),
            "replay_groups_in_flight": float(groups_in_flight),
            "traj_latency_p50_s": float(np.percentile(lat, 50)) if len(lat) else 0.0,
            "traj_latency_p99_s": float(np.percentile(lat, 99)) if len(lat) else 0.0,
        }
        pause = 0.0
        for server, now in self._now.items():
            before = self._at_last_batch.get(server, (0.0, 0.0, 0.0))
            span = now[2] - before[2]
            if span <= 0:
                continue  # nothing new: the interval stays open, the last ratio stands
            self._idle[server] = 1.0 - min(1.0, (now[0] - before[0]) / span)
            pause += now[1] - before[1]
            self._at_last_batch[server] = now
        if self._idle:
            stats["server_idle_ratio"] = sum(self._idle.values()) / len(self._idle)
            stats["generation_pause_s"] = pause
        return stats
