"""How the policy did by the task's own rule, for runs trained on a reward model and on the rule.

    python tools/reward_model_report.py RUN_DIR [RUN_DIR ...]

For each run: what it trained on (the reward model alone, `reward.rule_weight=0`; the rule and
the model; a `reward.combine` function of them; or the rule), and the rule reward of its training samples (`traj/reward_rule` where a
reward model ran, else `reward_mean`, which is the rule) over its first 5 steps, over the 20
steps before step 100, 200 and the end, and the seconds from the first step's start to a
20-step mean of 0.8. A run trained on the model never sees the rule; this is the measure of
whether the model taught it the task.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from asyncrl.launch.progress import training_rows
from asyncrl.metrics import read_jsonl

TARGET = 0.8  # the rule reward whose time to reach is reported


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def trained_on(run_dir: Path) -> str:
    """model | rule+model | combine (a `reward.combine` function) | rule, from config.yaml."""
    reward = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("reward", {})
    if not (reward.get("model") or {}).get("path"):
        return "rule"
    if (reward.get("combine") or {}).get("path"):
        return "combine"
    return "model" if reward.get("rule_weight", 1.0) == 0 else "rule+model"


def rule_rewards(rows: list[dict[str, Any]]) -> list[float]:
    return [r.get("traj/reward_rule", r["reward_mean"]) for r in rows]


def summarize(run_dir: Path) -> dict[str, Any]:
    rows = training_rows(read_jsonl(run_dir / "metrics.jsonl"))
    if not rows:
        raise ValueError(f"{run_dir} has no training steps in metrics.jsonl")
    rule = rule_rewards(rows)
    start = rows[0]["time"] - rows[0].get("step_s", 0.0)
    reached = next(
        (
            rows[i]["time"] - start
            for i in range(19, len(rule))
            if _mean(rule[i - 19 : i + 1]) >= TARGET
        ),
        None,
    )
    return {
        "run": run_dir.name,
        "trained_on": trained_on(run_dir),
        "steps": len(rows),
        "first5": _mean(rule[:5]),
        "at100": _mean(rule[80:100]),
        "at200": _mean(rule[180:200]),
        "last20": _mean(rule[-20:]),
        "s_to_target": reached,
        "wall_s": rows[-1]["time"] - start,
    }


def table(summaries: list[dict[str, Any]]) -> str:
    head = f"{'run':<22} {'trained on':<11} {'steps':>5} {'first 5':>7} {'@100':>6} {'@200':>6} "
    head += f"{'last 20':>7} {'s to ' + str(TARGET):>8} {'wall s':>7}"
    lines = [head]
    for s in summaries:
        reached = "-" if s["s_to_target"] is None else f"{s['s_to_target']:.0f}"
        lines.append(
            f"{s['run']:<22} {s['trained_on']:<11} {s['steps']:>5} {s['first5']:>7.3f} "
            f"{s['at100']:>6.3f} {s['at200']:>6.3f} {s['last20']:>7.3f} {reached:>8} "
            f"{s['wall_s']:>7.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    try:
        print(table([summarize(Path(a)) for a in argv]))
    except ValueError as e:
        print(f"reward_model_report: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
