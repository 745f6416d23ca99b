"""Tool use over a run, by learner-version buckets, from `RUN_DIR/rollout_metrics.jsonl`.

    python tools/tool_demo_report.py RUN_DIR [--buckets 4]

Each rollout server writes one line per trajectory (see
`rollout_servers.trajectory_log.TrajectoryMetricsLog`); evaluation samples are left out. A
trajectory's bucket is the newest policy version that sampled any of its tokens, so "early" and
"late" are the policy's age, not the wall clock. A correct tool call is a trajectory that called
a tool and whose final answer earned full reward (the final answer of the tool demo is right
exactly when the call was).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from asyncrl.metrics import read_jsonl

COLUMNS = (
    ("reward", "mean reward"),
    ("tool_share", "share with >=1 tool call"),
    ("correct_tool_share", "share with a correct tool call"),
    ("tool_calls", "tool calls / traj"),
    ("tool_errors", "tool errors / traj"),
    ("malformed_calls", "malformed calls / traj"),
    ("turns", "turns / traj"),
)


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    """Means over trajectories of the columns in COLUMNS."""
    n = len(records)
    metric = [r.get("metrics", {}) for r in records]
    called = [m.get("tool_calls", 0.0) >= 1 for m in metric]
    return {
        "n": float(n),
        "reward": sum(r["reward"] for r in records) / n,
        "tool_share": sum(called) / n,
        "correct_tool_share": sum(
            c and r["reward"] >= 1.0 for c, r in zip(called, records, strict=True)
        )
        / n,
        **{k: sum(m.get(k, 0.0) for m in metric) / n for k in ("tool_calls", "tool_errors")},
        **{k: sum(m.get(k, 0.0) for m in metric) / n for k in ("malformed_calls", "turns")},
    }


def bucket_by_version(
    records: list[dict[str, Any]], buckets: int
) -> list[tuple[int, int, list[dict[str, Any]]]]:
    """(first version, last version, records) for `buckets` equal version ranges in order;
    empty ranges are left out."""
    versions = [r["version"] for r in records]
    lo, hi = min(versions), max(versions)
    width = max(1, -(-(hi - lo + 1) // buckets))
    out = []
    for start in range(lo, hi + 1, width):
        end = min(hi, start + width - 1)
        chosen = [r for r in records if start <= r["version"] <= end]
        if chosen:
            out.append((start, end, chosen))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--buckets", type=int, default=4)
    ns = parser.parse_args(argv)
    records = [r for r in read_jsonl(ns.run_dir / "rollout_metrics.jsonl") if not r["eval"]]
    if not records:
        print(f"no training trajectories in {ns.run_dir / 'rollout_metrics.jsonl'}")
        return 1
    header = ["versions", "n", *(k for k, _ in COLUMNS)]
    rows = [
        [f"{a}-{b}", f"{int(s['n'])}", *(f"{s[k]:.3f}" for k, _ in COLUMNS)]
        for a, b, chosen in bucket_by_version(records, ns.buckets)
        for s in [summarize(chosen)]
    ]
    all_stats = summarize(records)
    rows.append(["all", f"{len(records)}", *(f"{all_stats[k]:.3f}" for k, _ in COLUMNS)])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for line in [header, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
    print("\n".join(f"{k}: {label}" for k, label in COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
