"""Time from process start to a target mean reward, for one or more source trees, interleaved.

    python tools/time_to_reward.py [--runs 5] [--target 0.8] [--window 20] [--max-steps 500]
                                   [--tree NAME=PATH ...] [override ...]

Each run is `python -m asyncrl.launch.cli launch` in a fresh process, with the tree's directory
first on PYTHONPATH (so `--tree base=/path/to/old/checkout` times an older commit against this
one), and is stopped as soon as the mean reward of the last `--window` steps reaches
`--target`. The time is measured from the launch process's start (imports, model load, fleet
start-up included) to the `time` of the step that crossed the target. Runs of the trees
alternate (a, b, a, b, ...) so that machine noise hits both alike; medians are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(tree: Path, overrides: list[str], target: float, window: int, max_steps: int):
    """(seconds to target or None, steps taken) for one `asyncrl launch` of `tree`."""
    run_dir = Path(tempfile.mkdtemp(prefix="ttr-"))
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "asyncrl.launch.cli", "launch", f"trainer.run_dir={run_dir}"]
    cmd += [f"trainer.total_steps={max_steps}", "launch.progress=none", *overrides]
    start = time.time()
    proc = subprocess.Popen(
        cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metrics = run_dir / "metrics.jsonl"
    rewards: list[float] = []
    reached = None
    seen = 0
    while proc.poll() is None and reached is None:
        time.sleep(0.2)
        if not metrics.exists():
            continue
        lines = metrics.read_text().splitlines()
        for line in lines[seen:]:
            if not line.endswith("}"):
                break
            seen += 1
            rec = json.loads(line)
            if "reward_mean" not in rec:
                continue
            rewards.append(rec["reward_mean"])
            last = rewards[-window:]
            if len(last) == window and sum(last) / window >= target:
                reached = rec["time"] - start
                break
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    return reached, len(rewards)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--max-steps", type=int, default=500)
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        help="NAME=PATH of a source tree (default: this checkout as 'here')",
    )
    ap.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    trees = dict(t.split("=", 1) for t in args.tree) or {"here": str(here)}
    results: dict[str, list[float | None]] = {name: [] for name in trees}
    for i in range(args.runs):
        for name, path in trees.items():
            took, steps = one_run(
                Path(path), args.overrides, args.target, args.window, args.max_steps
            )
            results[name].append(took)
            shown = f"{took:.1f} s" if took is not None else "not reached"
            print(f"run {i + 1}/{args.runs} {name}: {shown} ({steps} steps)", flush=True)
    print(f"\ntime to a {args.window}-step mean reward of {args.target}, from process start:")
    medians: dict[str, float | None] = {}
    for name, times in results.items():
        ok = [t for t in times if t is not None]
        medians[name] = statistics.median(ok) if ok else None
        shown = ", ".join("-" if t is None else f"{t:.1f}" for t in times)
        med = f"{medians[name]:.1f} s" if medians[name] is not None else "n/a"
        print(f"  {name:>10}: median {med}  runs [{shown}]")
    names, found = list(medians), [m for m in medians.values() if m]
    if len(names) == 2 and len(found) == 2:
        a, b = names
        print(f"  ratio {b}/{a}: {found[1] / found[0]:.2f}")


if __name__ == "__main__":
    main()
