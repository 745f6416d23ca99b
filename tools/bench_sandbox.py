"""Startup latency and throughput of the code sandbox, beside a bare interpreter, in one run.

    python tools/bench_sandbox.py [--runs 100] [--jobs 48]

Prints p50/p99 latency of `print(1)` through `Sandbox.run` for every backend that works here,
beside bare `python -c 'print(1)'` (what a plain subprocess costs, `site` included) and bare
`python -I -S -c 'print(1)'` (the interpreter mode the sandbox uses), each spawned the same way
(asyncio subprocess, output through pipes). Overhead is the sandbox p50 minus the bare p50;
target: at most 15 ms over bare `python -c`. Samples are interleaved round-robin so that load
from other processes on the machine hits every variant alike. Then executions/s of `--jobs`
programs through the pool with max_concurrent = 2 and 4.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

from rollout_servers.sandbox import Backend, Sandbox, SandboxConfig

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


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="latency samples per variant")
    parser.add_argument("--jobs", type=int, default=48, help="programs per throughput run")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, euid {os.geteuid()}")
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
