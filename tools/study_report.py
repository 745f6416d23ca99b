"""The staleness study's report (`tools/staleness_study.py report`): table, figure, bound check.

Reads every cell directory OUT/CELL of a study (CELL = `s{staleness}-{variant}-lr{lr}-seed{seed}`)
and groups the finished ones over seeds. The staleness bound is checked on every cell that has
records, finished or not, from the run's own records: each learner step's record in
metrics.jsonl holds `staleness_max` and `staleness_hist` (learner/version_stats.py: a sample's
staleness is the learner version minus its oldest sampled token's version, the rule the replay
enforces), so those are the versions of the samples that were trained. rollout_metrics.jsonl
records what the servers generated, trained or not (the replay drops what went stale), so it
cannot show a trained sample; it is not used. The bound is the run's own
`replay.max_staleness` from its config.yaml.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from real_model_report import mean, running_mean, var

from asyncrl.metrics import read_jsonl

DONE_MARKER = "asyncrl: done in"
"""The launcher's last line (asyncrl/launch/run.py), printed once the run ended cleanly."""
CELL_NAME = re.compile(r"^s(\d+)-(.+?)-lr(.+)-seed(\d+)$")
FAILED = ".failed-"  # CELL.failed-N: a run moved aside; its bound is checked, it is not reported
COLLAPSE_DROP = 0.2
MEANS = {  # table column: metrics.jsonl key (mean over all steps, then over seeds)
    "mismatch KL": "mismatch_kl",
    "clip frac": "clip_frac",
    "masked frac": "masked_token_frac",
    "IS trunc frac": "is_truncated_frac",
    "learner idle": "learner_idle_ratio",
    "server idle": "server_idle_ratio",
    "s/step": "step_time_s",
}


def run_config(run_dir: Path) -> dict[str, Any]:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward_mean" in r]


def cell_finished(run_dir: Path, log: Path) -> bool:
    """The run trained its config's total_steps steps and the launcher said it was done."""
    if not (run_dir / "config.yaml").exists() or not log.exists():
        return False
    total = run_config(run_dir)["trainer"]["total_steps"]
    return len(step_rows(run_dir)) >= total and DONE_MARKER in log.read_text(errors="replace")


def staleness_problems(rows: list[dict[str, Any]], bound: int) -> list[str]:
    """Every step whose trained samples break `bound` (or whose records cannot show they keep
    it): staleness_max above it, a staleness_hist count above it, or a histogram that does not
    count every trained sample."""
    if not rows:
        return ["no step records"]
    out = []
    for r in rows:
        step = r.get("step")
        if "staleness_max" not in r or "staleness_hist" not in r:
            out.append(f"step {step}: no staleness_max / staleness_hist")
            continue
        hist = r["staleness_hist"]
        over = sum(hist[bound + 1 :])
        if r["staleness_max"] > bound or over:
            out.append(
                f"step {step}: staleness_max {r['staleness_max']:g}, {over} samples over {bound}"
            )
        if sum(hist) != r["samples"]:
            out.append(f"step {step}: histogram counts {sum(hist)} of {r['samples']} samples")
    return out


def first_reaching(xs: list[float], smoothed: list[float], level: float) -> float | None:
    """The x at which the running mean first reaches `level` (None: never)."""
    return next((x for x, y in zip(xs, smoothed, strict=True) if y >= level), None)


def collapsed(rewards: list[float], smooth: int, window: int) -> bool:
    """Peak of the `smooth`-step running mean minus the final reward (mean of the last `window`
    steps) is at least COLLAPSE_DROP."""
    return max(running_mean(rewards, smooth)) - mean(rewards[-window:]) >= COLLAPSE_DROP


@dataclass
class CellRun:
    name: str
    staleness: int
    variant: str
    lr: str
    seed: int
    seconds: list[float]  # since the launch started (config.yaml's mtime)
    samples: list[int]  # cumulative samples trained
    rewards: list[float]
    means: dict[str, float]


def load_cell(run_dir: Path) -> CellRun:
    m = CELL_NAME.match(run_dir.name)
    assert m, run_dir
    rows = step_rows(run_dir)
    start = (run_dir / "config.yaml").stat().st_mtime
    samples, total = [], 0
    for r in rows:
        total += int(r["samples"])
        samples.append(total)
    means = {
        col: mean([float(r[k]) for r in rows if k in r]) if any(k in r for r in rows) else math.nan
        for col, k in MEANS.items()
    }
    return CellRun(
        run_dir.name,
        int(m[1]),
        m[2],
        m[3],
        int(m[4]),
        [r["time"] - start for r in rows],
        samples,
        [float(r["reward_mean"]) for r in rows],
        means,
    )


@dataclass
class Group:
    """One (staleness, variant, lr): its seeds' runs."""

    staleness: int
    variant: str
    lr: str
    runs: list[CellRun] = field(default_factory=list)

    def finals(self, window: int) -> list[float]:
        return [mean(r.rewards[-window:]) for r in self.runs]

    def final(self, window: int) -> tuple[float, float]:
        """Mean final reward over seeds and its standard error: across seeds when there are
        several, else across the last `window` steps of the one run."""
        finals = self.finals(window)
        if len(finals) > 1:
            return mean(finals), statistics.stdev(finals) / math.sqrt(len(finals))
        last = self.runs[0].rewards[-window:]
        return finals[0], math.sqrt(var(last) / len(last)) if len(last) > 1 else math.nan

    def curve(self, smooth: int, x: str) -> tuple[list[float], list[float]]:
        """Seed-mean running-mean reward against the seed-mean x, over the shortest run."""
        n = min(len(r.rewards) for r in self.runs)
        ys = [running_mean(r.rewards, smooth)[:n] for r in self.runs]
        xs = [getattr(r, x)[:n] for r in self.runs]
        return [mean([v[i] for v in xs]) for i in range(n)], [
            mean([v[i] for v in ys]) for i in range(n)
        ]


def group_runs(runs: list[CellRun]) -> dict[tuple[int, str, str], Group]:
    groups: dict[tuple[int, str, str], Group] = {}
    for r in sorted(runs, key=lambda r: (r.staleness, r.variant, float(r.lr), r.seed)):
        key = (r.staleness, r.variant, r.lr)
        groups.setdefault(key, Group(*key)).runs.append(r)
    return groups


def sync_of(groups: dict[tuple[int, str, str], Group], g: Group) -> Group | None:
    """The synchronous reference: the variant's own staleness-0 group, else `none`'s (same lr)."""
    return groups.get((0, g.variant, g.lr)) or groups.get((0, "none", g.lr))


def summarize(groups: dict[tuple[int, str, str], Group], ns: argparse.Namespace) -> list[dict]:
    rows = []
    for g in groups.values():
        final, se = g.final(ns.window)
        ref = sync_of(groups, g)
        level = ref.final(ns.window)[0] * ns.fraction if ref else math.nan
        reach: dict[str, list[float | None]] = defaultdict(list)
        for r in g.runs:
            smoothed = running_mean(r.rewards, ns.smooth)
            for x in ("seconds", "samples"):
                reach[x].append(first_reaching(getattr(r, x), smoothed, level))
        rows.append(
            {
                "staleness": g.staleness,
                "variant": g.variant,
                "lr": g.lr,
                "seeds": [r.seed for r in g.runs],
                "final": final,
                "final_se": se,
                "sync": f"s0-{ref.variant}" if ref else None,
                "sync_final": ref.final(ns.window)[0] if ref else None,
                "to_level_s": reach["seconds"],
                "to_level_samples": reach["samples"],
                "collapsed": [collapsed(r.rewards, ns.smooth, ns.window) for r in g.runs],
                **{col: mean([r.means[col] for r in g.runs]) for col in MEANS},
            }
        )
    return rows


def wallclock(groups: dict[tuple[int, str, str], Group], ns: argparse.Namespace) -> list[dict]:
    """Per seed, against the same seed's synchronous reference: when each asynchronous run's
    running mean first reaches that reference's final reward (the full reward, not the table's
    fraction), when the reference itself does, and when each finished its steps."""
    rows = []
    for g in groups.values():
        ref = sync_of(groups, g)
        if g.staleness == 0 or ref is None:
            continue
        refs = {r.seed: r for r in ref.runs}
        for r in g.runs:
            sync = refs.get(r.seed)
            if sync is None:
                continue
            level = mean(sync.rewards[-ns.window :])
            reach = first_reaching(r.seconds, running_mean(r.rewards, ns.smooth), level)
            sync_reach = first_reaching(sync.seconds, running_mean(sync.rewards, ns.smooth), level)
            rows.append(
                {
                    "cell": r.name,
                    "sync": sync.name,
                    "sync_final": level,
                    "sync_reaches_s": sync_reach,
                    "reaches_s": reach,
                    "speedup": sync_reach / reach if reach and sync_reach else None,
                    "sync_done_s": sync.seconds[-1],
                    "done_s": r.seconds[-1],
                }
            )
    return rows


def wallclock_table(rows: list[dict], ns: argparse.Namespace) -> str:
    head = "| cell | sync final (same seed) | sync reaches it (s) | cell reaches it (s) | speedup |"
    head += " sync done (s) | cell done (s) | steps done sooner |"
    lines = [head, "|---" * 8 + "|"]
    for r in rows:
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        cells = [
            r["cell"],
            f"{r['sync_final']:.3f}",
            "never" if r["sync_reaches_s"] is None else f"{r['sync_reaches_s']:.0f}",
            "never" if r["reaches_s"] is None else f"{r['reaches_s']:.0f}",
            speedup,
            f"{r['sync_done_s']:.0f}",
            f"{r['done_s']:.0f}",
            f"{r['sync_done_s'] / r['done_s']:.2f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    caption = (
        "Wall-clock, per seed: seconds since launch until the "
        f"{ns.smooth}-step running mean of the reward first reaches the final reward (last "
        f"{ns.window} steps) of the synchronous run of the same seed and lr; speedup: the "
        "synchronous run's time over the cell's; steps done sooner: the synchronous run's time "
        "for all its steps over the cell's."
    )
    return "\n".join(lines) + "\n\n" + caption + "\n"


def _reached(values: list[float | None], fmt: str) -> str:
    hit = [v for v in values if v is not None]
    if not hit:
        return "never"
    shown = format(mean(hit), fmt)
    return shown if len(hit) == len(values) else f"{shown} ({len(hit)}/{len(values)})"


def table(rows: list[dict], ns: argparse.Namespace) -> str:
    head = ["staleness", "variant", "lr", "seeds", "final reward", "sync final"]
    head += [f"s to {ns.fraction:g}x sync", f"samples to {ns.fraction:g}x sync", "collapse"]
    lines = ["| " + " | ".join(head + list(MEANS)) + " |", "|---" * (len(head) + len(MEANS)) + "|"]
    for r in rows:
        sync = "-" if r["sync"] is None else f"{r['sync_final']:.3f} ({r['sync']})"
        n_col = sum(r["collapsed"])
        cells = [
            str(r["staleness"]),
            r["variant"],
            r["lr"],
            ",".join(map(str, r["seeds"])),
            f"{r['final']:.3f} ± {r['final_se']:.3f}",
            sync,
            _reached(r["to_level_s"], ".0f"),
            _reached(r["to_level_samples"], ".0f"),
            ("yes" if n_col else "no") + (f" ({n_col}/{len(r['seeds'])})" if n_col else ""),
            *("-" if math.isnan(r[c]) else f"{r[c]:.3g}" for c in MEANS),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    caption = (
        f"Final reward: mean of the last {ns.window} steps, averaged over seeds; ± is the standard "
        f"error across seeds (across the last {ns.window} steps when one seed). Sync final: the "
        "final reward of the synchronous reference (staleness 0, same lr; the variant's own "
        "staleness-0 cells when it has them, else `none`'s). Time (seconds since launch, start-up "
        f"included) and samples to {ns.fraction:g}x the sync final: when the {ns.smooth}-step "
        "running mean of the reward first reaches it, averaged over the seeds that reach it "
        f"(k/n: k of n seeds did). Collapse: the {ns.smooth}-step running mean's peak minus the "
        f"final reward is {COLLAPSE_DROP} or more (k/n seeds). The other columns: means over "
        "all steps, then over seeds; `-`: the run records no such metric."
    )
    return "\n".join(lines) + "\n\n" + caption + "\n"


def plot(groups: dict[tuple[int, str, str], Group], smooth: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = sorted({g.staleness for g in groups.values()})
    variants = list(dict.fromkeys(g.variant for g in groups.values()))
    lrs = sorted({g.lr for g in groups.values()}, key=float)
    fig, axes = plt.subplots(2, len(cols), figsize=(4.5 * len(cols), 8), sharey=True, squeeze=False)
    for j, s in enumerate(cols):
        shown = [g for g in groups.values() if g.staleness == s]
        refs = [g for g in groups.values() if g.staleness == 0] if s else []
        for i, x in enumerate(("samples", "seconds")):
            ax = axes[i][j]
            for g, is_ref in [(g, False) for g in shown] + [(g, True) for g in refs]:
                xs, ys = g.curve(smooth, x)
                ax.plot(
                    xs,
                    ys,
                    color=f"C{variants.index(g.variant) % 10}",
                    linestyle=["-", "--", ":", "-."][lrs.index(g.lr) % 4],
                    linewidth=3 if is_ref else 1.3,
                    alpha=0.3 if is_ref else 0.9,
                    label=f"{'sync ' if is_ref else ''}{g.variant} lr {g.lr}",
                )
            ax.set_xlabel("samples trained" if x == "samples" else "seconds since launch")
            ax.grid(alpha=0.3)
            ax.set_ylim(0, 1)
            if i == 0:
                ax.set_title(f"max_staleness {s}" + (" (synchronous)" if s == 0 else ""))
            if j == 0:
                ax.set_ylabel(f"reward ({smooth}-step running mean, mean over seeds)")
        axes[0][j].legend(fontsize=7, loc="lower right")
    fig.suptitle("Staleness study: wide faint lines are the synchronous (staleness 0) runs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _no_nan(value: Any) -> Any:
    """NaN (a metric the runs do not record) as JSON null."""
    return None if isinstance(value, float) and math.isnan(value) else value


def report(ns: argparse.Namespace) -> int:
    out = Path(ns.out)
    dirs = sorted(
        d for d in out.iterdir() if d.is_dir() and CELL_NAME.match(d.name.split(FAILED)[0])
    )
    broken, finished = [], []
    print("staleness bound (each trained sample's staleness, from metrics.jsonl):")
    for d in dirs:
        if not (d / "config.yaml").exists():  # written before the fleets start: none trained
            print(f"  {d.name}: no config.yaml, the run never started")
            continue
        bound = run_config(d)["replay"]["max_staleness"]
        rows = step_rows(d)
        done = FAILED not in d.name and cell_finished(d, out / f"{d.name}.log")
        state = "" if done else " (unfinished)"
        if not rows and not done:  # still starting, or died before its first step
            print(f"  {d.name}{state}: no step records yet, nothing trained to check")
            continue
        problems = staleness_problems(rows, bound)
        if problems:
            broken.append(d.name)
            print(f"  {d.name}{state}: BREAKS bound {bound}: {'; '.join(problems[:3])}")
        else:
            worst = max(r["staleness_max"] for r in rows)
            print(f"  {d.name}{state}: ok (max {worst:g} <= {bound})")
        if done:
            finished.append(load_cell(d))
    unfinished = [d.name for d in dirs if d.name not in {r.name for r in finished}]
    if unfinished:
        print(f"not reported (unfinished): {', '.join(unfinished)}")
    if not finished:
        print("no finished cells")
        return 1
    groups = group_runs(finished)
    rows = summarize(groups, ns)
    clock = wallclock(groups, ns)
    text = table(rows, ns) + ("\n" + wallclock_table(clock, ns) if clock else "")
    print(text)
    if ns.table:
        ns.table.write_text(text)
    if ns.json:
        rows_out = [{k: _no_nan(v) for k, v in r.items()} for r in rows]
        record = {"cells": rows_out, "wallclock": clock, "broken": broken}
        ns.json.write_text(json.dumps(record, indent=1) + "\n")
    if ns.figure:
        plot(groups, ns.smooth, ns.figure)
        print(f"figure: {ns.figure}")
    if broken:
        print(f"STALENESS BOUND BROKEN in {len(broken)} cells: {', '.join(broken)}")
        return 1
    return 0
