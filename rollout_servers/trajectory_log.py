"""`rollout_metrics.jsonl`: one line per finished trajectory, written by every rollout server."""

from __future__ import annotations

import json
import time
from pathlib import Path

from asyncrl.wire.protocol import PromptItem
from asyncrl.wire.samples import Trajectory


class TrajectoryMetricsLog:
    """One JSON line per finished trajectory in `run_dir/rollout_metrics.jsonl`: server,
    policy version, reward, finish reason, data source and the agent loop's metrics (turns,
    tool calls, tool errors, ...), which the Batch sent to the learner does not carry.

    Lines are buffered in memory and appended at most every `flush_every_s` (or when
    `max_buffered` pile up), so the event loop does one small write per interval, not one per
    trajectory. Every server appends to the same file; each flush is one `write` of whole lines
    to a file opened in append mode, so lines of different servers never interleave mid-line.
    """

    def __init__(
        self, path: Path, server_id: int, flush_every_s: float = 2.0, max_buffered: int = 512
    ):
        self.path, self.server_id = path, server_id
        self.flush_every_s, self.max_buffered = flush_every_s, max_buffered
        self._lines: list[str] = []
        self._last_flush = time.monotonic()

    def add(self, prompt: PromptItem, traj: Trajectory) -> None:
        """Buffer the line of one trajectory (its version: the newest that sampled any of its
        tokens, and its oldest; -1 when it sampled none)."""
        sampled = traj.versions[traj.loss_mask > 0]
        record = {
            "server": self.server_id,
            "version": int(sampled.max()) if sampled.size else -1,
            "oldest_version": int(sampled.min()) if sampled.size else -1,
            "eval": bool(prompt.eval_job),
            "data_source": prompt.data_source,
            "reward": traj.reward,
            "finish_reason": traj.finish_reason,
            "response_len": int(traj.response_ids.size),
            "metrics": traj.metrics,
        }
        self._lines.append(json.dumps(record, separators=(",", ":")) + "\n")
        if len(self._lines) >= self.max_buffered:
            self.flush()

    def maybe_flush(self) -> None:
        if self._lines and time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._lines:
            return
        text, self._lines = "".join(self._lines), []
        with self.path.open("a") as f:
            f.write(text)
