"""Figures for tools/gpu_check.sh's summary: one `name: value` line per figure, on stdout.

    python tools/gpu_check_report.py launch NAME RUN_DIR    # a run's learning and speed
    python tools/gpu_check_report.py junit NAME FILE.xml    # a pytest run's counts and failures
    python tools/gpu_check_report.py json NAME FILE.json    # every scalar of a bench's report
    python tools/gpu_check_report.py learner NAME FILE.json # tools/bench_learner.py's figures
    python tools/gpu_check_report.py gpu-tests TESTS_DIR    # the test modules with gpu tests

`launch` reads the run directory `asyncrl launch` writes (metrics.jsonl, launch.json): steps
done, the mean reward of the first 5 and last 20 steps and the gain (the launcher's own summary,
`asyncrl.launch.progress.Progress.summary`), whether it learned (gain of at least +0.3, the
acceptance of issue 27), and the medians of step time and weight-sync time. It works on a run
cut short by a timeout too: the steps written so far count. `learner` reads the JSON of
tools/bench_learner.py: each configuration's speed, memory and MFU (or its error), the derived
ratios, and the verdicts of issue 28's acceptance (bf16-packed at least 0.9x the bare model's
tokens/s with at most 1.1x its peak memory). `gpu-tests` lists the test modules that hold a
`gpu`-marked test, which are all the gpu tier hands pytest: a module without one may import what
the GPU machine lacks (openai, Ray), and one module that fails to import stops pytest's whole
collection. Standard library only, so it runs in any Python the check finds.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

LEARNS_GAIN = 0.3
"""The reward gain over the run that counts as learning (issue 27: "learns (+0.3)")."""
PACKED_OVER_BARE = {"tokens_per_s": (">=", 0.9), "peak_mem": ("<=", 1.1)}
"""Issue 28's acceptance: bf16-packed against the bare model, on a GPU."""
LEARNER_KEYS = (
    "tokens_per_s",
    "seconds_per_update",
    "mfu",
    "tflops_per_s",
    "peak_mem_mib",
    "update_peak_mem_mib",
    "recompute_peak_mem_mib",
    "peak_reserved_mib",
    "micro_batches",
    "recompute_micro_batches",
    "recompute_s",
    "computed_tokens",
)
"""What `learner` prints of each configuration of tools/bench_learner.py."""
GPU_MARK = re.compile(r"\bmark\.gpu\b")
"""How a test module marks a gpu test (`@pytest.mark.gpu`, `pytestmark = [..., pytest.mark.gpu]`,
`pytest.param(..., marks=pytest.mark.gpu)`); tests/integration/test_gpu_check_tools.py checks
that pytest's own `-m gpu` collection finds no module beyond these."""


def gpu_test_files(tests_dir: Path) -> list[Path]:
    return sorted(p for p in tests_dir.rglob("test_*.py") if GPU_MARK.search(p.read_text()))


def launch_figures(name: str, run_dir: Path) -> list[str]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return [f"{name}.steps: 0 (no {metrics})"]
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the timeout's kill
            continue
        if "reward_mean" in row:  # a learner step (a validation row has none)
            rows.append(row)
    lines = [f"{name}.steps: {len(rows)}"]
    if not rows:
        return lines
    first = statistics.fmean(r["reward_mean"] for r in rows[:5])
    last = statistics.fmean(r["reward_mean"] for r in rows[-20:])
    gain = last - first
    lines += [
        f"{name}.reward_first5: {first:.3f}",
        f"{name}.reward_last20: {last:.3f}",
        f"{name}.reward_gain: {gain:+.3f}",
        f"{name}.learns: {'yes' if gain >= LEARNS_GAIN else 'no'} (gain >= +{LEARNS_GAIN})",
    ]
    for key in ("step_time_s", "weight_sync_s", "time_update_s", "gen_tokens_per_s"):
        values = [r[key] for r in rows[1:] or rows if isinstance(r.get(key), int | float)]
        if values:
            lines.append(f"{name}.{key}_median: {statistics.median(values):.4g}")
    spec = run_dir / "launch.json"
    if spec.is_file():
        for key, value in json.loads(spec.read_text()).items():
            if key not in ("run_dir", "model_path") and not isinstance(value, dict | list):
                lines.append(f"{name}.launch.{key}: {value}")
    return lines


def junit_figures(name: str, path: Path) -> list[str]:
    if not path.is_file():
        return [f"{name}.junit: missing ({path})"]
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    seconds = sum(float(s.get("time", 0)) for s in suites)
    passed = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    lines = [
        f"{name}.passed: {passed}",
        f"{name}.failed: {totals['failures'] + totals['errors']}",
        f"{name}.skipped: {totals['skipped']}",
        f"{name}.test_seconds: {seconds:.0f}",
    ]
    for case in root.iter("testcase"):
        for bad in ("failure", "error"):
            found = case.find(bad)
            if found is not None:
                what = (
                    (found.get("message") or "").splitlines()[0][:160]
                    if found.get("message")
                    else ""
                )
                lines.append(f"{name}.{bad}: {case.get('classname')}::{case.get('name')} {what}")
    return lines


def flatten(prefix: str, value) -> list[str]:
    """`prefix.key: value` for every scalar under `value`; a list of records with a `mode`,
    `model` or `name` field is keyed by it (with its rows, when it has them) instead of its
    index."""
    if isinstance(value, dict):
        return [line for k, v in value.items() for line in flatten(f"{prefix}.{k}", v)]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        lines = []
        for i, item in enumerate(value):
            label = [str(item[k]) for k in ("mode", "model", "name", "impl") if k in item]
            if "rows" in item:
                label.append(f"rows{item['rows']}")
            key = ".".join(label) or str(i)
            named = ("mode", "model", "name", "impl", "rows")
            rest = {k: v for k, v in item.items() if k not in named}
            lines += flatten(f"{prefix}.{key}", rest)
        return lines
    if isinstance(value, list):
        return [f"{prefix}: {json.dumps(value)}"]
    if isinstance(value, float):
        return [f"{prefix}: {value:.6g}"]
    return [f"{prefix}: {value}"]


def json_figures(name: str, path: Path) -> list[str]:
    if not path.is_file():
        return [f"{name}.json: missing ({path})"]
    try:
        return flatten(name, json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        return [f"{name}.json: unreadable ({e})"]


def learner_figures(name: str, path: Path) -> list[str]:
    if not path.is_file():
        return [f"{name}.json: missing ({path})"]
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        return [f"{name}.json: unreadable ({e})"]
    lines = [f"{name}.{k}: {record.get(k)}" for k in ("model", "device", "peak_tflops")]
    if record.get("partial"):
        lines.append(f"{name}.partial: yes (cut short after {len(record['configs'])} configs)")
    lines += flatten(f"{name}.real_tokens", record["batch"]["real_tokens"])
    for config, result in record["configs"].items():
        if "error" in result:
            lines.append(f"{name}.{config}.error: {result['error'].splitlines()[0][:160]}")
            continue
        for key in LEARNER_KEYS:
            if key in result:
                lines += flatten(f"{name}.{config}.{key}", result[key])
    derived = record.get("derived", {})
    lines += flatten(f"{name}.derived", derived)
    for figure, (sign, bound) in PACKED_OVER_BARE.items():
        value = derived.get(f"packed_over_bare_{figure}")
        if value is None or record.get("device") != "cuda":  # the acceptance is the GPU's
            continue
        met = value >= bound if sign == ">=" else value <= bound
        verdict = "yes" if met else "no"
        lines.append(f"{name}.packed_over_bare_{figure}.meets: {verdict} ({sign} {bound}x)")
    return lines


def main(argv: list[str]) -> int:
    kinds = {
        "launch": launch_figures,
        "junit": junit_figures,
        "json": json_figures,
        "learner": learner_figures,
    }
    if len(argv) == 2 and argv[0] == "gpu-tests":
        for test_file in gpu_test_files(Path(argv[1])):
            print(test_file)
        return 0
    if len(argv) != 3 or argv[0] not in kinds:
        print(__doc__, file=sys.stderr)
        return 2
    kind, name, path = argv
    for line in kinds[kind](name, Path(path)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
