"""The search demo's report (docs/agents.md): reward and searches per learner step, first and
last steps, over one or more runs of `configs/search_agent.yaml`.

    python tools/search_demo_report.py RUN_DIR [RUN_DIR ...] [--first 5] [--last 20]

Per step (from each run's `metrics.jsonl`): the mean reward of the trained samples, the share
of episodes whose search returned the answer (`traj/agent_useful_search`, counted by the agent)
and the tool calls per episode. Then, per run and as mean ± standard deviation over runs, the
means of the first and the last steps. With one run the table lists the steps themselves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from asyncrl.metrics import read_jsonl

COLUMNS = (
    ("reward_mean", "reward"),
    ("traj/agent_useful_search", "useful search"),
    ("traj/agent_tool_calls", "calls/episode"),
)


def steps_of(run_dir: Path) -> list[dict[str, Any]]:
    """The run's learner steps, in order."""
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward_mean" in r]
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no learner steps")
    return rows


def window_means(steps: list[dict[str, Any]], first: int, last: int) -> dict[str, float]:
    """`<column>@first` and `<column>@last`: the column's mean over the first and last steps."""
    out = {}
    for key, _ in COLUMNS:
        for name, chosen in (("first", steps[:first]), ("last", steps[-last:])):
            values = [float(s.get(key, 0.0)) for s in chosen]
            out[f"{key}@{name}"] = sum(values) / len(values)
    return out


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in [header, *rows]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+")
    parser.add_argument("--first", type=int, default=5)
    parser.add_argument("--last", type=int, default=20)
    ns = parser.parse_args(argv)
    try:
        runs = {d: steps_of(d) for d in ns.run_dirs}
    except (OSError, ValueError) as e:
        print(f"search_demo_report: {e}", file=sys.stderr)
        return 1
    labels = [label for _, label in COLUMNS]
    if len(runs) == 1:
        (steps,) = runs.values()
        shown = steps[: ns.first] + steps[-ns.last :] if len(steps) > ns.first + ns.last else steps
        rows = [
            [str(s["step"]), *(f"{float(s.get(k, 0.0)):.3f}" for k, _ in COLUMNS)] for s in shown
        ]
        print(_table(["step", *labels], rows), end="\n\n")
    means = {d: window_means(steps, ns.first, ns.last) for d, steps in runs.items()}
    header = ["run", *(f"{label} {w}" for _, label in COLUMNS for w in ("first", "last"))]
    keys = [f"{k}@{w}" for k, _ in COLUMNS for w in ("first", "last")]
    rows = [[d.name, *(f"{m[k]:.3f}" for k in keys)] for d, m in means.items()]
    if len(runs) > 1:
        spread = [[means[d][k] for d in runs] for k in keys]
        rows.append(
            ["mean±sd", *(f"{statistics.mean(v):.3f}±{statistics.stdev(v):.3f}" for v in spread)]
        )
    print(f"first {ns.first} and last {ns.last} steps")
    print(_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
