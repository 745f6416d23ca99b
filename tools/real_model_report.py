"""Report runs of the real-model demo (docs/real_model.md): one figure, one table.

    python tools/real_model_report.py full-sync=runs/a full-async=runs/b \\
        lora-sync=runs/c lora-async=runs/d --figure docs/real_model.png

Each NAME=RUN_DIR is a finished `asyncrl launch` run directory. A name ending in `-sync` is the
synchronous reference of the run whose name ends in `-async` with the same prefix.

Per run it prints: steps, samples, wall time (from the launch, start-up included), seconds per
step, the mean reward of the first 5 and of the last 10 learner steps, the gain and its standard
error (the per-step means' spread: sqrt(var_first / 5 + var_last / 10)), the wall-clock minutes
until its 5-step running mean first reaches `--level` (0.8), the mean mismatch KL and weight-sync
seconds. For each async run it also prints when its 5-step running mean first reaches
its sync reference's final reward (the sync run's last-10 mean), next to when the sync run does.

The figure has two panels, reward against wall-clock minutes and against samples, for all runs:
faint per-step means and a 5-step running mean.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from asyncrl.metrics import read_jsonl

FIRST, LAST, SMOOTH = 5, 10, 5


@dataclass
class Run:
    name: str
    minutes: list[float]
    samples: list[int]
    rewards: list[float]
    mismatch_kl: float
    sync_s: float

    @property
    def smoothed(self) -> list[float]:
        return running_mean(self.rewards, SMOOTH)

    def reaches(self, level: float) -> float | None:
        """Wall-clock minutes at which the running mean first reaches `level`."""
        return next(
            (m for m, r in zip(self.minutes, self.smoothed, strict=True) if r >= level), None
        )


def running_mean(xs: list[float], window: int) -> list[float]:
    """Trailing running mean: element i is the mean of xs[i - window + 1 : i + 1] (fewer at the
    start)."""
    out = []
    for i in range(len(xs)):
        part = xs[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def var(xs: list[float]) -> float:
    """Sample variance (n - 1)."""
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def load_run(name: str, run_dir: Path) -> Run:
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward_mean" in r]
    if len(rows) < FIRST + LAST:
        raise SystemExit(f"{name}: {len(rows)} steps in {run_dir}; need {FIRST + LAST}")
    start = (run_dir / "config.yaml").stat().st_mtime  # written when the launch starts
    samples, total = [], 0
    for r in rows:
        total += int(r["samples"])
        samples.append(total)
    return Run(
        name,
        [(r["time"] - start) / 60 for r in rows],
        samples,
        [float(r["reward_mean"]) for r in rows],
        mean([float(r.get("mismatch_kl", math.nan)) for r in rows]),
        mean([float(r.get("weight_sync_s", math.nan)) for r in rows]),
    )


def gain(run: Run) -> tuple[float, float, float, float]:
    first, last = run.rewards[:FIRST], run.rewards[-LAST:]
    se = math.sqrt(var(first) / FIRST + var(last) / LAST)
    return mean(first), mean(last), mean(last) - mean(first), se


def table(runs: list[Run], level: float) -> str:
    lines = [
        "| run | steps | samples | wall min | s/step | first 5 | last 10 | gain | SE | gain/SE "
        f"| min to {level:g} | mismatch KL | sync s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        f, last, g, se = gain(run)
        per_step = run.minutes[-1] * 60 / len(run.rewards)
        reached = run.reaches(level)
        to_level = "never" if reached is None else f"{reached:.1f}"
        lines.append(
            f"| {run.name} | {len(run.rewards)} | {run.samples[-1]} | {run.minutes[-1]:.1f} "
            f"| {per_step:.1f} | {f:.3f} | {last:.3f} | {g:+.3f} | {se:.3f} | {g / se:.1f} "
            f"| {to_level} | {run.mismatch_kl:.2g} | {run.sync_s:.2f} |"
        )
    return "\n".join(lines)


def sooner(runs: dict[str, Run]) -> list[str]:
    lines = []
    for name, run in runs.items():
        if not name.endswith("-async"):
            continue
        ref = runs.get(name.removesuffix("-async") + "-sync")
        if ref is None:
            continue
        level = mean(ref.rewards[-LAST:])
        mine, theirs = run.reaches(level), ref.reaches(level)

        def fmt(m: float | None) -> str:
            return "never" if m is None else f"{m:.1f} min"

        verdict = (
            "sooner" if mine is not None and (theirs is None or mine < theirs) else "not sooner"
        )
        lines.append(
            f"{name}: reaches {ref.name}'s final reward {level:.3f} (5-step running mean) at "
            f"{fmt(mine)}; {ref.name} at {fmt(theirs)}: {verdict}"
        )
    return lines


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    prefixes = list(dict.fromkeys(run.name.rsplit("-", 1)[0] for run in runs))
    for run in runs:  # one color per prefix (full, lora), dashed sync, solid async
        color = f"C{prefixes.index(run.name.rsplit('-', 1)[0])}"
        style = "-" if run.name.endswith("-async") else "--"
        for ax, xs in ((by_time, run.minutes), (by_samples, run.samples)):
            ax.plot(xs, run.rewards, color=color, alpha=0.25, linewidth=1)
            ax.plot(xs, run.smoothed, color=color, linestyle=style, label=run.name)
    by_time.set_xlabel("wall-clock minutes since launch")
    by_samples.set_xlabel("samples trained")
    by_time.set_ylabel(f"mean reward (per step, and {SMOOTH}-step running mean)")
    for ax in (by_time, by_samples):
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1)
    by_samples.legend(loc="lower right")
    fig.suptitle("SmolLM2-135M-Instruct, GRPO on arith_chat, vLLM on a 2-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="NAME=RUN_DIR")
    parser.add_argument("--figure", type=Path, help="write the figure here (PNG)")
    parser.add_argument(
        "--level", type=float, default=0.8, help="report minutes until the running mean reaches it"
    )
    ns = parser.parse_args()
    runs = {}
    for spec in ns.runs:
        name, _, path = spec.partition("=")
        if not path:
            parser.error(f"{spec!r}: expected NAME=RUN_DIR")
        runs[name] = load_run(name, Path(path))
    print(table(list(runs.values()), ns.level))
    for line in sooner(runs):
        print(line)
    if ns.figure:
        plot(list(runs.values()), ns.figure)
        print(f"figure: {ns.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
