"""The code reward: run a model's program against test cases in an isolated subprocess.

Test cases travel in the row, in one of two JSON formats (verl's prime_code layout for the first):

    {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}   stdin -> expected stdout, pairwise
    {"asserts": ["assert add(1, 2) == 3", ...]}             statements run after the program

They are read from `extra_info["test_cases"]` (a mapping or a JSON string) when present, else
from `ground_truth` parsed as JSON. The candidate is the last ```python fenced block of the
response (a bare ``` block when there is no python one).

Each case is one fresh `python -I` process (no user site, no PYTHON* variables, not on sys.path
of the cwd) in a temporary directory, with rlimits on CPU seconds, address space, file size and
processes, a wall-clock timeout, and its own process group killed whole at the end. Stdout goes
to a file, so RLIMIT_FSIZE also caps how much a chatty program can make us read. The candidate
gets SIGKILL if the process that started it dies (PR_SET_PDEATHSIG), so killing a hung reward
worker never leaves its candidate running.

Departures from a real sandbox (a fuller one comes separately): the candidate can read the
filesystem and open network sockets; RLIMIT_NPROC is per uid and not enforced for root.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

_FENCE = re.compile(r"```[ \t]*(\w*)[^\n]*\n(.*?)```", re.DOTALL)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one run of a candidate program."""

    wall_s: float = 5.0
    """Wall-clock seconds before the process group is killed (covers sleeping programs)."""
    cpu_s: int = 5
    """RLIMIT_CPU: CPU seconds before SIGXCPU (covers busy loops even if the wall timer slips)."""
    memory_mb: int = 1024
    """RLIMIT_AS: address space in MiB."""
    file_mb: int = 16
    """RLIMIT_FSIZE: largest file the program may write, stdout included, in MiB."""
    processes: int = 1
    """RLIMIT_NPROC for the uid: 1 stops fork and threads (not enforced for root)."""


@dataclass(frozen=True)
class RunResult:
    """What one run of a candidate did."""

    returncode: int  # negative: killed by that signal
    stdout: str  # what it printed (decoded leniently)
    timed_out: bool  # killed at the wall-clock limit


def extract_code(solution_str: str) -> str | None:
    """The last ```python fenced block of a response, else its last bare ``` block, else None."""
    blocks = _FENCE.findall(solution_str)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    bare = [code for lang, code in blocks if not lang]
    chosen = python or bare
    return chosen[-1] if chosen else None


def parse_test_cases(ground_truth: str, extra_info: dict[str, Any] | None) -> dict[str, list[str]]:
    """The row's test cases in one of the two documented formats; ValueError when malformed."""
    raw: Any = (extra_info or {}).get("test_cases")
    if raw is None:
        raw = ground_truth
    cases = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(cases, dict):
        raise ValueError("test cases must be a JSON object with inputs/outputs or asserts")
    if "asserts" in cases:
        asserts = cases["asserts"]
        if not (isinstance(asserts, list) and all(isinstance(a, str) for a in asserts)):
            raise ValueError("'asserts' must be a list of strings")
        return {"asserts": asserts}
    inputs, outputs = cases.get("inputs"), cases.get("outputs")
    if not (isinstance(inputs, list) and isinstance(outputs, list)):
        raise ValueError("test cases need 'inputs' and 'outputs' lists (or 'asserts')")
    if len(inputs) != len(outputs) or not all(isinstance(x, str) for x in inputs + outputs):
        raise ValueError("'inputs' and 'outputs' must be string lists of the same length")
    return {"inputs": inputs, "outputs": outputs}


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None) -> RunResult:
    """Run `code` under `python -I` with `stdin`, inside the limits; never raises for what the
    program does (crash, timeout, limit hit): that is all in the result."""
    limits = limits or SandboxLimits()
    with tempfile.TemporaryDirectory(prefix="asyncrl-code-") as cwd:
        program = os.path.join(cwd, "main.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(code)
        stdin_path, stdout_path = os.path.join(cwd, "stdin"), os.path.join(cwd, "stdout")
        with open(stdin_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        with open(stdin_path, "rb") as fin, open(stdout_path, "wb") as fout:
            proc = subprocess.Popen(
                [sys.executable, "-I", "main.py"],
                cwd=cwd,
                stdin=fin,
                stdout=fout,
                stderr=subprocess.DEVNULL,
                env=_sandbox_env(),
                start_new_session=True,
                preexec_fn=_limiter(limits),
            )
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)
                proc.wait()
        with open(stdout_path, "rb") as f:
            stdout = f.read(limits.file_mb << 20).decode("utf-8", errors="replace")
    return RunResult(returncode=proc.returncode, stdout=stdout, timed_out=timed_out)


def code_reward_fn(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    *,
    partial_credit: bool = True,
    case_timeout_s: float = 5.0,
    max_total_s: float = 8.0,
    memory_mb: int = 1024,
) -> dict[str, float]:
    """Fraction of test cases passed (`partial_credit`), or 1.0 only when all pass (stopping at
    the first failure). A response without a code block scores 0.

    Cases stop starting once `max_total_s` is spent (the rest count as failed): keep it under
    the reward computer's timeout, so a slow program scores 0 instead of being a reward-function
    timeout. Malformed test cases raise ValueError: that is a dataset bug, counted as one."""
    cases = parse_test_cases(ground_truth, extra_info)
    code = extract_code(solution_str)
    total = len(cases["asserts"] if "asserts" in cases else cases["inputs"])
    if code is None:
        return {"score": 0.0, "passed": 0.0, "total": float(total), "no_code": 1.0}
    limits = SandboxLimits(
        wall_s=case_timeout_s, cpu_s=max(1, math.ceil(case_timeout_s)), memory_mb=memory_mb
    )
    passed = timeouts = 0
    deadline = time.monotonic() + max_total_s
    for ok, timed_out in _run_cases(code, cases, limits, deadline):
        passed += ok
        timeouts += timed_out
        if not ok and not partial_credit:
            break
    if partial_credit:
        score = passed / total if total else 0.0
    else:
        score = 1.0 if total and passed == total else 0.0
    return {
        "score": score,
        "passed": float(passed),
        "total": float(total),
        "timeouts": float(timeouts),
    }


def _run_cases(
    code: str, cases: dict[str, list[str]], limits: SandboxLimits, deadline: float
) -> Iterator[tuple[bool, bool]]:
    """(passed, timed out) per case, until the cases or the time budget run out."""
    runs: list[tuple[str, str, str | None]]
    if "asserts" in cases:
        runs = [(f"{code}\n\n{statement}\n", "", None) for statement in cases["asserts"]]
    else:
        runs = [(code, i, o) for i, o in zip(cases["inputs"], cases["outputs"], strict=True)]
    for program, stdin, expected in runs:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        result = run_python(program, stdin, replace(limits, wall_s=min(limits.wall_s, left)))
        ok = result.returncode == 0 and not result.timed_out
        if expected is not None:
            ok = ok and _same_output(result.stdout, expected)
        yield ok, result.timed_out


def _same_output(got: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines (judges' rule)."""

    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return lines(got) == lines(expected)


def _sandbox_env() -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }


def _limiter(limits: SandboxLimits) -> Callable[[], None]:
    """The preexec_fn: runs in the child between fork and exec, so it only makes system calls
    (libc is resolved here, before the fork)."""
    libc = _libc()
    mib = 1 << 20

    def apply() -> None:
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mib, limits.memory_mb * mib))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mib, limits.file_mb * mib))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere a no-op).

    For processes that run untrusted or possibly hung code: if whoever supervises them is
    killed, they must not live on."""
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
