"""What every figure of `asyncrl plot` shares: reading a run directory (metrics.jsonl, trace
files) and building, labelling and saving a figure on its own Agg canvas (never pyplot's global
state)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
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
# Span category -> (legend label, colour). Learner stages get one shade each (see _span_style).
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
