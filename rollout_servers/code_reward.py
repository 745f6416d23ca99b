"""The code reward: a model's program run against test cases in the sandbox, judged by trusted
code it cannot reach.

Test cases travel in the row, in one of two JSON formats (verl's prime_code layout first):

    {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}   stdin -> expected stdout, pairwise
    {"asserts": ["assert add(1, 2) == 3", ...]}             one assert statement per case

read from `extra_info["test_cases"]` (a mapping or a JSON string) when present, else from
`ground_truth` parsed as JSON. The candidate is the last ```python fenced block of the response
(a bare ``` block when there is no python one).

Why the verdict cannot be forged. The expected outputs never enter the sandbox. One sandbox run
per sample executes `HARNESS` (ours) with the candidate, and all it reports are claims: for the
stdin/stdout format, what the program printed for each case's input (each case a fork with its
own stdin) and its exit status; for asserts, the plain value of each candidate-dependent part of
each assert (`f(1, 2)` in `assert f(1, 2) == 3`), serialized as tagged JSON. Trusted code then
decides, in a reward worker process (`judge`): outputs are compared with the expected ones, and
each assert is evaluated with the claimed plain values in place of the candidate's parts. A
program that exits early (`sys.exit(0)`, `os._exit(0)`, an `atexit` handler), prints a fake
success line, switches asserts off, or returns an object that compares equal to anything can
only make false claims about values; it scores only when the claimed values are right. The
candidate's exit status never decides alone.

Asserts must be one `assert` statement each; their candidate-dependent parts may not sit inside
a comprehension or lambda (the split cannot separate them): such a case is a dataset error.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

_FENCE = re.compile(r"```[ \t]*(\w*)[^\n]*\n(.*?)```", re.DOTALL)
MAX_CLAIM_CHARS = 1 << 16
"""A claim longer than this is refused (a case fails), however the harness produced it."""
SAFE_BUILTINS = {
    name: getattr(builtins, name)
    for name in (
        "abs", "all", "any", "bool", "chr", "dict", "divmod", "enumerate", "filter", "float",
        "frozenset", "int", "isinstance", "len", "list", "map", "max", "min", "ord", "pow",
        "range", "repr", "reversed", "round", "set", "sorted", "str", "sum", "tuple", "zip",
    )
}  # fmt: skip
"""Names an assert may use on the trusted side (with `math`); any other name is the
candidate's, so the part of the assert that uses it runs in the sandbox."""
_TRUSTED_NAMES = {*SAFE_BUILTINS, "math", "True", "False", "None"}


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


# ---- planning: what runs in the sandbox, what stays trusted ------------------------------------
@dataclass(frozen=True)
class CodeChecks:
    """The test cases of one row, split into what the sandbox runs and what only the judge sees."""

    mode: Literal["io", "asserts"]
    inputs: list[str] = field(default_factory=list)
    """io: each case's stdin (sent to the sandbox)."""
    outputs: list[str] = field(default_factory=list)
    """io: each case's expected stdout (never sent)."""
    leaves: list[list[str]] = field(default_factory=list)
    """asserts: per case, the source of each candidate-dependent part (sent)."""
    templates: list[str] = field(default_factory=list)
    """asserts: per case, the assert's test with `__r[k]` for part k (never sent)."""

    @property
    def total(self) -> int:
        return len(self.inputs) if self.mode == "io" else len(self.templates)


def plan_checks(cases: dict[str, list[str]]) -> CodeChecks:
    """Split parsed test cases (`parse_test_cases`) into sandbox work and trusted templates."""
    if "inputs" in cases:
        return CodeChecks("io", inputs=cases["inputs"], outputs=cases["outputs"])
    leaves, templates = [], []
    for i, text in enumerate(cases["asserts"]):
        try:
            tree = ast.parse(text.strip())
        except SyntaxError as e:
            raise ValueError(f"assert {i} is not valid Python: {e.msg}") from None
        if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
            raise ValueError(f"case {i} must be exactly one assert statement: {text!r}")
        split = _Split(i)
        template = split.visit(tree.body[0].test)
        leaves.append(split.leaves)
        templates.append(ast.unparse(template))
    return CodeChecks("asserts", leaves=leaves, templates=templates)


class _Split(ast.NodeTransformer):
    """Replace each maximal candidate-dependent part of an assert's test by `__r[k]`."""

    def __init__(self, case: int) -> None:
        self.case = case
        self.leaves: list[str] = []

    def visit(self, node: ast.AST) -> Any:
        if not _free_names(node) - _TRUSTED_NAMES:
            return node  # trusted as it is: literals and safe builtins only
        splittable: tuple[type[ast.AST], ...] = (ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare)
        splittable += (ast.IfExp, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Starred, ast.keyword)
        if isinstance(node, splittable):
            return self.generic_visit(node)
        if isinstance(node, ast.Call) and not _free_names(node.func) - _TRUSTED_NAMES:
            return self.generic_visit(node)  # a trusted function over candidate values
        scoped = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
        if any(isinstance(n, (*scoped, ast.NamedExpr)) for n in ast.walk(node)):
            raise ValueError(
                f"assert {self.case}: candidate code inside a comprehension or lambda cannot be "
                f"judged outside the sandbox: {ast.unparse(node)!r}"
            )
        self.leaves.append(ast.unparse(node))
        index = ast.Constant(len(self.leaves) - 1)
        return ast.Subscript(ast.Name("__r", ast.Load()), index, ast.Load())


def _free_names(node: ast.AST) -> set[str]:
    """Names `node` reads that it does not bind itself (comprehension targets, lambda args)."""
    loaded = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    bound = {
        n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    bound |= {a.arg for n in ast.walk(node) if isinstance(n, ast.Lambda) for a in n.args.args}
    return loaded - bound


# ---- the harness: what runs in the sandbox -----------------------------------------------------
def harness_stdin(code: str, checks: CodeChecks, case_timeout_s: float, max_output: int) -> str:
    """The harness's input: the candidate and what to run for each case, nothing expected."""
    job = {"code": code, "mode": checks.mode, "timeout": case_timeout_s, "max_output": max_output}
    job["cases"] = checks.inputs if checks.mode == "io" else checks.leaves
    return json.dumps(job)


HARNESS = r"""
import json, os, signal, sys, select, time
job = json.loads(sys.stdin.read())
claims = os.fdopen(os.dup(1), "w", buffering=1)
devnull = os.open(os.devnull, os.O_RDWR)
def claim(**fields):
    claims.write(json.dumps(fields) + "\n")
def plain(v, depth=0):
    if depth > 30:
        raise ValueError("nested too deep")
    if v is None:
        return None
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, str):
        return str(v)
    if isinstance(v, float):
        f = float(v)
        return f if f == f and f not in (float("inf"), float("-inf")) else {"f": repr(f)}
    if isinstance(v, complex):
        return {"c": [repr(v.real), repr(v.imag)]}
    if isinstance(v, (bytes, bytearray)):
        return {"b": bytes(v).hex()}
    if isinstance(v, list):
        return {"l": [plain(x, depth + 1) for x in v]}
    if isinstance(v, tuple):
        return {"t": [plain(x, depth + 1) for x in v]}
    if isinstance(v, (set, frozenset)):
        return {"s": [plain(x, depth + 1) for x in v]}
    if isinstance(v, dict):
        return {"d": [[plain(k, depth + 1), plain(x, depth + 1)] for k, x in v.items()]}
    if hasattr(v, "tolist"):
        return plain(v.tolist(), depth + 1)
    raise TypeError(type(v).__name__ + " is not a plain value")
def on_alarm(signum, frame):
    raise TimeoutError("case time limit")
if job["mode"] == "asserts":
    os.dup2(devnull, 0); os.dup2(devnull, 1); os.dup2(devnull, 2)
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(job["code"], "main.py", "exec"), namespace)
    except BaseException as exc:
        claim(error="module: " + type(exc).__name__)
        os._exit(0)
    signal.signal(signal.SIGALRM, on_alarm)
    for case, leaves in enumerate(job["cases"]):
        for leaf, source in enumerate(leaves):
            signal.setitimer(signal.ITIMER_REAL, job["timeout"])
            try:
                value = plain(eval(source, namespace))
                signal.setitimer(signal.ITIMER_REAL, 0)
                claim(case=case, leaf=leaf, value=value)
            except BaseException as exc:
                signal.setitimer(signal.ITIMER_REAL, 0)
                claim(case=case, leaf=leaf, error=type(exc).__name__)
    os._exit(0)
for case, stdin in enumerate(job["cases"]):
    rin, win = os.pipe()
    rout, wout = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        os.dup2(rin, 0); os.dup2(wout, 1); os.dup2(devnull, 2)
        os.closerange(3, 1 << 16)
        code = 0
        try:
            exec(compile(job["code"], "main.py", "exec"), {"__name__": "__main__"})
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            code = 1
        try:
            sys.stdout.flush()
        except BaseException:
            code = code or 1
        os._exit(code & 0xFF)
    os.close(rin); os.close(wout)
    try:
        os.write(win, stdin.encode())
    except OSError:
        pass
    os.close(win)
    out, deadline, status = b"", time.monotonic() + job["timeout"], None
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([rout], [], [], left)
        chunk = os.read(rout, 1 << 16) if ready else b"."
        if not chunk:
            break
        out += chunk[: max(0, job["max_output"] - len(out))] if ready else b""
    while status is None and time.monotonic() < deadline:
        done, st = os.waitpid(pid, os.WNOHANG)
        status = st if done else None
        if status is None:
            time.sleep(0.001)
    try:
        os.killpg(pid, signal.SIGKILL)  # whatever the case started
    except OSError:
        pass
    os.close(rout)
    if status is None:
        os.waitpid(pid, 0)
    exit_code = None if status is None else os.waitstatus_to_exitcode(status)
    claim(case=case, exit=exit_code, stdout=out.decode("utf-8", "replace"))
os._exit(0)
"""
"""The trusted program each sample's sandbox run executes (with the candidate as data)."""


# ---- the judge: trusted, in a reward worker ---------------------------------------------------
def read_claims(stdout: str, checks: CodeChecks) -> dict[tuple[int, int], Any]:
    """The harness's claims by (case, leaf) (io cases use leaf 0); the first claim of each wins,
    lines that are not well-formed claims are ignored."""
    found: dict[tuple[int, int], Any] = {}
    for line in stdout.splitlines():
        if len(line) > MAX_CLAIM_CHARS:
            continue
        try:
            item = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(item, dict) or not isinstance(item.get("case"), int):
            continue
        key = (item["case"], item.get("leaf", 0) if checks.mode == "asserts" else 0)
        if isinstance(key[1], int):
            found.setdefault(key, item)
    return found


def _unplain(v: Any) -> Any:
    """A tagged-JSON claim back to a plain Python value (ValueError when malformed)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict) and len(v) == 1:
        ((tag, x),) = v.items()
        if tag == "l":
            return [_unplain(e) for e in x]
        if tag == "t":
            return tuple(_unplain(e) for e in x)
        if tag == "s":
            return {_unplain(e) for e in x}
        if tag == "d":
            return {_unplain(k): _unplain(e) for k, e in x}
        if tag == "f":
            return float(x)
        if tag == "c":
            return complex(float(x[0]), float(x[1]))
        if tag == "b":
            return bytes.fromhex(x)
    raise ValueError(f"not a plain value: {v!r:.80}")


def _same_output(got: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines (judges' rule)."""

    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return lines(got) == lines(expected)


def _case_passes(checks: CodeChecks, case: int, claims: dict[tuple[int, int], Any]) -> bool:
    if checks.mode == "io":
        item = claims.get((case, 0))
        return (
            item is not None
            and item.get("exit") == 0
            and isinstance(item.get("stdout"), str)
            and _same_output(item["stdout"], checks.outputs[case])
        )
    values = []
    for leaf in range(len(checks.leaves[case])):
        item = claims.get((case, leaf))
        if item is None or "value" not in item:
            return False
        try:
            values.append(_unplain(item["value"]))
        except (ValueError, TypeError, RecursionError):
            return False
    scope = {"__builtins__": SAFE_BUILTINS, "math": math}
    try:
        return bool(eval(checks.templates[case], scope, {"__r": values}))  # noqa: S307 (trusted)
    except Exception:
        return False


def judge(checks: dict[str, Any], stdout: str, partial_credit: bool = False) -> dict[str, float]:
    """The verdict, from the harness's claims (`stdout`) and the trusted checks: 1.0 only when
    every case passes (verl's rule), or the fraction passed with `partial_credit`."""
    plan = CodeChecks(**checks)
    claims = read_claims(stdout, plan)
    passed = sum(_case_passes(plan, case, claims) for case in range(plan.total))
    total = plan.total
    score = passed / total if partial_credit else float(bool(total) and passed == total)
    return {"score": score if total else 0.0, "passed": float(passed), "total": float(total)}


# ---- the reward -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SandboxJob:
    """What a sandboxed reward asks of the sandbox, and how its verdict is then computed."""

    code: str  # the trusted program to run (the harness)
    stdin: str  # its input (the candidate and the per-case work)
    wall_timeout_s: float  # the run's wall-clock limit
    judge_kwargs: dict[str, Any]  # the judge's arguments, less the run's stdout


class CodeReward:
    """The code reward, for the code data sources: `prepare` (in the server) turns a response
    into a `SandboxJob` or an immediate score, the server runs the job in its one `Sandbox`,
    and `judge` (in a reward worker) gives the verdict. Options from `reward.kwargs`:
    `partial_credit` (default false: all-or-nothing, as verl), `case_timeout_s` (per case),
    `max_total_s` (the whole run; keep it under `reward.timeout_s`)."""

    needs_sandbox = True
    judge_ref = ("module", "rollout_servers.code_reward", "judge")

    def prepare(
        self,
        solution_str: str,
        ground_truth: str,
        extra_info: dict[str, Any] | None,
        *,
        partial_credit: bool = False,
        case_timeout_s: float = 2.0,
        max_total_s: float = 8.0,
        max_output_bytes: int = 8192,
    ) -> SandboxJob | dict[str, float]:
        """A job for the sandbox, or the score itself when there is nothing to run. Malformed
        test cases raise ValueError (a dataset bug, counted as a reward exception)."""
        checks = plan_checks(parse_test_cases(ground_truth, extra_info))
        code = extract_code(solution_str)
        if code is None:
            return {"score": 0.0, "passed": 0.0, "total": float(checks.total), "no_code": 1.0}
        stdin = harness_stdin(code, checks, case_timeout_s, max_output_bytes)
        kwargs = {"checks": asdict(checks), "partial_credit": bool(partial_credit)}
        return SandboxJob(HARNESS, stdin, max_total_s, kwargs)


code_reward = CodeReward()
"""The registered instance (`rollout_servers.rewards.REWARD_FNS` for the code sources)."""
