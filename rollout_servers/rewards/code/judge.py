"""The judge: trusted code in a reward worker that turns the harness's claims into a verdict.

- stdin/stdout cases: each case's claimed output is compared with the expected one line by line
  (trailing whitespace ignored, as judges do), with exit status 0. A claim marked `truncated`
  (the program printed more than `max_output_bytes`) fails its case and the verdict carries
  `truncated: 1.0`.
- program cases: the judge's program of each unit (`plan`) runs with the claimed values in
  place of the candidate's expressions. That evaluates values the candidate chose (`"ab" *
  f(2)` with f returning 10**10), so it runs in a forked child under RLIMIT_AS
  (`judge_memory_mb` above the worker's own size) and RLIMIT_CPU (`judge_cpu_s`). Past either
  bound the cases still undecided fail and the verdict carries `judge_limit: 1.0`; a claim
  marked truncated (a value over `max_value_bytes`) fails its case with `truncated: 1.0`.

The child reports one byte per case as it decides it, so a child killed at its bound still
leaves the verdicts of the cases before.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import resource
import select
import signal
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

from rollout_servers.rewards.code.plan import CodeChecks
from rollout_servers.rewards.code.scope import JUDGE_BUILTINS, JUDGE_MODULES
from rollout_servers.rewards.code.values import unplain

_PASS, _FAIL, _TRUNCATED, _LIMIT = b"1", b"0", b"T", b"M"
_MAX_FD = max(os.sysconf("SC_OPEN_MAX"), 1 << 16)
"""Every descriptor below this is closed in the judge child (`os.closerange`: one syscall)."""
_SYS_NAMES = ("getsizeof", "maxsize", "float_info", "int_info", "byteorder", "version_info")
"""What the judge's `sys` holds (MBPP 596 compares with `sys.getsizeof`)."""


class _Fail(Exception):
    """A case failed (its claims were missing, wrong or errors)."""


def judge(
    checks: dict[str, Any],
    stdout: str,
    partial_credit: bool = False,
    seed: int = 0,
    judge_memory_mb: int = 512,
    judge_cpu_s: float = 5.0,
    max_value_bytes: int = 4 << 20,
) -> dict[str, float]:
    """The verdict from the harness's claims (`stdout`) and the trusted checks: 1.0 only when
    every case passes (verl's rule), or the fraction passed with `partial_credit`."""
    plan = CodeChecks(**checks)
    if plan.mode == "io":
        outcomes = _judge_io(plan, stdout)
    else:
        outcomes = _bounded(plan, stdout, seed, judge_memory_mb, judge_cpu_s, max_value_bytes)
    passed, total = outcomes.count(_PASS), plan.total
    score = passed / total if partial_credit and total else float(bool(total) and passed == total)
    verdict = {"score": score, "passed": float(passed), "total": float(total)}
    if _TRUNCATED in outcomes:
        verdict["truncated"] = 1.0
    if _LIMIT in outcomes:
        verdict["judge_limit"] = 1.0
    return verdict


# ---- stdin/stdout ------------------------------------------------------------------------------
def _judge_io(plan: CodeChecks, stdout: str) -> list[bytes]:
    first: dict[int, dict[str, Any]] = {}
    for line in stdout.split("\n"):  # claims end in "\n" only: a value may hold \x85, \u2028
        with contextlib.suppress(ValueError, RecursionError):
            item = json.loads(line)
            if isinstance(item, dict) and isinstance(item.get("case"), int):
                first.setdefault(item["case"], item)
    outcomes = []
    for case, expected in enumerate(plan.outputs):
        item = first.get(case) or {}
        got = item.get("stdout")
        if item.get("truncated") is True:
            outcomes.append(_TRUNCATED)
        elif item.get("exit") == 0 and isinstance(got, str) and same_output(got, expected):
            outcomes.append(_PASS)
        else:
            outcomes.append(_FAIL)
    return outcomes


def _lines(text: str) -> Iterator[str]:
    """The lines of `text` without trailing whitespace and trailing blank lines, one at a time
    (a 1 MiB output is never split into a list)."""
    end = len(text)
    while end and text[end - 1].isspace():
        end -= 1
    start = 0
    while start < end:
        stop = text.find("\n", start, end)
        stop = end if stop < 0 else stop
        yield text[start:stop].rstrip()
        start = stop + 1


def same_output(got: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines (judges' rule)."""
    return all(a == b for a, b in itertools.zip_longest(_lines(got), _lines(expected)))


# ---- programs: in a bounded child --------------------------------------------------------------
def _bounded(
    plan: CodeChecks, stdout: str, seed: int, memory_mb: int, cpu_s: float, max_value: int
) -> list[bytes]:
    """Run `_judge_program` in a forked child under memory and CPU limits; one outcome per
    case (`_LIMIT` for each case the child did not decide)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: limits first, then the work; never returns
        try:
            _isolate(read_fd, write_fd)
            write_fd = 3
            extra = memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (_address_space() + extra,) * 2)
            cpu = max(1, int(cpu_s + 0.999))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            for outcome in _judge_program(plan, stdout, seed, max_value):
                os.write(write_fd, outcome)
        finally:
            os._exit(0)
    with contextlib.suppress(OSError):  # the child does the same: no moment without its group
        os.setpgid(pid, pid)
    os.close(write_fd)
    got = bytearray()
    deadline = time.monotonic() + 2 * cpu_s + 2.0  # CPU-bound work ends by RLIMIT_CPU first
    try:  # until every case is decided: a process it forked may hold the pipe open
        while len(got) < plan.total and (left := deadline - time.monotonic()) > 0:
            if not select.select([read_fd], [], [], left)[0]:
                break
            chunk = os.read(read_fd, 4096)
            if not chunk:
                break
            got += chunk
    finally:
        os.close(read_fd)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # the child and whatever it forked
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    outcomes = [bytes([b]) for b in got[: plan.total]]
    return outcomes + [_LIMIT] * (plan.total - len(outcomes))


def _isolate(read_fd: int, write_fd: int) -> None:
    """In the judge child, before any dataset code runs: its own process group (the parent
    kills the group, so a process it forks dies with it), no file descriptor of the worker's
    but the outcome pipe, moved to fd 3 (the worker's socket to the RewardComputer would let it
    forge other items' results), stdio on /dev/null, and no new processes where RLIMIT_NPROC
    binds (not for root, which the kernel exempts; there the group kill holds)."""
    os.setpgid(0, 0)
    os.close(read_fd)
    os.dup2(write_fd, 3)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(4, _MAX_FD)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    sys.set_int_max_str_digits(0)  # a claimed int of any length reads (the CPU bound holds)


def _address_space() -> int:
    """This process's virtual size in bytes (RLIMIT_AS counts from there)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _judge_program(plan: CodeChecks, stdout: str, seed: int, max_value: int) -> Iterator[bytes]:
    """Each case's outcome, in order, from running the judge's units with the claimed values."""
    records: dict[int, list[Any]] = {}
    for line in stdout.split("\n"):  # not splitlines(): "\x85" and "\u2028" are in values
        if len(line) > max_value + 64:
            continue  # the harness never writes one this long: forged
        with contextlib.suppress(ValueError, RecursionError):
            item = json.loads(line)
            if isinstance(item, dict) and isinstance(item.get("u"), int):
                records.setdefault(item["u"], []).append(item)
    state: dict[str, Any] = {"unit": -1, "left": [], "truncated": False}

    def take(unit: int) -> list[Any]:
        left = state["left"]
        if unit != state["unit"] or not left:
            raise _Fail()
        item = left.pop(0)
        if "v" not in item or not isinstance(item["v"], list):
            state["truncated"] = state["truncated"] or item.get("e") == "truncated"
            raise _Fail()
        return [unplain(v) for v in item["v"]]

    def check(unit: int, test: Any, takes: bool) -> None:
        if not test(take(unit) if takes else []):
            raise _Fail()

    namespace = {
        "__builtins__": _judge_builtins(), "__take": take, "__check": check, "__name__": "judge"
    }  # fmt: skip
    random.seed(seed)
    cases = set(plan.cases)
    broken: bytes | None = None  # why every later case fails, once a step's claim failed
    for unit, source in enumerate(plan.judge_units):
        state.update(unit=unit, left=list(records.get(unit, [])), truncated=False)
        outcome = _PASS
        try:
            exec(compile(source, f"<test {unit}>", "exec"), namespace)  # noqa: S102 (trusted)
        except MemoryError:
            outcome = _LIMIT
        except Exception:
            outcome = _FAIL
        if state["truncated"] and outcome != _LIMIT:
            outcome = _TRUNCATED
        elif outcome == _PASS and state["left"]:
            outcome = _FAIL  # claims the judge did not take: more executions than it ran
        if unit in cases:
            yield broken or outcome
        elif outcome != _PASS and "__take" in source and broken is None:
            # `r = solve(big)` raised: `r` still holds the value before, and a later
            # `assert r % 2 == 0` would pass on it
            broken = outcome


def _judge_builtins() -> dict[str, Any]:
    """The judge's builtins: `JUDGE_BUILTINS`, a no-op `print`, imports of `JUDGE_MODULES`."""
    import builtins

    def guarded_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] not in JUDGE_MODULES:
            raise ImportError(f"{name} is not importable in the judge")
        if name == "sys":  # its numbers only: sys.modules would reach everything else
            return types.SimpleNamespace(**{k: getattr(sys, k) for k in _SYS_NAMES})
        return __import__(name, *args, **kwargs)

    table = {name: getattr(builtins, name) for name in JUDGE_BUILTINS if hasattr(builtins, name)}
    table.update(print=lambda *a, **k: None, __import__=guarded_import)
    return table
