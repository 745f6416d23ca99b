"""The process timeline of a run: a Gantt chart of its spans (`timeline.png`) and the same spans
as a Chrome trace-event file for chrome://tracing and Perfetto."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

from asyncrl.analysis.figures import Span, new_figure, read_traces, save_figure, series

# Default timeline window: this many of the last learner steps.
TIMELINE_STEPS = 5
# Span category -> (legend label, colour). Learner stages get one shade each (see _span_style).
CATEGORY_STYLE = {
    "rollout": ("generation", "tab:green"),
    "sync": ("weight sync", "tab:red"),
    "learner": ("training", "tab:blue"),
}
LEARNER_STAGE_COLOURS = ["#1f4e9c", "#3b7dd8", "#7fb0f0", "#5a3fa0", "#9a7fd6", "#2a9fb0"]
OTHER_COLOURS = ["tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:gray", "tab:cyan"]


# ----------------------------------------------------------------------------- timeline


def timeline_window(
    rows: list[dict[str, Any]],
    traces: dict[str, list[Span]],
    window: tuple[int, int] | None = None,
) -> tuple[float, float] | None:
    """Unix-time range [start, end] of learner steps `window` (default: the last TIMELINE_STEPS).

    A metrics row's `time` is written when its step ends, so step A starts where step A-1 ended;
    for the first step the start is the earliest learner span that ends by step A's time (or a
    median step duration earlier when there are no learner spans). Without metrics times, the
    window falls back to the learner's last `update` spans, then to the whole trace.
    """
    ends = {int(s): t for s, t in zip(*series(rows, "time"), strict=True)}
    if ends:
        steps = sorted(ends)
        first, last = window if window else (steps[max(0, len(steps) - TIMELINE_STEPS)], steps[-1])
        chosen = [s for s in steps if first <= s <= last]
        if chosen:
            end = ends[chosen[-1]]
            earlier = [s for s in steps if s < chosen[0]]
            if earlier:
                return ends[earlier[-1]], end
            learner = [s for name, sp in traces.items() if name.startswith("learner") for s in sp]
            starts = [s["ts"] for s in learner if s["ts"] + s["dur"] <= ends[chosen[0]] + 1e-6]
            if starts:
                return min(starts), end
            gaps = sorted(ends[b] - ends[a] for a, b in pairwise(steps))
            return ends[chosen[0]] - (gaps[len(gaps) // 2] if gaps else 1.0), end
    updates = [
        s
        for name, spans in traces.items()
        if name.startswith("learner")
        for s in spans
        if s.get("name") == "update"
    ]
    if updates:
        updates.sort(key=lambda s: s["ts"])
        lo, hi = window if window else (len(updates) - TIMELINE_STEPS + 1, len(updates))
        picked = updates[max(0, lo - 1) : max(0, hi)] or updates[-TIMELINE_STEPS:]
        return picked[0]["ts"], picked[-1]["ts"] + picked[-1]["dur"]
    all_spans = [s for spans in traces.values() for s in spans]
    if not all_spans:
        return None
    return min(s["ts"] for s in all_spans), max(s["ts"] + s["dur"] for s in all_spans)


def _process_order(name: str) -> tuple[int, str]:
    """Learners on top, then rollout servers, then everything else, each group by name."""
    for rank, prefix in enumerate(("learner", "server", "replay")):
        if name.startswith(prefix):
            return rank, name
    return 3, name


def _span_style(span: Span, learner_stages: list[str], other_cats: list[str]) -> tuple[str, str]:
    cat = str(span.get("cat", ""))
    if cat == "learner":
        name = str(span.get("name", ""))
        colour = LEARNER_STAGE_COLOURS[learner_stages.index(name) % len(LEARNER_STAGE_COLOURS)]
        return f"train: {name}", colour
    if cat in CATEGORY_STYLE:
        return CATEGORY_STYLE[cat]
    return cat or "other", OTHER_COLOURS[other_cats.index(cat) % len(OTHER_COLOURS)]


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
    learner_stages = list(
        dict.fromkeys(str(s.get("name", "")) for s in all_visible if s.get("cat") == "learner")
    )
    other_cats = sorted({str(s.get("cat", "")) for s in all_visible} - set(CATEGORY_STYLE))

    processes = sorted(visible, key=_process_order)
    fig = new_figure(size=(11, 1.2 + 0.7 * len(processes) + 0.8))
    ax = fig.axes[0]
    seen: set[str] = set()
    for row, name in enumerate(processes):
        by_style: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for span in visible[name]:
            start = max(span["ts"], lo) - run_start
            width = min(span["ts"] + span["dur"], hi) - run_start - start
            by_style.setdefault(_span_style(span, learner_stages, other_cats), []).append(
                (start, width)
            )
        for (label, colour), bars in by_style.items():
            ax.broken_barh(
                bars,
                (row - 0.35, 0.7),
                facecolors=colour,
                edgecolor="white",
                linewidth=0.3,
                label=None if label in seen else label,
            )
            seen.add(label)
    # A step's metrics row is written when it ends: a dotted line there, and the step's number
    # centred over the interval since the previous step ended, above the process rows.
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
    ax.set_yticks(range(len(processes)), processes)
    ax.set_ylim(len(processes) - 0.5, -0.85)
    ax.set_xlim(lo - run_start, hi - run_start)
    ax.set_title("Timeline of process activity")
    ax.set_xlabel("seconds since run start")
    ax.set_ylabel("process")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, path)


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
