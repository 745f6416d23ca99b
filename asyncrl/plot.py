"""Plots of a finished (or running) run, and its spans as a Chrome trace.

Reads what a run leaves in RUN_DIR and writes nothing back but the outputs asked for:

- `metrics.jsonl` (one object per learner step) -> `reward.png`, `response_length.png`,
  `staleness.png`, `throughput.png`, `idle.png`, `step_time.png`;
- `trace/<process>.jsonl` (one span per line: name, cat, ts and dur in seconds, args) ->
  `timeline.png` (a Gantt chart, one row per process) and, through `write_chrome_trace`, a
  Chrome trace-event file that chrome://tracing and Perfetto open.

Every metric key is optional: runs from older versions, validation-only rows and runs without
tracing all plot what they have, and a figure whose series are all absent is not written. Figures
are built on matplotlib's object API with an Agg canvas each, so plotting never touches pyplot's
global backend or state of the calling process.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 150
# Default timeline window: this many of the last learner steps.
TIMELINE_STEPS = 5
# Font sizes chosen to stay legible when a 150-dpi PNG is shown at half size in a report.
FONT_RC = {
    "font.size": 11,
    "axes.titlesize": 13,
    "axes.labelsize": 11,
    "legend.fontsize": 10,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
}
# Span category -> (legend label, colour). Learner stages get one shade each (see _span_style).
CATEGORY_STYLE = {
    "rollout": ("generation", "tab:green"),
    "sync": ("weight sync", "tab:red"),
    "learner": ("training", "tab:blue"),
}
LEARNER_STAGE_COLOURS = ["#1f4e9c", "#3b7dd8", "#7fb0f0", "#5a3fa0", "#9a7fd6", "#2a9fb0"]
OTHER_COLOURS = ["tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:gray", "tab:cyan"]

Span = dict[str, Any]


# ----------------------------------------------------------------------------- reading


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Reads one JSON object per line, skipping blank lines and lines that do not parse: a
    writer killed mid-line (or still writing) leaves a partial last line, and one bad line must
    not hide the rest of a run."""
    rows: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_traces(run_dir: Path) -> dict[str, list[Span]]:
    """Spans per process (the file stem), each sorted by start time; empty without `trace/`.
    Lines without a numeric `ts` and `dur` are dropped, since they cannot be drawn."""
    trace_dir = Path(run_dir) / "trace"
    if not trace_dir.is_dir():
        return {}
    traces: dict[str, list[Span]] = {}
    for path in sorted(trace_dir.glob("*.jsonl")):
        spans = [
            s for s in read_jsonl(path) if _is_number(s.get("ts")) and _is_number(s.get("dur"))
        ]
        traces[path.stem] = sorted(spans, key=lambda s: s["ts"])
    return traces


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(rows: Iterable[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that carry a finite number under both `step` and `key`."""
    steps: list[float] = []
    values: list[float] = []
    for row in rows:
        if _is_number(row.get("step")) and _is_number(row.get(key)):
            steps.append(row["step"])
            values.append(row[key])
    return steps, values


# ----------------------------------------------------------------------------- figures


def _new_figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (8, 4.5)) -> Figure:
    """A figure with its own Agg canvas: rendering headless without switching the process-wide
    pyplot backend (which would break a caller's interactive session)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    fig.subplots(nrows, ncols, squeeze=False)
    return fig


def _finish_axes(ax: Axes, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if len(handles) > 1:
        ax.legend(loc="best")
    elif labels:
        # One series gets no legend box, so its name goes into the title instead.
        ax.set_title(f"{title}: {labels[0]}")


def _save(fig: Figure, path: Path, title: str | None = None) -> Path:
    if title:
        fig.suptitle(title, fontsize=14)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def _plot_lines(
    ax: Axes, rows: list[dict[str, Any]], keys: Sequence[tuple[str, str]], **kwargs: Any
) -> int:
    """Plots each present (key, label) against step; returns how many series were drawn."""
    drawn = 0
    for key, label in keys:
        steps, values = series(rows, key)
        if steps:
            ax.plot(steps, values, label=label, **kwargs)
            drawn += 1
    return drawn


def plot_reward(rows: list[dict[str, Any]], path: Path) -> Path | None:
    steps, mean = series(rows, "reward_mean")
    val_steps, val = series(rows, "val/mean_score")
    if not steps and not val_steps:
        return None
    fig = _new_figure()
    ax = fig.axes[0]
    if steps:
        ax.plot(steps, mean, color="tab:blue", label="train reward (mean)")
        band = [
            (r["step"], r["reward_mean"], r["reward_std"])
            for r in rows
            if all(_is_number(r.get(k)) for k in ("step", "reward_mean", "reward_std"))
        ]
        if band:
            ax.fill_between(
                [s for s, _, _ in band],
                [m - sd for _, m, sd in band],
                [m + sd for _, m, sd in band],
                color="tab:blue",
                alpha=0.2,
                label="± 1 std",
            )
    if val_steps:
        ax.plot(val_steps, val, "o--", color="tab:orange", label="validation score (mean)")
    _finish_axes(ax, "Reward", "learner step", "reward (per sample)")
    return _save(fig, path)


def plot_response_length(rows: list[dict[str, Any]], path: Path) -> Path | None:
    fig = _new_figure()
    ax = fig.axes[0]
    keys = [
        ("response_len_mean", "mean"),
        ("response_len_p50", "median"),
        ("response_len_max", "max"),
    ]
    if not _plot_lines(ax, rows, keys):
        return None
    _finish_axes(ax, "Response length", "learner step", "response length (tokens)")
    return _save(fig, path)


def plot_staleness(rows: list[dict[str, Any]], path: Path) -> Path | None:
    hist = _summed_histogram(rows)
    has_lines = any(series(rows, k)[0] for k in ("staleness_mean", "staleness_max"))
    if not has_lines and not hist:
        return None
    panels = int(has_lines) + int(bool(hist))
    fig = _new_figure(1, panels, size=(6.5 * panels, 4.5))
    axes = list(fig.axes)
    if has_lines:
        ax = axes.pop(0)
        # Max is drawn wide and faint underneath, so mean stays visible where the two coincide.
        _plot_lines(ax, rows, [("staleness_max", "max")], color="tab:red", linewidth=4, alpha=0.4)
        _plot_lines(ax, rows, [("staleness_mean", "mean")], color="tab:blue", marker=".")
        ax.yaxis.get_major_locator().set_params(integer=True)
        _finish_axes(ax, "Staleness of trained samples", "learner step", "staleness (versions)")
    if hist:
        ax = axes.pop(0)
        ax.bar(range(len(hist)), hist, color="tab:purple")
        ax.xaxis.get_major_locator().set_params(integer=True)
        _finish_axes(
            ax, "Staleness histogram (all steps)", "staleness (versions behind)", "trained samples"
        )
    return _save(fig, path)


def _summed_histogram(rows: list[dict[str, Any]]) -> list[float]:
    """Element-wise sum of every row's `staleness_hist`, padded to the longest one."""
    total: list[float] = []
    for row in rows:
        hist = row.get("staleness_hist")
        if not isinstance(hist, list):
            continue
        if len(hist) > len(total):
            total.extend([0] * (len(hist) - len(total)))
        for i, count in enumerate(hist):
            if _is_number(count):
                total[i] += count
    return total


def plot_throughput(rows: list[dict[str, Any]], path: Path) -> Path | None:
    samples = [("samples_per_s", "trained samples / s")]
    tokens = [
        ("gen_tokens_per_s", "generated tokens / s"),
        ("train_tokens_per_s", "trained tokens / s"),
    ]
    has_samples = bool(series(rows, samples[0][0])[0])
    has_tokens = any(series(rows, k)[0] for k, _ in tokens)
    if not has_samples and not has_tokens:
        return None
    panels = int(has_samples) + int(has_tokens)
    fig = _new_figure(panels, 1, size=(8, 3.2 * panels + 0.6))
    axes = list(fig.axes)
    if has_samples:
        ax = axes.pop(0)
        _plot_lines(ax, rows, samples, color="tab:blue")
        _finish_axes(ax, "Sample throughput", "learner step", "samples / s")
    if has_tokens:
        ax = axes.pop(0)
        _plot_lines(ax, rows, tokens)
        _finish_axes(ax, "Token throughput", "learner step", "tokens / s")
    return _save(fig, path)


def plot_idle(rows: list[dict[str, Any]], path: Path) -> Path | None:
    fig = _new_figure()
    ax = fig.axes[0]
    keys = [("learner_idle_ratio", "learner"), ("server_idle_ratio", "rollout servers")]
    if not _plot_lines(ax, rows, keys):
        return None
    ax.set_ylim(-0.02, 1.02)
    _finish_axes(ax, "Idle fraction of wall time", "learner step", "idle fraction (0 to 1)")
    return _save(fig, path)


def plot_step_time(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Per-stage learner seconds stacked per step: shows which stage a slow step spent time in.
    Stages are the `time_<stage>_s` keys present in any row, plus the two sync timings."""
    # Stages keep the order the learner writes them in, which is the order they run in.
    stages = list(
        dict.fromkeys(k for row in rows for k in row if k.startswith("time_") and k.endswith("_s"))
    )
    keys = stages + [
        k for k in ("weight_sync_s", "generation_pause_s") if any(k in r for r in rows)
    ]
    steps = [r["step"] for r in rows if _is_number(r.get("step")) and any(k in r for k in stages)]
    if not steps:
        return None
    fig = _new_figure(size=(9, 4.8))
    ax = fig.axes[0]
    by_step = {r["step"]: r for r in rows if _is_number(r.get("step"))}
    stacked = [[v if _is_number(v := by_step[s].get(k)) else 0.0 for s in steps] for k in stages]
    labels = [k.removeprefix("time_").removesuffix("_s") for k in stages]
    ax.stackplot(steps, stacked, labels=labels, alpha=0.85)
    extra = [(k, k.removesuffix("_s").replace("_", " ")) for k in keys if k not in stages]
    _plot_lines(ax, rows, extra, color="black", linestyle="--")
    _finish_axes(ax, "Learner step time by stage", "learner step", "seconds")
    if len(keys) > 1:
        # Reversed, so the legend lists stages top to bottom as the stack shows them.
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


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
    fig = _new_figure(size=(11, 1.2 + 0.7 * len(processes) + 0.8))
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
    return _save(fig, path)


# ----------------------------------------------------------------------------- entry points


def plot_run(
    run_dir: Path, out_dir: Path | None = None, window: tuple[int, int] | None = None
) -> list[Path]:
    """Writes every figure the run has data for into `out_dir` (default RUN_DIR/plots) and
    returns their paths; `window=(first_step, last_step)` picks the timeline's learner steps.
    Raises FileNotFoundError when RUN_DIR has neither metrics.jsonl nor trace files."""
    import matplotlib

    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    rows = read_jsonl(metrics_path) if metrics_path.is_file() else []
    traces = read_traces(run_dir)
    if not metrics_path.is_file() and not traces:
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl and no trace/*.jsonl")
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path | None] = []
    with matplotlib.rc_context(FONT_RC):
        written.append(plot_reward(rows, out_dir / "reward.png"))
        written.append(plot_response_length(rows, out_dir / "response_length.png"))
        written.append(plot_staleness(rows, out_dir / "staleness.png"))
        written.append(plot_throughput(rows, out_dir / "throughput.png"))
        written.append(plot_idle(rows, out_dir / "idle.png"))
        written.append(plot_step_time(rows, out_dir / "step_time.png"))
        written.append(plot_timeline(rows, traces, out_dir / "timeline.png", window))
    return [p for p in written if p is not None]


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


def _parse_window(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        bounds = (int(first), int(last))
    except ValueError:
        bounds = None
    if not sep or bounds is None or bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(f"--window wants FIRST:LAST learner steps, got {text!r}")
    return bounds


def main(argv: list[str]) -> int:
    """`asyncrl plot RUN_DIR [--out DIR] [--window A:B]`: the figures, plus trace.json for
    chrome://tracing or ui.perfetto.dev when the run recorded spans; prints each path."""
    parser = argparse.ArgumentParser(prog="asyncrl plot", description=main.__doc__)
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=None, help="output folder (RUN_DIR/plots)")
    parser.add_argument(
        "--window", type=_parse_window, default=None, metavar="A:B", help="timeline learner steps"
    )
    ns = parser.parse_args(argv)
    try:
        paths = plot_run(ns.run_dir, ns.out, ns.window)
    except FileNotFoundError as exc:
        print(f"asyncrl plot: {exc}", file=sys.stderr)
        return 2
    out_dir = ns.out if ns.out is not None else ns.run_dir / "plots"
    if read_traces(ns.run_dir):
        paths.append(write_chrome_trace(ns.run_dir, out_dir / "trace.json"))
    else:
        print(f"asyncrl plot: no trace/*.jsonl in {ns.run_dir}; no timeline or trace.json")
    for path in paths:
        print(path)
    return 0
