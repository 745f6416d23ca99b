"""Score a code dataset's own solutions, and mutants of them, with the code reward, in the
dataset's native test format: the figures issue 30 asks of the code reward.

    python tools/score_code_dataset.py humaneval /path/HumanEval.jsonl.gz [--mutants 3]
    python tools/score_code_dataset.py mbpp /path/sanitized-mbpp.json
    python tools/score_code_dataset.py limits    # 1 MiB outputs, the judge bound (no data)

The data is not part of the repository (openai/human-eval's data/HumanEval.jsonl.gz,
google-research's mbpp/sanitized-mbpp.json). For each row it reports:

- the canonical solution's score (should be 1.0), and why a row is an error (a dataset row the
  code reward cannot read, with the reason);
- a `return None` mutant's score (should be 0);
- HumanEval only: up to `--mutants` operator-flipped mutants of the entry-point function (`<`
  to `>=`, `+` to `-`, ...), each scored by the code reward and by HumanEval's own `check` (the program run with its exit
  status, in the same sandbox); a mutant the own check rejects must score 0.

It runs the real sandbox (bubblewrap) and the real judge, `--concurrency` runs at a time.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Any

from rollout_servers.rewards.code.judge import judge
from rollout_servers.rewards.code.reward import CodeReward
from rollout_servers.sandbox import Sandbox, SandboxConfig

_FLIPS: dict[type, type] = {
    ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq, ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv,
}  # fmt: skip


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a .jsonl, .jsonl.gz or .json (a list) file."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def _operators(tree: ast.AST, entry: str) -> list[ast.AST]:
    """The operators inside function `entry` (not the prompt's helpers, which the reward
    takes from the dataset as trusted code)."""
    ops: list[ast.AST] = []
    funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == entry]
    for node in (n for f in funcs for n in ast.walk(f)):
        if isinstance(node, ast.Compare):
            ops += node.ops
        elif isinstance(node, (ast.BinOp, ast.AugAssign)):
            ops.append(node.op)
    return ops


def flipped(code: str, entry: str, site: int) -> str | None:
    """`code` with the `site`-th flippable operator of function `entry` flipped (None past
    the last)."""
    tree = ast.parse(code)
    sites = [op for op in _operators(tree, entry) if isinstance(op, tuple(_FLIPS))]
    if site >= len(sites):
        return None
    target = sites[site]
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            node.ops = [_FLIPS[type(o)]() if o is target else o for o in node.ops]
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and node.op is target:
            node.op = _FLIPS[type(target)]()
    return ast.unparse(tree)


def return_none(code: str, entry: str) -> str:
    """`code` with the body of function `entry` replaced by `return None`."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == entry:
            node.body = [ast.Return(ast.Constant(None))]
    return ast.unparse(tree)


class Scorer:
    def __init__(self, concurrency: int) -> None:
        self.reward = CodeReward()
        self.sandbox = Sandbox(SandboxConfig(max_concurrent=concurrency, wall_timeout_s=20))

    async def score(self, response: str, ground_truth: str) -> tuple[float, str]:
        """(score, "" or the reason it is a dataset error)."""
        try:
            job = self.reward.prepare(response, ground_truth, None, max_total_s=15.0)
        except ValueError as e:
            return 0.0, f"dataset error: {e}"
        assert not isinstance(job, dict)
        run = await self.sandbox.run(job.code, job.stdin, job.wall_timeout_s,
                                     job.stdout_limit_bytes)  # fmt: skip
        verdict = await asyncio.to_thread(judge, stdout=run.stdout, **job.judge_kwargs)
        return verdict["score"], ""

    async def own_check(self, program: str) -> bool:
        """HumanEval's own verdict: the program with its `check` call exits 0."""
        run = await self.sandbox.run(program, "", 20.0)
        return run.status == "ok"


async def humaneval(rows: list[dict[str, Any]], scorer: Scorer, mutants: int) -> dict[str, Any]:
    async def one(row: dict[str, Any]) -> dict[str, Any]:
        truth = json.dumps({k: row[k] for k in ("test", "entry_point", "prompt")})
        solution = row["prompt"] + row["canonical_solution"]
        out: dict[str, Any] = {"id": row["task_id"]}
        out["canonical"], out["error"] = await scorer.score(fenced(solution), truth)
        none = return_none(solution, row["entry_point"])
        out["none"], _ = await scorer.score(fenced(none), truth)
        out["flips"] = []
        for site in range(mutants):
            mutant = flipped(solution, row["entry_point"], site)
            if mutant is None:
                break
            own = await scorer.own_check(f"{mutant}\n{row['test']}\ncheck({row['entry_point']})")
            ours, _ = await scorer.score(fenced(mutant), truth)
            out["flips"].append((own, ours, site))
        return out

    results = await asyncio.gather(*(one(r) for r in rows))
    flips = [f[:2] for r in results for f in r["flips"]]
    leaks = [(r["id"], f[2]) for r in results for f in r["flips"] if not f[0] and f[1] > 0]
    return {
        "rows": len(rows),
        "canonical_1.0": sum(r["canonical"] == 1.0 for r in results),
        "return_none_scored": sum(r["none"] > 0 for r in results),
        "flip_mutants": len(flips),
        "flips_rejected_by_own_check": sum(not own for own, _ in flips),
        "flips_rejected_by_own_check_but_scored": leaks,
        "flips_passed_by_own_check_but_scored_0": sum(ours == 0 for own, ours in flips if own),
        "failing_rows": [
            (r["id"], r["error"] or "scored 0") for r in results if r["canonical"] < 1
        ],
    }


async def mbpp(rows: list[dict[str, Any]], scorer: Scorer) -> dict[str, Any]:
    async def one(row: dict[str, Any]) -> dict[str, Any]:
        keys = ("test_list", "test_imports", "test_setup_code")
        truth = json.dumps({k: row[k] for k in keys if k in row})
        out: dict[str, Any] = {"id": row["task_id"]}
        out["canonical"], out["error"] = await scorer.score(fenced(row["code"]), truth)
        called = {n.func.id for t in row["test_list"] for n in ast.walk(ast.parse(t))
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}  # fmt: skip
        defined = {
            n.name for n in ast.walk(ast.parse(row["code"])) if isinstance(n, ast.FunctionDef)
        }
        none = row["code"]
        for entry in called & defined:
            none = return_none(none, entry)
        out["none"], _ = await scorer.score(fenced(none), truth)
        return out

    results = await asyncio.gather(*(one(r) for r in rows))
    good = sum(r["canonical"] == 1.0 for r in results)
    return {
        "rows": len(rows),
        "canonical_1.0": good,
        "canonical_1.0_pct": round(100 * good / max(1, len(rows)), 2),
        "return_none_scored": sum(r["none"] > 0 for r in results),
        "return_none_scored_ids": [r["id"] for r in results if r["none"] > 0],
        "failing_rows": [
            (r["id"], r["error"] or "scored 0") for r in results if r["canonical"] < 1
        ],
    }


async def limits(concurrency: int) -> dict[str, Any]:
    """The acceptance's limit figures through a real `RewardComputer`: 1 MiB of expected
    output (right, off by one, over the limit) and the judge bound (the worker's peak RSS)."""
    from rollout_servers.rewards.computer import RewardComputer
    from rollout_servers.sandbox import SharedSandbox

    shared = SharedSandbox(SandboxConfig(max_concurrent=concurrency))
    rc = RewardComputer(30.0, num_workers=1, sandbox=shared)
    small = RewardComputer(30.0, num_workers=1, sandbox=shared,
                           reward_kwargs={"max_output_bytes": 1 << 19})  # fmt: skip
    try:
        lines = 180_000
        tests = json.dumps({"inputs": [f"{lines}\n"],
                            "outputs": ["".join(f"{i}\n" for i in range(lines))]})  # fmt: skip
        right = (
            "import sys\nn = int(input())\nsys.stdout.write(''.join(f'{i}\\n' for i in range(n)))"
        )
        report: dict[str, Any] = {"expected_output_bytes": len(json.loads(tests)["outputs"][0])}
        report["right"] = await rc.score("code", fenced(right), tests, None)
        wrong = right.replace("range(n)", "range(1, n + 1)")
        report["off_by_one"] = await rc.score("code", fenced(wrong), tests, None)
        report["over_max_output_bytes"] = await small.score("code", fenced(right), tests, None)
        report["limits_counted"] = dict(small.limits)
        worker = rc._workers[0]._proc
        assert worker is not None
        before = _vm_hwm_kib(worker.pid)
        bomb = json.dumps({"asserts": ['assert "ab" * f(2) == "abab"']})
        start = time.monotonic()
        report["ab_times_1e10"] = await rc.score("code", fenced("def f(n):\n    return 10**10"),
                                                 bomb, None)  # fmt: skip
        report["ab_times_1e10_s"] = round(time.monotonic() - start, 3)
        report["worker_peak_rss_kib_before"] = before
        report["worker_peak_rss_kib_after"] = _vm_hwm_kib(worker.pid)
        report["limits_counted_main"] = dict(rc.limits)
        return report
    finally:
        rc.close()
        small.close()
        shared.close()


def _vm_hwm_kib(pid: int) -> int:
    """Peak resident memory of process `pid` in KiB (/proc's VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for pid {pid}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("format", choices=["humaneval", "mbpp", "limits"])
    parser.add_argument("path", type=Path, nargs="?", help="the dataset file (not for limits)")
    parser.add_argument("--mutants", type=int, default=3, help="flipped mutants per row")
    parser.add_argument("--limit", type=int, default=0, help="only the first N rows")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    start = time.monotonic()
    if args.format == "limits":
        report = asyncio.run(limits(args.concurrency))
        report["seconds"] = round(time.monotonic() - start, 1)
        json.dump(report, sys.stdout, indent=1)
        print()
        return
    rows = read_rows(args.path)[: args.limit or None]
    scorer = Scorer(args.concurrency)
    try:
        if args.format == "humaneval":
            report = asyncio.run(humaneval(rows, scorer, args.mutants))
        else:
            report = asyncio.run(mbpp(rows, scorer))
    finally:
        scorer.sandbox.close()
    report["seconds"] = round(time.monotonic() - start, 1)
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
