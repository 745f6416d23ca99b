"""What every figure of `asyncrl plot` shares: reading a run directory (metrics.jsonl, trace
files) and building, labelling and saving a figure on its own Agg canvas (never pyplot's global
state)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure
    from matplotlib.typing import RcKeyType

DPI = 150
# Font sizes chosen to stay legible when a 150-dpi PNG is shown at half size in a report.
FONT_RC: dict[RcKeyType, Any] = {
    "font.size": 11,
    "axes.titlesize": 13,
    "axes.labelsize": 11,
    "legend.fontsize": 10,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
}
Span = dict[str, Any]

# One colour per stage a run can record, shared by the timeline and the step-time stack, so a
# stage reads the same in both. The names are the learner's timed stages (`timer("...")` in
# learner/trainer.py) and the servers' spans (`trace.record("...")` in rollout_servers/server.py);
# tests/unit/test_plot_readability.py checks that every one of them is here, each colour once.
STAGE_COLOURS = {
    "fetch_batch": "tab:gray",  # the learner waiting for a batch: idle time, so grey
    "compute_logprobs": "tab:purple",
    "compute_advantages": "tab:pink",
    "update": "tab:blue",
    "broadcast_weights": "tab:orange",
    "publish_version": "tab:olive",
    "validate": "tab:brown",
    "generate": "tab:green",
    "apply_weights": "tab:red",
}
# For stages added since (or a newer run's): light tab20 shades, none of them used above.
EXTRA_STAGE_COLOURS = [
    "tab:cyan",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
]
# Raw per-step values are drawn this faint behind their rolling mean, under this legend entry.
RAW_ALPHA = 0.2
RAW_LABEL = "faint: raw value per step"
# The rolling-mean window: a tenth of the points, odd (centred), at most this many.
MAX_SMOOTHING = 51


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
        spans = [s for s in read_jsonl(path) if is_number(s.get("ts")) and is_number(s.get("dur"))]
        traces[path.stem] = sorted(spans, key=lambda s: s["ts"])
    return traces


def is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(rows: Iterable[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that carry a finite number under both `step` and `key`."""
    steps: list[float] = []
    values: list[float] = []
    for row in rows:
        if is_number(row.get("step")) and is_number(row.get(key)):
            steps.append(row["step"])
            values.append(row[key])
    return steps, values


def stage_colours(names: Iterable[str]) -> dict[str, str]:
    """A colour per stage name: the fixed one of a known stage, else the next unused extra
    shade in order of first appearance (shades repeat only past len(EXTRA_STAGE_COLOURS)
    unknown stages)."""
    colours: dict[str, str] = {}
    extra = 0
    for name in dict.fromkeys(names):
        if name in STAGE_COLOURS:
            colours[name] = STAGE_COLOURS[name]
        else:
            colours[name] = EXTRA_STAGE_COLOURS[extra % len(EXTRA_STAGE_COLOURS)]
            extra += 1
    return colours


# ----------------------------------------------------------------------------- smoothing


def smoothing_window(points: int) -> int:
    """The rolling-mean window for a series of `points` values: about a tenth of them, odd so
    the window is centred, 1 (no smoothing) below 20 points, at most MAX_SMOOTHING."""
    return min(max(1, points // 10) | 1, MAX_SMOOTHING)


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Centred rolling mean over `window` points (odd). Centred rather than trailing, so a rise
    shows at the step where it happened, not window/2 steps later; near either end the window
    shrinks to the points that exist (as pandas' `rolling(center=True, min_periods=1)`)."""
    half = window // 2
    prefix = [0.0, *accumulate(values)]
    n = len(values)
    out = []
    for i in range(n):
        lo, hi = max(0, i - half), min(n, i + half + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def clip_band(
    centre: Sequence[float], spread: Sequence[float], lo: float | None, hi: float | None
) -> tuple[list[float], list[float]]:
    """The band centre ± spread, each edge clipped to [lo, hi] where given: a ±1 std band of a
    0/1 reward must not claim rewards below 0 or above 1."""
    lower = [c - s for c, s in zip(centre, spread, strict=True)]
    upper = [c + s for c, s in zip(centre, spread, strict=True)]
    if lo is not None:
        lower = [max(lo, v) for v in lower]
        upper = [max(lo, v) for v in upper]
    if hi is not None:
        lower = [min(hi, v) for v in lower]
        upper = [min(hi, v) for v in upper]
    return lower, upper


# ----------------------------------------------------------------------------- figures


def new_figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (8, 4.5)) -> Figure:
    """A figure with its own Agg canvas: rendering headless without switching the process-wide
    pyplot backend (which would break a caller's interactive session)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    fig.subplots(nrows, ncols, squeeze=False)
    return fig


def integer_ticks(axis: Axis) -> None:
    """Ticks at whole numbers only (counts, versions) on an axis with matplotlib's default
    locator."""
    from matplotlib.ticker import MaxNLocator

    locator = axis.get_major_locator()
    assert isinstance(locator, MaxNLocator), locator  # the default, AutoLocator, is one
    locator.set_params(integer=True)


def finish_axes(ax: Axes, title: str, xlabel: str, ylabel: str) -> None:
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


def save_figure(fig: Figure, path: Path, title: str | None = None) -> Path:
    if title:
        fig.suptitle(title, fontsize=14)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def plot_lines(
    ax: Axes,
    rows: list[dict[str, Any]],
    keys: Sequence[tuple[str, str]],
    raw: bool = True,
    **kwargs: Any,
) -> int:
    """Plots each present (key, label) against step as its rolling mean (see smoothing_window),
    with the raw per-step values faint behind it in the same colour unless `raw` is False (over
    a stack, where they would hide it); the legend names the window. Returns how many series
    were drawn."""
    drawn = 0
    faint_drawn = False
    for key, label in keys:
        steps, values = series(rows, key)
        if not steps:
            continue
        window = smoothing_window(len(values))
        name = label if window == 1 else f"{label} (rolling mean, {window} steps)"
        (line,) = ax.plot(steps, rolling_mean(values, window), label=name, **kwargs)
        drawn += 1
        if raw and window > 1:
            faint = {k: v for k, v in kwargs.items() if k not in ("alpha", "linewidth", "marker")}
            faint["color"] = line.get_color()
            ax.plot(steps, values, alpha=RAW_ALPHA, linewidth=0.8, zorder=1.5, **faint)
            faint_drawn = True
    if faint_drawn and not any(h.get_label() == RAW_LABEL for h in ax.get_lines()):
        ax.plot([], [], color="gray", alpha=RAW_ALPHA * 2, linewidth=0.8, label=RAW_LABEL)
    return drawn
