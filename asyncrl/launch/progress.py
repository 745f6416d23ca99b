"""The launcher's live progress display, fed by the learner's metrics.jsonl.

On a terminal it is one line rewritten in place; otherwise (logs, CI) a line at most every few
seconds, so a long run neither floods a log nor goes quiet.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any


def training_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of learner steps (a validation before training has no reward_mean)."""
    return [r for r in rows if "reward_mean" in r]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


DROP_ORDER = (5, 4, 3, 2, 6)
"""Indexes of `Progress.render`'s fields, in the order they are left out of a narrow terminal:
learner idle, tokens/s, samples/s, staleness, elapsed (step and reward always stay)."""


class Progress:
    def __init__(
        self,
        total_steps: int,
        max_staleness: int,
        mode: str,
        started: float,
        min_interval_s: float = 5.0,
        stream=None,
    ):
        self.total, self.max_staleness, self.started = total_steps, max_staleness, started
        self.stream = stream or sys.stdout
        tty = getattr(self.stream, "isatty", lambda: False)()
        self.mode = ("line" if not tty else "tty") if mode == "auto" else mode
        self.min_interval_s = min_interval_s
        self._shown_step, self._shown_at = 0, 0.0

    def render(self, rows: list[dict[str, Any]], width: int | None = None) -> str:
        """The status line; with `width`, the fields that do not fit are left out, least
        useful first (learner idle, tokens/s, samples/s, staleness), so a rewrite on a terminal
        never wraps (a wrapped line leaves a fragment behind at every rewrite)."""
        last = rows[-1]
        recent = rows[-10:]
        elapsed = time.monotonic() - self.started
        fields = [  # in the order shown; dropped from the end of DROP_ORDER when too wide
            f"step {last['step']}/{self.total}",
            f"reward {_mean([r['reward_mean'] for r in recent]):.3f}",
            f"staleness {last['staleness_mean']:.2f} (max {last['staleness_max']:.0f}/"
            f"{self.max_staleness})",
            f"{_mean([r['samples_per_s'] for r in recent]):.1f} samples/s",
            f"{_mean([r['gen_tokens_per_s'] for r in recent]):.0f} tok/s",
            f"learner idle {_mean([r['learner_idle_ratio'] for r in recent]):.0%}",
            f"{elapsed:.0f}s",
        ]
        shown = list(range(len(fields)))
        line = " | ".join(fields[i] for i in shown)
        for drop in DROP_ORDER:
            if width is None or len(line) <= width:
                break
            shown.remove(drop)
            line = " | ".join(fields[i] for i in shown)
        return line if width is None else line[:width]

    def update(self, rows: list[dict[str, Any]], final: bool = False) -> None:
        rows = training_rows(rows)
        if self.mode == "none" or not rows:
            return
        if rows[-1]["step"] == self._shown_step and not (final and self.mode == "tty"):
            return
        now = time.monotonic()
        if self.mode == "tty":
            width = shutil.get_terminal_size().columns - 1  # the last column would wrap
            self.stream.write("\r\x1b[2K" + self.render(rows, width) + ("\n" if final else ""))
        elif final or now - self._shown_at >= self.min_interval_s:
            self.stream.write(self.render(rows) + "\n")
        else:
            return
        self.stream.flush()
        self._shown_step, self._shown_at = rows[-1]["step"], now

    def note(self, line: str) -> None:
        """Print an event (a server restarted) on a line of its own, whatever the mode; on a
        terminal the progress line is drawn again below it at the next update."""
        if self.mode == "tty":
            self.stream.write("\r\x1b[2K")
            self._shown_step = 0
        self.stream.write(line + "\n")
        self.stream.flush()

    @staticmethod
    def summary(rows: list[dict[str, Any]]) -> str:
        val = [r for r in rows if "val/mean_score" in r]
        rows = training_rows(rows)
        if not rows:
            return "no learner steps were completed"
        first = _mean([r["reward_mean"] for r in rows[:5]])
        last = _mean([r["reward_mean"] for r in rows[-20:]])
        text = (
            f"{len(rows)} steps; mean reward first 5 steps {first:.3f}, "
            f"last 20 steps {last:.3f} (gain {last - first:+.3f})"
        )
        if val:
            text += f"; last validation (step {val[-1]['step']}) {val[-1]['val/mean_score']:.3f}"
        return text
