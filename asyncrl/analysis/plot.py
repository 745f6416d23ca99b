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
import sys
from pathlib import Path
from typing import Any

from asyncrl.analysis.figures import (
    FONT_RC,
    clip_band,
    finish_axes,
    integer_ticks,
    is_number,
    new_figure,
    plot_lines,
    read_jsonl,
    read_traces,
    rolling_mean,
    save_figure,
    series,
    smoothing_window,
    stage_colours,
)
from asyncrl.analysis.timeline import plot_timeline, write_chrome_trace


def plot_reward(
    rows: list[dict[str, Any]], path: Path, reward_range: tuple[float, float] | None = None
) -> Path | None:
    """Train reward as a rolling mean over the raw per-step means (faint), in a band of ±1 std
    of the samples' rewards (rolling too), clipped to `reward_range`: the std of a 0/1 reward
    is about 0.5, and an unclipped band would claim rewards below 0 and above 1."""
    steps, mean = series(rows, "reward_mean")
    val_steps, val = series(rows, "val/mean_score")
    if not steps and not val_steps:
        return None
    fig = new_figure()
    ax = fig.axes[0]
    if steps:
        plot_lines(ax, rows, [("reward_mean", "train reward")], color="tab:blue")
        band_steps, lower, upper = reward_band(rows, reward_range)
        if band_steps:
            label = "± 1 std of samples"
            if reward_range:
                label += f", clipped to [{reward_range[0]:g}, {reward_range[1]:g}]"
            ax.fill_between(band_steps, lower, upper, color="tab:blue", alpha=0.15, label=label)
    if val_steps:
        ax.plot(val_steps, val, "o--", color="tab:orange", label="validation score (mean)")
    if reward_range and reward_range[1] > reward_range[0]:
        margin = 0.04 * (reward_range[1] - reward_range[0])
        ax.set_ylim(reward_range[0] - margin, reward_range[1] + margin)
    finish_axes(ax, "Reward", "learner step", "reward (per sample)")
    return save_figure(fig, path)


def reward_band(
    rows: list[dict[str, Any]], reward_range: tuple[float, float] | None
) -> tuple[list[float], list[float], list[float]]:
    """(steps, lower, upper) of the reward plot's band: the rolling mean of `reward_mean` ± the
    rolling mean of `reward_std` (the window of the curve it surrounds), clipped to
    `reward_range`."""
    band = [
        r for r in rows if all(is_number(r.get(k)) for k in ("step", "reward_mean", "reward_std"))
    ]
    window = smoothing_window(len(band))
    lower, upper = clip_band(
        rolling_mean([r["reward_mean"] for r in band], window),
        rolling_mean([r["reward_std"] for r in band], window),
        *(reward_range or (None, None)),
    )
    return [r["step"] for r in band], lower, upper


def observed_reward_range(run_dir: Path) -> tuple[float, float] | None:
    """The lowest and highest reward of any training trajectory the servers finished
    (`rollout_metrics.jsonl`, evaluation ones left out); None without that file or rewards."""
    path = Path(run_dir) / "rollout_metrics.jsonl"
    if not path.is_file():
        return None
    rewards = [
        r["reward"] for r in read_jsonl(path) if not r.get("eval") and is_number(r.get("reward"))
    ]
    return (min(rewards), max(rewards)) if rewards else None


def plot_response_length(rows: list[dict[str, Any]], path: Path) -> Path | None:
    fig = new_figure()
    ax = fig.axes[0]
    keys = [
        ("response_len_mean", "mean"),
        ("response_len_p50", "median"),
        ("response_len_max", "max"),
    ]
    if not plot_lines(ax, rows, keys):
        return None
    finish_axes(ax, "Response length", "learner step", "response length (tokens)")
    return save_figure(fig, path)


def plot_staleness(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Left: the staleness histogram over time, each step's share of trained samples per
    staleness stacked (rolling means: a batch's staleness flips between neighbouring values
    every step, and raw lines of it read as noise); from runs without `staleness_hist`, the
    rolling mean and max lines instead. Right: the histogram summed over every step, in the
    same colours."""
    hist = _summed_histogram(rows)
    if not hist:
        if not any(series(rows, k)[0] for k in ("staleness_mean", "staleness_max")):
            return None
        fig = new_figure()
        ax = fig.axes[0]
        # Max is drawn wider underneath, so mean stays visible where the two coincide.
        plot_lines(ax, rows, [("staleness_max", "max")], color="tab:red", linewidth=3, alpha=0.6)
        plot_lines(ax, rows, [("staleness_mean", "mean")], color="tab:blue")
        integer_ticks(ax.yaxis)
        finish_axes(ax, "Staleness of trained samples", "learner step", "staleness (versions)")
        return save_figure(fig, path)
    fig = new_figure(1, 2, size=(13, 4.5))
    over_time, total = fig.axes
    colours = _staleness_colours(len(hist))
    steps, shares = staleness_shares(rows, len(hist))
    window = smoothing_window(len(steps))
    smoothed = [rolling_mean(level, window) for level in shares]
    labels = [f"{v} behind" for v in range(len(hist))]
    over_time.stackplot(steps, smoothed, labels=labels, colors=colours, alpha=0.9)
    over_time.set_ylim(0, 1)
    title = "Staleness of trained samples over time"
    if window > 1:
        title += f"\n(share per step, rolling mean of {window} steps)"
    finish_axes(over_time, title, "learner step", "share of trained samples")
    handles, names = over_time.get_legend_handles_labels()
    over_time.legend(handles[::-1], names[::-1], loc="lower left", title="versions")
    total.bar(range(len(hist)), hist, color=colours)
    integer_ticks(total.xaxis)
    finish_axes(
        total, "Staleness histogram (all steps)", "staleness (versions behind)", "trained samples"
    )
    return save_figure(fig, path)


def staleness_shares(
    rows: list[dict[str, Any]], levels: int
) -> tuple[list[float], list[list[float]]]:
    """(steps, shares): for each staleness 0..levels-1, its share of each step's trained
    samples (`staleness_hist` normalised; steps without one, or with no samples, left out)."""
    steps: list[float] = []
    shares: list[list[float]] = [[] for _ in range(levels)]
    for row in rows:
        hist = row.get("staleness_hist")
        if not is_number(row.get("step")) or not isinstance(hist, list):
            continue
        counts = [c if is_number(c) else 0.0 for c in hist] + [0.0] * (levels - len(hist))
        total = sum(counts)
        if total <= 0:
            continue
        steps.append(row["step"])
        for level in range(levels):
            shares[level].append(counts[level] / total)
    return steps, shares


def _staleness_colours(levels: int) -> list[Any]:
    """Fresh samples yellow-green, the stalest dark blue (viridis, reversed), one per level."""
    from matplotlib import colormaps

    cmap = colormaps["viridis_r"]
    return [cmap(0.1 + 0.8 * i / max(levels - 1, 1)) for i in range(levels)]


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
            if is_number(count):
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
    fig = new_figure(panels, 1, size=(8, 3.2 * panels + 0.6))
    axes = list(fig.axes)
    if has_samples:
        ax = axes.pop(0)
        plot_lines(ax, rows, samples, color="tab:blue")
        finish_axes(ax, "Sample throughput", "learner step", "samples / s")
    if has_tokens:
        ax = axes.pop(0)
        plot_lines(ax, rows, tokens)
        finish_axes(ax, "Token throughput", "learner step", "tokens / s")
    return save_figure(fig, path)


def plot_idle(rows: list[dict[str, Any]], path: Path) -> Path | None:
    fig = new_figure()
    ax = fig.axes[0]
    keys = [("learner_idle_ratio", "learner"), ("server_idle_ratio", "rollout servers")]
    if not plot_lines(ax, rows, keys):
        return None
    ax.set_ylim(-0.02, 1.02)
    finish_axes(ax, "Idle fraction of wall time", "learner step", "idle fraction (0 to 1)")
    return save_figure(fig, path)


def plot_step_time(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Per-stage learner seconds stacked per step (each a rolling mean, as the other figures'
    lines): shows which stage the time goes to. Stages are the `time_<stage>_s` keys present in
    any row, coloured as in the timeline; the servers' generation pause is a dashed line (the
    learner's `weight_sync_s` is its broadcast_weights stage again, so it is not drawn twice)."""
    # Stages keep the order the learner writes them in, which is the order they run in.
    stages = list(
        dict.fromkeys(k for row in rows for k in row if k.startswith("time_") and k.endswith("_s"))
    )
    stepped = [r for r in rows if is_number(r.get("step")) and any(k in r for k in stages)]
    if not stepped:
        return None
    steps = [r["step"] for r in stepped]
    window = smoothing_window(len(steps))
    stacked = [rolling_mean([_number_or_zero(r.get(k)) for r in stepped], window) for k in stages]
    labels = [k.removeprefix("time_").removesuffix("_s") for k in stages]
    colours = stage_colours(labels)
    fig = new_figure(size=(9, 4.8))
    ax = fig.axes[0]
    ax.stackplot(steps, stacked, labels=labels, colors=[colours[n] for n in labels], alpha=0.85)
    pause = [("generation_pause_s", "servers' generation pause")]
    plot_lines(ax, rows, pause, raw=False, color="black", linestyle="--")
    title = "Learner step time by stage"
    if window > 1:
        title += f" (rolling mean, {window} steps)"
    finish_axes(ax, title, "learner step", "seconds")
    handles, names = ax.get_legend_handles_labels()
    if len(handles) > 1:
        # Reversed, so the legend lists stages top to bottom as the stack shows them.
        ax.legend(handles[::-1], names[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, path)


def _number_or_zero(value: Any) -> float:
    return value if is_number(value) else 0.0


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
        reward_range = observed_reward_range(run_dir)
        written.append(plot_reward(rows, out_dir / "reward.png", reward_range))
        written.append(plot_response_length(rows, out_dir / "response_length.png"))
        written.append(plot_staleness(rows, out_dir / "staleness.png"))
        written.append(plot_throughput(rows, out_dir / "throughput.png"))
        written.append(plot_idle(rows, out_dir / "idle.png"))
        written.append(plot_step_time(rows, out_dir / "step_time.png"))
        written.append(plot_timeline(rows, traces, out_dir / "timeline.png", window))
    return [p for p in written if p is not None]


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
