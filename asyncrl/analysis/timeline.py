"""The process timeline of a run: a Gantt chart of its spans (`timeline.png`) and the same spans
as a Chrome trace-event file for chrome://tracing and Perfetto."""

from __future__ import annotations

import json
from bisect import bisect_right
from itertools import accumulate, pairwise
from pathlib import Path
from typing import Any

from asyncrl.analysis.figures import (
    STAGE_COLOURS,
    Span,
    new_figure,
    read_traces,
    save_figure,
    series,
    stage_colours,
)

# The timeline shows this many consecutive learner steps.
TIMELINE_STEPS = 5
# Spans that are recorded but are waiting, not work: the learner's wait for a batch.
IDLE_SPANS = frozenset({"fetch_batch"})
# A window counts as busy when its least busy process beats this fraction of all windows'.
BUSY_QUANTILE = 0.75


# ----------------------------------------------------------------------------- timeline


def step_bounds(
    rows: list[dict[str, Any]], traces: dict[str, list[Span]]
) -> dict[int, tuple[float, float]]:
    """Unix-time (start, end) of each learner step, by step number.

    A metrics row's `time` is written when its step ends, so step A starts where step A-1 ended;
    the first step starts at the earliest learner span that ends by its time (or a median step
    duration earlier when there are no learner spans). Without metrics times, step i is the
    learner's i-th `update` span.
    """
    ends = {int(s): t for s, t in zip(*series(rows, "time"), strict=True)}
    if ends:
        steps = sorted(ends)
        bounds = {b: (ends[a], ends[b]) for a, b in pairwise(steps)}
        first_end = ends[steps[0]]
        learner = [s for name, sp in traces.items() if name.startswith("learner") for s in sp]
        starts = [s["ts"] for s in learner if s["ts"] + s["dur"] <= first_end + 1e-6]
        if starts:
            bounds[steps[0]] = (min(starts), first_end)
        else:
            gaps = sorted(ends[b] - ends[a] for a, b in pairwise(steps))
            bounds[steps[0]] = (first_end - (gaps[len(gaps) // 2] if gaps else 1.0), first_end)
        return bounds
    updates = sorted(
        (s for name, sp in traces.items() if name.startswith("learner") for s in sp),
        key=lambda s: s["ts"],
    )
    updates = [s for s in updates if s.get("name") == "update"]
    return {i: (s["ts"], s["ts"] + s["dur"]) for i, s in enumerate(updates, start=1)}


def timeline_window(
    rows: list[dict[str, Any]],
    traces: dict[str, list[Span]],
    window: tuple[int, int] | None = None,
) -> tuple[float, float] | None:
    """Unix-time range [start, end] of learner steps `window` (first, last), or without one (or
    when no step falls in it) the TIMELINE_STEPS steps chosen by `busiest_steps`; the whole
    trace when no step has bounds (see `step_bounds`)."""
    bounds = step_bounds(rows, traces)
    if bounds:
        steps = sorted(bounds)
        chosen = [s for s in steps if window and window[0] <= s <= window[1]]
        if not chosen:
            chosen = busiest_steps(steps, bounds, traces)
        return bounds[chosen[0]][0], bounds[chosen[-1]][1]
    all_spans = [s for spans in traces.values() for s in spans]
    if not all_spans:
        return None
    return min(s["ts"] for s in all_spans), max(s["ts"] + s["dur"] for s in all_spans)


def busiest_steps(
    steps: list[int], bounds: dict[int, tuple[float, float]], traces: dict[str, list[Span]]
) -> list[int]:
    """TIMELINE_STEPS consecutive steps in which every process is busy, from the middle of the run.

    Each window is scored by its least busy process (busy: inside a span other than IDLE_SPANS);
    of the windows scoring at least BUSY_QUANTILE of all windows' scores, the one nearest the
    middle of the run. Not simply the top score: that is one outlier stretch (a long generate
    batch), while the quantile keeps a typical one where the servers generate and the learner
    trains. The last steps are a poor default: the servers may have stopped generating by then
    (the run is ending), and a timeline of them shows servers that never appear to work.
    """
    k = min(TIMELINE_STEPS, len(steps))
    busy = [BusyTime(spans) for spans in traces.values()]
    if not busy:
        return steps[-k:]
    candidates = []
    for i in range(len(steps) - k + 1):
        lo, hi = bounds[steps[i]][0], bounds[steps[i + k - 1]][1]
        candidates.append((min(b.fraction(lo, hi) for b in busy), (lo + hi) / 2, i))
    scores = sorted(score for score, _, _ in candidates)
    threshold = scores[int(BUSY_QUANTILE * (len(scores) - 1))]
    middle = (bounds[steps[0]][0] + bounds[steps[-1]][1]) / 2
    near = [(abs(centre - middle), i) for score, centre, i in candidates if score >= threshold]
    i = min(near)[1]
    return steps[i : i + k]


class BusyTime:
    """How much of any time range a process spent inside its (non-idle) spans, in O(log n):
    the spans merged into disjoint intervals, with the busy time before each."""

    def __init__(self, spans: list[Span]):
        merged: list[list[float]] = []
        for s in sorted(spans, key=lambda s: s["ts"]):
            if s.get("name") in IDLE_SPANS or s["dur"] <= 0:
                continue
            start, end = s["ts"], s["ts"] + s["dur"]
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.starts = [m[0] for m in merged]
        self.ends = [m[1] for m in merged]
        self.before = [0.0, *accumulate(e - s for s, e in merged)]

    def busy_until(self, t: float) -> float:
        """Seconds busy before time t."""
        i = bisect_right(self.starts, t) - 1
        if i < 0:
            return 0.0
        return self.before[i] + min(t, self.ends[i]) - self.starts[i]

    def fraction(self, lo: float, hi: float) -> float:
        """The fraction of [lo, hi] spent busy (0 for an empty range)."""
        if hi <= lo:
            return 0.0
        return (self.busy_until(hi) - self.busy_until(lo)) / (hi - lo)


def _process_order(name: str) -> tuple[int, str]:
    """Learners on top, then rollout servers, then everything else, each group by name."""
    for rank, prefix in enumerate(("learner", "server", "replay")):
        if name.startswith(prefix):
            return rank, name
    return 3, name


def _span_label(span: Span) -> str:
    """A span's legend entry: its category and stage, e.g. `learner: update`."""
    cat, name = str(span.get("cat", "")), str(span.get("name", ""))
    return f"{cat}: {name}" if cat else name


def _stage_rank(stage: str) -> tuple[int, int, str]:
    """Legend order: known stages in STAGE_COLOURS' order (the order they run in), then others."""
    known = list(STAGE_COLOURS)
    return (0, known.index(stage), "") if stage in known else (1, 0, stage)


def plot_timeline(
    rows: list[dict[str, Any]],
    traces: dict[str, list[Span]],
    path: Path,
    window: tuple[int, int] | None = None,
) -> Path | None:
    """Gantt chart of every process's spans that overlap the chosen window; x is seconds since
    the run started (the earliest metrics time or span), so it lines up with the other plots."""
    bounds = timeline_window(rows, traces, window)
    if bounds is None:
        return None
    lo, hi = bounds
    visible = {
        name: [s for s in spans if s["ts"] < hi and s["ts"] + s["dur"] > lo]
        for name, spans in traces.items()
    }
    visible = {name: spans for name, spans in visible.items() if spans}
    if not visible:
        return None
    run_start = min([s["ts"] for spans in traces.values() for s in spans] + series(rows, "time")[1])
    all_visible = [s for spans in visible.values() for s in spans]
    colours = stage_colours(str(s.get("name", "")) for s in all_visible)

    processes = sorted(visible, key=_process_order)
    fig = new_figure(size=(11, 1.2 + 0.7 * len(processes) + 0.8))
    ax = fig.axes[0]
    legend = _draw_spans(ax, processes, visible, (lo, hi), run_start, colours)
    _mark_steps(ax, rows, (lo, hi), run_start)
    ax.set_yticks(range(len(processes)), processes)
    ax.set_ylim(len(processes) - 0.5, -0.85)
    ax.set_xlim(lo - run_start, hi - run_start)
    ax.set_title("Timeline of process activity")
    ax.set_xlabel("seconds since run start")
    ax.set_ylabel("process")
    ax.grid(True, axis="x", alpha=0.3)
    stages = sorted(legend, key=_stage_rank)
    ax.legend(
        [legend[s][0] for s in stages],
        [legend[s][1] for s in stages],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
    )
    return save_figure(fig, path)


def _draw_spans(
    ax: Any,
    processes: list[str],
    visible: dict[str, list[Span]],
    window: tuple[float, float],
    run_start: float,
    colours: dict[str, str],
) -> dict[str, tuple[Any, str]]:
    """One row of bars per process, its spans cut to `window`, coloured by stage; returns
    each stage's first bars and its label, for the legend."""
    lo, hi = window
    legend: dict[str, tuple[Any, str]] = {}  # stage -> (its first bars, its label)
    for row, name in enumerate(processes):
        by_stage: dict[str, list[tuple[float, float]]] = {}
        for span in visible[name]:
            start = max(span["ts"], lo) - run_start
            width = min(span["ts"] + span["dur"], hi) - run_start - start
            stage = str(span.get("name", ""))
            by_stage.setdefault(stage, []).append((start, width))
            legend.setdefault(stage, (None, _span_label(span)))
        for stage, bars in by_stage.items():
            artist = ax.broken_barh(
                bars, (row - 0.35, 0.7), facecolors=colours[stage], edgecolor="white", linewidth=0.3
            )
            if legend[stage][0] is None:
                legend[stage] = (artist, legend[stage][1])
    return legend


def _mark_steps(
    ax: Any, rows: list[dict[str, Any]], window: tuple[float, float], run_start: float
) -> None:
    """A step's metrics row is written when it ends: a dotted line there, and the step's number
    centred over the interval since the previous step ended, above the process rows."""
    lo, hi = window
    previous_end = lo
    for step, t in sorted(zip(*series(rows, "time"), strict=True), key=lambda st: st[1]):
        if lo < t <= hi:
            ax.axvline(t - run_start, color="gray", linestyle=":", linewidth=0.8)
            ax.text(
                (previous_end + t) / 2 - run_start,
                -0.62,
                f"step {int(step)}",
                fontsize=9,
                color="dimgray",
                ha="center",
                va="center",
            )
            previous_end = t


def write_chrome_trace(run_dir: Path, out_path: Path) -> Path:
    """Converts trace/*.jsonl into Chrome trace-event JSON ("X" complete events, µs units).

    One pid per process (named by a `process_name` metadata event) and one tid per span
    category within it, named by `thread_name`: spans of one category never overlap within a
    process, while e.g. a weight apply may overlap a generate batch, and overlapping events on
    one tid render wrongly. A run without traces gets a valid file with no events.
    """
    traces = read_traces(Path(run_dir))
    events: list[dict[str, Any]] = []
    for pid, name in enumerate(sorted(traces, key=_process_order), start=1):
        events.append(
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
        )
        events.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            }
        )
        tids: dict[str, int] = {}
        for span in traces[name]:
            cat = str(span.get("cat", ""))
            if cat not in tids:
                tids[cat] = len(tids) + 1
                events.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": pid,
                        "tid": tids[cat],
                        "args": {"name": cat or "spans"},
                    }
                )
            args = span.get("args")
            events.append(
                {
                    "name": str(span.get("name", "")),
                    "cat": cat,
                    "ph": "X",
                    "ts": round(span["ts"] * 1e6, 3),
                    "dur": round(span["dur"] * 1e6, 3),
                    "pid": pid,
                    "tid": tids[cat],
                    "args": args if isinstance(args, dict) else {},
                }
            )
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out_path
