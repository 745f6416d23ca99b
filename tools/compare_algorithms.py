"""Run the embedded default under several algorithm settings and print one table.

    python tools/compare_algorithms.py estimators     # grpo, rloo, reinforce_plus_plus, gae, ...
    python tools/compare_algorithms.py staleness      # max_staleness=4: no correction vs decoupled
    python tools/compare_algorithms.py estimators trainer.seed=1 data.seed=1   # extra overrides
    python tools/compare_algorithms.py staleness --only stale4_no_correction,stale0_on_policy

For each setting: mean reward of the first 5 and last 20 learner steps, the gain, the last-20
mean of the mismatch KL and of the clip fraction, the wall time, and whether it learned (gain
>= 0.3). The runs go one after another, so wall times are comparable.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl

DECOUPLED_TIS = [
    "algorithm.correction.type=truncated_is",
    "algorithm.correction.level=token",
    "algorithm.correction.cap=2.0",
]
MINI4 = ["learner.ppo_mini_batch_size=4"]  # 4 optimizer steps per batch (16 groups)
REJECT = [
    "algorithm.rejection.type=token",
    "algorithm.rejection.metric=ratio",
    "algorithm.rejection.low=0.5",
    "algorithm.rejection.high=2.0",
]

SUITES = {
    "estimators": {
        "grpo": [],
        "rloo": ["algorithm.adv_estimator=rloo"],
        "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus"],
        "reinforce_plus_plus_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
        "remax": ["algorithm.adv_estimator=remax"],
        "gae": ["algorithm.adv_estimator=gae"],
    },
    "staleness": {
        "stale4_no_correction": ["replay.max_staleness=4"],
        "stale4_decoupled_tis": ["replay.max_staleness=4", *DECOUPLED_TIS],
        "stale4_no_correction_mb4": ["replay.max_staleness=4", *MINI4],
        "stale4_decoupled_tis_mb4": ["replay.max_staleness=4", *DECOUPLED_TIS, *MINI4],
        "stale4_decoupled_tis_reject": ["replay.max_staleness=4", *DECOUPLED_TIS, *REJECT],
        "stale0_on_policy": ["replay.max_staleness=0"],
    },
}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in SUITES:
        print(__doc__)
        return 2
    suite, extra = sys.argv[1], sys.argv[2:]
    only = None
    if "--only" in extra:
        i = extra.index("--only")
        only, extra = set(extra[i + 1].split(",")), extra[:i] + extra[i + 2 :]
    work = Path(tempfile.mkdtemp(prefix=f"asyncrl-{suite}-"))
    rows = []
    for name, overrides in SUITES[suite].items():
        if only is not None and name not in only:
            continue
        cfg = load_config(
            overrides=[
                f"trainer.run_dir={work / name}",
                "launch.progress=none",
                "trainer.save_final=false",
                *overrides,
                *extra,
            ]
        )
        started = time.monotonic()
        run_dir = launch(cfg)
        wall = time.monotonic() - started
        m = read_jsonl(run_dir / "metrics.jsonl")
        first, last = (
            _mean([r["reward_mean"] for r in m[:5]]),
            _mean([r["reward_mean"] for r in m[-20:]]),
        )
        rows.append(
            (
                name,
                first,
                last,
                last - first,
                _mean([r["mismatch_kl"] for r in m[-20:]]),
                _mean([r["clip_frac"] for r in m[-20:]]),
                wall,
            )
        )
    print(
        "\n| setting | reward first 5 | reward last 20 | gain | mismatch KL (last 20) "
        "| clip frac | wall s | learned |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, first, last, gain, kl, clip, wall in rows:
        print(
            f"| {name} | {first:.3f} | {last:.3f} | {gain:+.3f} | {kl:.2e} | {clip:.3f} "
            f"| {wall:.0f} | {'yes' if gain >= 0.3 else 'no'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
