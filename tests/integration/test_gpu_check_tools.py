"""What tools/gpu_check.sh runs works on the CPU, at small sizes, so that a lent GPU is never the
first place its plumbing runs: tools/bench_gpu_engine.py and tools/bench_update_modes.py end to
end on the tiny model, and tools/gpu_check_report.py's figures, checked against values worked out
by hand. Speed figures are checked for presence and sign only (they depend on the machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str, *args: str, timeout: float = 180) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.long  # over 30 s: its own CI step (the default tier stays under 15 min)
def test_bench_gpu_engine_samples_the_same_tokens_both_ways_on_cpu(tmp_path):
    out = tmp_path / "engine.json"
    args = ["--device", "cpu", "--models", "tiny", "--rows", "3", "--prompt-len", "8"]
    _tool(
        "bench_gpu_engine.py", *args, "--max-new-tokens", "5", "--rounds", "1", "--json", str(out)
    )
    report = json.loads(out.read_text())
    got = {(r["impl"], r["rows"]): r for r in report["results"]}
    assert set(got) == {("hf_engine", 3), ("generate", 3)}
    for (_, rows), r in got.items():
        assert r["tokens"] == rows * 5  # ignore_eos / min_new_tokens: exact lengths
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0
    assert set(report["hf_engine_over_generate"]) == {"tiny rows=3"}


def test_bench_update_modes_applies_versions_in_flight_and_drained_on_cpu(tmp_path):
    out = tmp_path / "modes.json"
    args = ["--device", "cpu", "--model", "tiny", "--rows", "4", "--prompt-len", "8"]
    args += ["--min-new-tokens", "8", "--max-new-tokens", "40", "--interval", "0.2"]
    _tool("bench_update_modes.py", *args, "--seconds", "1.5", "--json", str(out))
    modes = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert list(modes) == ["none", "drain", "inflight"]
    assert modes["none"]["versions"] == 0 and modes["none"]["stall_mean_s"] == 0
    for mode in ("drain", "inflight"):
        m = modes[mode]
        assert m["versions"] >= 2 and m["tokens_per_s"] > 0, m
        assert 0 < m["apply_mean_s"] <= m["stall_mean_s"] + 1e-9 <= m["stall_max_s"] + 2e-9, m
    # only in flight do responses span versions; a drain waits for the rows (stall > apply)
    assert modes["drain"]["multi_version_frac"] == 0 < modes["inflight"]["multi_version_frac"]
    assert modes["drain"]["stall_mean_s"] > modes["drain"]["apply_mean_s"]
    assert modes["inflight"]["stall_mean_s"] == modes["inflight"]["apply_mean_s"]


def _metrics(run_dir: Path, rewards: list[float]) -> None:
    rows = [{"step": 0, "val/mean_score": 0.1}]  # a validation row: not a step
    rows += [
        {"step": i + 1, "reward_mean": r, "step_time_s": 0.1 * (i + 1), "weight_sync_s": 0.01}
        for i, r in enumerate(rewards)
    ]
    run_dir.mkdir()
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run_dir / "metrics.jsonl").write_text(text + '{"step": 99, "reward_me')  # cut by a kill
    (run_dir / "launch.json").write_text(json.dumps({"run_dir": "x", "threads": 8}))


def test_report_of_a_launch_that_learns_and_of_one_that_does_not(tmp_path):
    _metrics(tmp_path / "up", [0.2] * 5 + [0.5] * 15 + [0.6] * 20)
    lines = _tool("gpu_check_report.py", "launch", "run", str(tmp_path / "up")).splitlines()
    assert "run.steps: 40" in lines
    assert "run.reward_first5: 0.200" in lines and "run.reward_last20: 0.600" in lines
    assert "run.reward_gain: +0.400" in lines
    assert "run.learns: yes (gain >= +0.3)" in lines
    assert "run.step_time_s_median: 2.1" in lines  # median of 0.2 .. 4.0 (the first step left out)
    assert "run.launch.threads: 8" in lines
    _metrics(tmp_path / "flat", [0.3] * 5 + [0.5] * 20)
    lines = _tool("gpu_check_report.py", "launch", "run", str(tmp_path / "flat")).splitlines()
    assert "run.learns: no (gain >= +0.3)" in lines  # +0.2 < +0.3
    assert _tool("gpu_check_report.py", "launch", "run", str(tmp_path)).startswith("run.steps: 0")


def test_report_of_junit_counts_and_names_failures(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1" time="12.5">'
        '<testcase classname="a" name="ok"/><testcase classname="a" name="skip"><skipped/>'
        '</testcase><testcase classname="b" name="bad"><failure message="boom&#10;more"/>'
        '</testcase><testcase classname="a" name="ok2"/></testsuite></testsuites>'
    )
    lines = _tool("gpu_check_report.py", "junit", "tier", str(xml)).splitlines()
    assert lines[:4] == [
        "tier.passed: 2",
        "tier.failed: 1",
        "tier.skipped: 1",
        "tier.test_seconds: 12",
    ]
    assert lines[4:] == ["tier.failure: b::bad boom"]


def test_report_of_a_bench_json_keys_records_by_their_names(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(
        json.dumps(
            {
                "device": "x",
                "results": [
                    {"model": "tiny", "impl": "generate", "rows": 2, "tokens_per_s": 12.34567},
                    {"mode": "drain", "versions": 3},
                ],
                "sizes": [1, 2],
            }
        )
    )
    lines = _tool("gpu_check_report.py", "json", "b", str(path)).splitlines()
    assert lines == [
        "b.device: x",
        "b.results.tiny.generate.rows2.tokens_per_s: 12.3457",
        "b.results.drain.versions: 3",
        "b.sizes: [1, 2]",
    ]
    missing = _tool("gpu_check_report.py", "json", "b", str(tmp_path / "none.json"))
    assert missing.startswith("b.json: missing")


def test_report_of_the_learner_bench_judges_packed_against_bare(tmp_path):
    path = tmp_path / "learner.json"
    fast = {"tokens_per_s": 23188.0, "peak_mem_mib": 119706.0, "mfu": 0.17, "seconds": [3.0]}
    path.write_text(
        json.dumps(
            {
                "model": "m",
                "device": "cuda",
                "peak_tflops": 989.0,
                "batch": {"real_tokens": 71065},
                "configs": {
                    "bf16-packed": {**fast, "update_stats": {"loss": 0.1}},
                    "bare": {"tokens_per_s": 51191.0, "peak_mem_mib": 62669.0},
                    "bf16-padded": {"error": "OutOfMemoryError: CUDA out of memory\ntrace"},
                },
                "derived": {
                    "packed_over_bare_tokens_per_s": 23188.0 / 51191.0,
                    "packed_over_bare_peak_mem": 119706.0 / 62669.0,
                },
            }
        )
    )
    lines = _tool("gpu_check_report.py", "learner", "l", str(path)).splitlines()
    assert lines == [
        "l.model: m",
        "l.device: cuda",
        "l.peak_tflops: 989.0",
        "l.real_tokens: 71065",
        "l.bf16-packed.tokens_per_s: 23188",
        "l.bf16-packed.mfu: 0.17",
        "l.bf16-packed.peak_mem_mib: 119706",
        "l.bare.tokens_per_s: 51191",
        "l.bare.peak_mem_mib: 62669",
        "l.bf16-padded.error: OutOfMemoryError: CUDA out of memory",
        "l.derived.packed_over_bare_tokens_per_s: 0.45297",
        "l.derived.packed_over_bare_peak_mem: 1.91013",
        "l.packed_over_bare_tokens_per_s.meets: no (>= 0.9x)",  # 0.45x
        "l.packed_over_bare_peak_mem.meets: no (<= 1.1x)",  # 1.91x
    ]


@pytest.mark.long  # collects the whole tree: up to half a minute
def test_the_gpu_tier_hands_pytest_every_module_that_holds_a_gpu_test():
    """tools/gpu_check.sh runs `pytest -m gpu` on the modules `gpu-tests` lists (so that one
    importing openai or Ray, which the GPU machine lacks, cannot stop the collection): pytest's
    own `-m gpu` collection over the whole tree, with every dependency here, finds no module
    beyond them, whatever way a test is marked."""
    collected = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    modules = {line.split("::")[0] for line in collected.stdout.splitlines() if "::" in line}
    assert modules, collected.stdout[-2000:]  # the tree has gpu tests to find
    listed = _tool("gpu_check_report.py", "gpu-tests", "tests").split()
    assert modules <= set(listed), sorted(modules - set(listed))
    assert all(path.startswith("tests/") and path.endswith(".py") for path in listed)
