"""The test-case formats code datasets ship, read into one of two shapes the code reward runs.

A row's tests come from `extra_info["test_cases"]` (a mapping, a list, or a JSON string) when
present, else from `ground_truth` parsed as JSON. Each format, recognised by its keys
(docs/sandbox.md has an example row of each):

- stdin/stdout (APPS, TACO, verl's prime_code): `{"inputs": [...], "outputs": [...]}`;
- CodeContests: `{"public_tests": {"input": [...], "output": [...]}, "private_tests": ...,
  "generated_tests": ...}` (all present parts, in that order);
- asserts: `{"asserts": ["assert add(1, 2) == 3", ...]}` (any statements in fact, see below);
- HumanEval: `{"test": "def check(candidate): ...", "entry_point": "name", "prompt": ...}`: the
  body of `check` with `candidate` read as the entry point, each top-level statement holding an
  assert one case; the test's own imports and the prompt's helper functions (`poly` of
  HumanEval/32, `encode_cyclic` of /38) are trusted setup, so a candidate cannot redefine them;
- MBPP: `{"test_list": [...], "test_setup_code": "...", "test_imports": [...]}`;
- functional cases (LiveCodeBench, APPS call-based): `{"fn_name": "f", "inputs": [[args...]],
  "outputs": [value]}` or LiveCodeBench's `[{"input": "1\\n[2]", "output": "3",
  "testtype": "functional" | "stdin"}]` with `"func_name"` (inputs one JSON value per line); a
  LeetCode-style `class Solution` is called through an instance.

Two shapes come out: `IoTests` (stdin in, stdout compared) and `ProgramTests` (trusted Python
statements in which the candidate's names are called; `plan` splits them).
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class IoTests:
    """stdin -> expected stdout cases, pairwise."""

    inputs: list[str]
    outputs: list[str]


@dataclass(frozen=True)
class ProgramTests:
    """Trusted test statements: `setup` runs first (imports, helpers; no case), then each of
    `units` in order; a unit that holds an assert is a case."""

    units: list[str]
    setup: list[str] = field(default_factory=list)
    candidate: str | None = None
    """The row's entry point: always the candidate's, even when a builtin has its name."""


def parse_test_cases(
    ground_truth: str, extra_info: dict[str, Any] | None
) -> IoTests | ProgramTests:
    """The row's tests in one of the documented formats; ValueError naming what is wrong."""
    raw: Any = (extra_info or {}).get("test_cases")
    if raw is None:
        raw = ground_truth
    try:
        cases = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError as e:
        raise ValueError(f"test cases are not JSON: {e}") from None
    if isinstance(cases, list):
        return _livecodebench(cases, None)
    if not isinstance(cases, dict):
        raise ValueError("test cases must be a JSON object (or a LiveCodeBench list of cases)")
    if "asserts" in cases:
        return ProgramTests(units=_strings(cases["asserts"], "asserts"))
    if "test" in cases and "entry_point" in cases:
        return _humaneval(cases)
    if "test_list" in cases:
        setup = [_text(cases.get("test_setup_code", ""), "test_setup_code")]
        setup += _strings(cases.get("test_imports", []), "test_imports")
        return ProgramTests(units=_strings(cases["test_list"], "test_list"), setup=setup)
    if "public_tests" in cases or "private_tests" in cases:
        return _codecontests(cases)
    if "cases" in cases or "public_test_cases" in cases:
        name = cases.get("func_name")
        listed = [*_cases_list(cases.get("cases")), *_cases_list(cases.get("public_test_cases"))]
        listed += _cases_list(cases.get("private_test_cases"))
        return _livecodebench(listed, name)
    inputs, outputs = cases.get("inputs"), cases.get("outputs")
    if not (isinstance(inputs, list) and isinstance(outputs, list)):
        raise ValueError("test cases need 'inputs' and 'outputs' lists, or another known format")
    if len(inputs) != len(outputs):
        raise ValueError("'inputs' and 'outputs' must have the same length")
    if cases.get("fn_name"):
        return _functional(str(cases["fn_name"]), inputs, outputs)
    if not all(isinstance(x, str) for x in inputs + outputs):
        raise ValueError("'inputs' and 'outputs' must be string lists (or give 'fn_name')")
    return IoTests(inputs, outputs)


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what!r} must be a string")
    return value


def _strings(value: Any, what: str) -> list[str]:
    if not (isinstance(value, list) and all(isinstance(a, str) for a in value)):
        raise ValueError(f"{what!r} must be a list of strings")
    return value


def _humaneval(cases: dict[str, Any]) -> ProgramTests:
    """`check(candidate)`'s body as units; the test's other top-level code and the prompt's
    helpers as setup (the prompt's entry-point stub itself is the candidate's to write)."""
    entry = _text(cases["entry_point"], "entry_point")
    try:
        tree = ast.parse(_text(cases["test"], "test"))
        prompt = ast.parse(_text(cases.get("prompt", ""), "prompt"))
    except SyntaxError as e:
        raise ValueError(f"HumanEval test or prompt is not valid Python: {e.msg}") from None
    setup = [
        ast.unparse(node)
        for node in prompt.body
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef))
        and getattr(node, "name", None) != entry
    ]
    checks = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1 or len(checks[0].args.args) != 1:
        raise ValueError("a HumanEval test needs one `def check(candidate):`")
    arg = checks[0].args.args[0].arg
    for node in tree.body:
        calls_check = isinstance(node, ast.Expr) and "check" in _names(node)
        if node is not checks[0] and not calls_check:
            setup.append(ast.unparse(node))
    rename = _Rename(arg, entry)
    units = [ast.unparse(rename.visit(stmt)) for stmt in checks[0].body]
    return ProgramTests(units=units, setup=setup, candidate=entry)


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(self.new, node.ctx) if node.id == self.old else node


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _codecontests(cases: dict[str, Any]) -> IoTests:
    inputs: list[str] = []
    outputs: list[str] = []
    for part in ("public_tests", "private_tests", "generated_tests"):
        tests = cases.get(part) or {}
        if not isinstance(tests, dict):
            raise ValueError(f"{part!r} must be an object with 'input' and 'output' lists")
        ins, outs = _strings(tests.get("input", []), part), _strings(tests.get("output", []), part)
        if len(ins) != len(outs):
            raise ValueError(f"{part!r}: 'input' and 'output' differ in length")
        inputs += ins
        outputs += outs
    return IoTests(inputs, outputs)


def _cases_list(value: Any) -> list[Any]:
    if value is None:
        return []
    value = json.loads(value) if isinstance(value, str) else value
    if not isinstance(value, list):
        raise ValueError("LiveCodeBench test cases must be a list (decompress private cases first)")
    return value


def _livecodebench(cases: list[Any], func_name: str | None) -> IoTests | ProgramTests:
    """LiveCodeBench cases: all stdin ones, or all functional ones (with `func_name`)."""
    if not cases or not all(isinstance(c, dict) for c in cases):
        raise ValueError("LiveCodeBench test cases must be a non-empty list of objects")
    kinds = {c.get("testtype", "stdin") for c in cases}
    if kinds == {"stdin"}:
        io = [(_text(c.get("input"), "input"), _text(c.get("output"), "output")) for c in cases]
        return IoTests([i for i, _ in io], [o for _, o in io])
    if kinds != {"functional"} or not func_name:
        raise ValueError("functional LiveCodeBench cases need 'func_name' (and no stdin ones)")
    inputs, outputs = [], []
    for c in cases:
        try:
            lines = [ln for ln in _text(c.get("input"), "input").split("\n") if ln.strip()]
            inputs.append([json.loads(ln) for ln in lines])
            outputs.append(json.loads(_text(c.get("output"), "output")))
        except ValueError as e:
            raise ValueError(f"functional case is not JSON lines: {e}") from None
    return _functional(func_name, inputs, outputs, lists_may_wrap=False)


def _functional(
    name: str, inputs: list[Any], outputs: list[Any], lists_may_wrap: bool = True
) -> ProgramTests:
    """One assert per case calling the candidate's `name` (a method of `Solution` when the
    candidate defines that class). APPS wraps a call's return value in a one-item list, so
    there either form is accepted."""
    if not name.isidentifier():
        raise ValueError(f"fn_name {name!r} is not a Python name")
    units = []
    for args, expected in zip(inputs, outputs, strict=True):
        if not isinstance(args, list):
            raise ValueError("functional inputs must be lists of arguments")
        call = f"__entry__({name!r})({', '.join(repr(a) for a in args)})"
        wrapped = lists_may_wrap and isinstance(expected, list) and len(expected) == 1
        test = f"__c == {expected!r}" + (f" or __c == {expected[0]!r}" if wrapped else "")
        units.append(f"assert (lambda __c: {test})({call})")
    return ProgramTests(units=units)
