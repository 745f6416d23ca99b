"""The code reward: a model's program run against a row's tests in the sandbox, judged by trusted
code it cannot reach.

Components, in the order a sample meets them:
- `formats`: the row's tests, in the format its dataset ships (HumanEval, MBPP, asserts,
  stdin/stdout as APPS/TACO/CodeContests, LiveCodeBench functional), read into stdin/stdout
  cases or trusted test statements;
- `plan`: the statements split into what the sandbox runs (the candidate's expressions)
  and what only the judge sees (the expected values, the comparisons);
- `harness`: the trusted program that runs in the sandbox and reports *claims*;
- `judge`: the verdict, in a reward worker, from the claims (bounded in memory and CPU).

Why the verdict cannot be forged: the expected outputs and the asserts' comparisons never enter
the sandbox, and what comes out is only claimed values (what a case printed, what `f(1, 2)`
returned, as plain data). A program that exits early, prints a fake success line, switches
asserts off, or returns an object that compares equal to anything can only make false claims
about values; it scores only when the claimed values are right. Its exit status never decides.

Limits that speak: a case whose output or value is over its limit (`max_output_bytes`,
`max_value_bytes`), or a run whose claims are over `max_run_output_bytes`, fails with
`truncated: 1.0` in the metrics; a judge past its bounds (`judge_memory_mb`, `judge_cpu_s`)
fails with `judge_limit: 1.0`. The reward computer counts and logs both with their reason.
"""

from __future__ import annotations

import re
import threading
from dataclasses import asdict, dataclass
from typing import Any

from rollout_servers.rewards.code.formats import parse_test_cases
from rollout_servers.rewards.code.harness import HARNESS, harness_stdin
from rollout_servers.rewards.code.judge import judge
from rollout_servers.rewards.code.plan import CodeChecks, plan_checks

_FENCE = re.compile(r"```[ \t]*(\w*)[^\n]*\n(.*?)```", re.DOTALL)
_MIB = 1 << 20
__all__ = ["CodeChecks", "CodeReward", "code_reward", "extract_code", "judge", "plan_checks"]


def extract_code(solution_str: str) -> str | None:
    """The last ```python fenced block of a response, else its last bare ``` block, else None."""
    blocks = _FENCE.findall(solution_str)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    bare = [code for lang, code in blocks if not lang]
    chosen = python or bare
    return chosen[-1] if chosen else None


@dataclass(frozen=True)
class SandboxJob:
    """What a sandboxed reward asks of the sandbox, and how its verdict is then computed."""

    code: str  # the trusted program to run (the harness)
    stdin: str  # its input (the candidate and the per-case work)
    wall_timeout_s: float  # the run's wall-clock limit
    stdout_limit_bytes: int  # stdout the run may write (the claims); past it: truncated
    judge_kwargs: dict[str, Any]  # the judge's arguments, less the run's stdout


class CodeReward:
    """The code reward, for the code data sources.

    In a rollout server: `prepare` turns a response into a `SandboxJob` (or an immediate
    score), the server runs the job in its one sandbox, and `judge` (in a reward worker) gives
    the verdict. Called directly, as verl calls every reward
    (`compute_score(data_source, solution_str, ground_truth, extra_info)`), it does all three
    itself in a sandbox of its own (`rollout.sandbox`'s defaults), built on first use.

    Options (`reward.kwargs`): `partial_credit` (default false: all-or-nothing, as verl),
    `case_timeout_s` (2 s per case or test statement), `max_total_s` (8 s for the run; keep it
    under `reward.timeout_s`), `max_output_bytes` (4 MiB of stdout per stdin/stdout case),
    `max_value_bytes` (4 MiB of JSON per claimed value set), `max_run_output_bytes` (32 MiB
    of claims per run), `judge_memory_mb` (512) and `judge_cpu_s` (5) for the judge."""

    needs_sandbox = True
    judge_ref = ("module", "rollout_servers.rewards.code.judge", "judge")

    def __init__(self) -> None:
        self._own_sandbox: Any = None
        self._lock = threading.Lock()
        self._run_lock = threading.Lock()

    def prepare(
        self,
        solution_str: str,
        ground_truth: str,
        extra_info: dict[str, Any] | None,
        *,
        partial_credit: bool = False,
        case_timeout_s: float = 2.0,
        max_total_s: float = 8.0,
        max_output_bytes: int = 4 * _MIB,
        max_value_bytes: int = 4 * _MIB,
        max_run_output_bytes: int = 32 * _MIB,
        judge_memory_mb: int = 512,
        judge_cpu_s: float = 5.0,
    ) -> SandboxJob | dict[str, float]:
        """A job for the sandbox, or the score itself when there is nothing to run. Malformed
        tests raise ValueError (a dataset bug, counted as a reward exception)."""
        checks = plan_checks(parse_test_cases(ground_truth, extra_info))
        code = extract_code(solution_str)
        if code is None:
            return {"score": 0.0, "passed": 0.0, "total": float(checks.total), "no_code": 1.0}
        seed = 0
        stdin = harness_stdin(
            code, checks, case_timeout_s=case_timeout_s, max_output=max_output_bytes,
            max_value=max_value_bytes, seed=seed,
        )  # fmt: skip
        kwargs = {
            "checks": asdict(checks), "partial_credit": bool(partial_credit), "seed": seed,
            "judge_memory_mb": judge_memory_mb, "judge_cpu_s": judge_cpu_s,
            "max_value_bytes": max_value_bytes,
        }  # fmt: skip
        return SandboxJob(HARNESS, stdin, max_total_s, max_run_output_bytes, kwargs)

    def __call__(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: str,
        extra_info: dict[str, Any] | None = None,
        **options: Any,
    ) -> dict[str, float]:
        """verl's `compute_score`: the verdict of one response, run in this object's own
        sandbox, one call at a time per process (not from inside a running event loop: use
        `RewardComputer` there)."""
        job = self.prepare(solution_str, ground_truth, extra_info, **options)
        if isinstance(job, dict):
            return job
        sandbox = self.sandbox()
        with self._run_lock:  # one sandbox, one event loop at a time
            run = sandbox.run_sync(
                job.code, job.stdin, job.wall_timeout_s, stdout_limit_bytes=job.stdout_limit_bytes
            )
        verdict = judge(stdout=run.stdout, **job.judge_kwargs)
        if run.stdout_dropped:
            verdict["truncated"] = 1.0
        return {**verdict, f"sandbox_{run.status}": 1.0}

    def sandbox(self) -> Any:
        """The sandbox of direct calls, built on first use and closed at interpreter exit."""
        with self._lock:
            if self._own_sandbox is None:
                import atexit

                from rollout_servers.sandbox import Sandbox, SandboxConfig

                self._own_sandbox = Sandbox(SandboxConfig())
                atexit.register(self._own_sandbox.close)
            return self._own_sandbox


code_reward = CodeReward()
"""The registered instance (`rollout_servers.rewards.functions.REWARD_FNS` for the code sources)."""
