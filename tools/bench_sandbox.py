"""Startup latency and throughput of the code sandbox, beside a bare interpreter, in one run,
and the code reward end to end beside the path it replaced.

    python tools/bench_sandbox.py [--runs 100] [--jobs 48] [--part startup|reward|all]

Prints p50/p99 latency of `print(1)` through `Sandbox.run` for every backend that works here,
beside bare `python -c 'print(1)'` (what a plain subprocess costs, `site` included) and bare
`python -I -S -c 'print(1)'` (the interpreter mode the sandbox uses), each spawned the same way
(asyncio subprocess, output through pipes). Overhead is the sandbox p50 minus the bare p50;
target: at most 15 ms over bare `python -c`. Samples are interleaved round-robin so that load
from other processes on the machine hits every variant alike. Then executions/s of `--jobs`
programs through the pool with max_concurrent = 2 and 4.

The code reward part scores a 10-assert problem through `RewardComputer` (prepare, one sandbox
run, the trusted judge in a worker): latency p50/p99 per sample, beside the path it replaced (one
`python -I` subprocess per case, `rollout_servers/reward_sandbox.py` as of commit 4859939, read
from git and called directly, with no worker round trip), sampled round-robin; then rewards/s
at concurrency 1, 2 and 4 (sandbox slots = reward workers = concurrency); then, at concurrency
4, a candidate whose processes hoard memory: the peak memory of each run (its cgroup) against
`memory_mb`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

from rollout_servers.rewards.computer import RewardComputer
from rollout_servers.sandbox import Backend, Sandbox, SandboxConfig, SharedSandbox

BACKENDS: tuple[Backend, ...] = ("bwrap", "unshare", "process")


async def bare_python(*flags: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *flags,
        "-c",
        "print(1)",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    assert out == b"1\n", out


def setup_sandboxes(max_concurrent: int) -> dict[str, Sandbox]:
    sandboxes: dict[str, Sandbox] = {}
    for backend in BACKENDS:
        try:
            sandboxes[backend] = Sandbox(
                SandboxConfig(backend=backend, max_concurrent=max_concurrent)
            )
        except RuntimeError as exc:
            print(f"{backend:<22} unavailable: {exc}")
    return sandboxes


def sandboxed(sandbox: Sandbox) -> Callable[[], Awaitable[None]]:
    async def once() -> None:
        result = await sandbox.run("print(1)")
        assert result.status == "ok" and result.stdout == "1\n", result

    return once


async def latencies(variants: dict[str, Callable[[], Awaitable[None]]], runs: int) -> dict:
    """Milliseconds per call of each variant, sampled round-robin after one warm-up call each."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        await fn()
    for _ in range(runs):
        for name, fn in variants.items():
            start = time.perf_counter()
            await fn()
            samples[name].append((time.perf_counter() - start) * 1000)
    return samples


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def throughput(sandbox: Sandbox, jobs: int) -> float:
    start = time.perf_counter()
    results = await asyncio.gather(*(sandbox.run("print(1)") for _ in range(jobs)))
    assert all(r.status == "ok" for r in results)
    return jobs / (time.perf_counter() - start)


OLD_COMMIT = "4859939"
ASSERTS = [f"assert square({i}) == {i * i}" for i in range(10)]
SOLUTION = "```python\ndef square(x):\n    return x * x\n```"
HOARDER = (
    "```python\nimport os, time\nfor _ in range(6):\n    if os.fork() == 0:\n"
    "        hoard = []\n        try:\n            while True:\n"
    "                hoard.append(bytearray(16 << 20))\n        except MemoryError:\n"
    "            time.sleep(1)\n        os._exit(0)\ntime.sleep(1.5)\n"
    "def square(x):\n    return x * x\n```"
)


def old_code_reward():
    """`code_reward_fn` of the path this replaced, from git (None outside a checkout)."""
    try:
        source = subprocess.run(
            ["git", "show", f"{OLD_COMMIT}:rollout_servers/reward_sandbox.py"],
            capture_output=True,
            check=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = os.path.join(tempfile.mkdtemp(), "old_reward_sandbox.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("old_reward_sandbox", path)
    assert spec is not None and spec.loader is not None  # a .py path always has both
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module.code_reward_fn


async def reward_part(runs: int, jobs: int) -> None:
    extra = {"test_cases": {"asserts": ASSERTS}}
    shared = SharedSandbox(SandboxConfig(max_concurrent=1))
    rc = RewardComputer(30.0, num_workers=1, sandbox=shared)
    variants: dict[str, Callable[[], Awaitable[None]]] = {}

    async def new() -> None:
        score, _ = await rc.score("code", SOLUTION, "", extra)
        assert score == 1.0

    variants["code reward (sandbox)"] = new
    old = old_code_reward()
    if old is not None:

        async def before() -> None:
            result = await asyncio.to_thread(old, "code", SOLUTION, json.dumps(extra["test_cases"]))
            assert result["score"] == 1.0, result

        variants[f"replaced path ({OLD_COMMIT})"] = before
    samples = await latencies(variants, runs)
    print(f"\ncode reward, 10 asserts, {runs} samples each: p50 / p99 ms")
    for name, values in samples.items():
        print(
            f"{name:<28} p50 {statistics.median(values):6.1f}  p99 {percentile(values, 0.99):6.1f}"
        )
    if len(samples) == 2:
        a, b = (statistics.median(v) for v in samples.values())
        print(f"ratio sandbox / replaced (p50): {a / b:.2f}")
    rc.close()
    shared.close()
    print(f"\nrewards/s, {jobs} samples, sandbox slots = reward workers = concurrency")
    for concurrency in (1, 2, 4):
        shared = SharedSandbox(SandboxConfig(max_concurrent=concurrency))
        rc = RewardComputer(30.0, num_workers=concurrency, sandbox=shared)
        start = time.perf_counter()
        scores = await asyncio.gather(*(rc.score("code", SOLUTION, "", extra) for _ in range(jobs)))
        rate = jobs / (time.perf_counter() - start)
        assert all(s == 1.0 for s, _ in scores)
        print(f"concurrency {concurrency}: {rate:6.1f} rewards/s")
        rc.close()
        shared.close()
    limit = SandboxConfig().memory_mb
    shared = SharedSandbox(SandboxConfig(max_concurrent=4))
    rc = RewardComputer(30.0, num_workers=4, sandbox=shared)
    print(f"\nmemory hoarders at concurrency 4 (6 processes each), memory_mb={limit}:")
    print(f"whole-run limits by {shared.get().whole_run_limits}")
    results = await asyncio.gather(*(rc.score("code", HOARDER, "", extra) for _ in range(8)))
    peaks = [extras.get("sandbox_peak_mb", float("nan")) for _, extras in results]
    print(f"peak memory per run (MiB): {' '.join(f'{p:.0f}' for p in peaks)}")
    print(f"all under the limit: {all(p <= limit + 1 for p in peaks)}")
    rc.close()
    shared.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="latency samples per variant")
    parser.add_argument("--jobs", type=int, default=48, help="programs per throughput run")
    parser.add_argument("--part", choices=("startup", "reward", "all"), default="all")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, euid {os.geteuid()}")
    if args.part in ("reward", "all"):
        await reward_part(args.runs, args.jobs)
    if args.part == "reward":
        return
    sandboxes = setup_sandboxes(max_concurrent=1)
    variants: dict[str, Callable[[], Awaitable[None]]] = {
        "bare python -c": lambda: bare_python(),
        "bare python -I -S -c": lambda: bare_python("-I", "-S"),
    }
    variants.update({f"sandbox {name}": sandboxed(sb) for name, sb in sandboxes.items()})
    samples = await latencies(variants, args.runs)
    bare = statistics.median(samples["bare python -c"])
    bare_isolated = statistics.median(samples["bare python -I -S -c"])
    print(f"\nprint(1), {args.runs} runs each: p50 / p99 ms (overhead = p50 - bare p50)")
    for name, values in samples.items():
        p50, p99 = statistics.median(values), percentile(values, 0.99)
        line = f"{name:<22} p50 {p50:6.1f}  p99 {p99:6.1f}"
        if name.startswith("sandbox"):
            line += f"  overhead vs python -c {p50 - bare:+6.1f}"
            line += f"  vs python -I -S -c {p50 - bare_isolated:+6.1f}"
        print(line)
    for sb in sandboxes.values():
        sb.close()
    print(f"\nthroughput, {args.jobs} x print(1) through the pool: executions/s")
    for max_concurrent in (2, 4):
        for name, sb in setup_sandboxes(max_concurrent).items():
            rate = await throughput(sb, args.jobs)
            print(f"{name:<10} max_concurrent={max_concurrent}  {rate:6.1f}/s")
            sb.close()


if __name__ == "__main__":
    asyncio.run(main())
