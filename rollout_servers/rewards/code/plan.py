"""Planning a row's tests: what runs in the sandbox, and what only the trusted judge sees.

A name is the candidate's unless the tests bind it themselves (an assignment, a loop variable,
an import, a helper they define) or it is one of `JUDGE_BUILTINS` or `JUDGE_MODULES`. Each
maximal expression that uses a candidate name is a *leaf* (`add(1, 2)` in
`assert add(1, 2) == 3`). Every test statement (a *unit*) becomes two programs:

- the sandbox's: the statement with each execution's leaves evaluated and reported through
  `__leaves(unit, [...])`; an `assert` keeps only its leaves, so its expected values never
  enter the sandbox;
- the judge's: the same statement with each leaf replaced by the value the sandbox claimed
  (`__take(unit)`), an assert checked through `__check`.

What the tests compute only to compare with stays with the judge, and a row whose comparison
needs a value the sandbox must hold is refused (`scope`).

A unit holding an assert that reads the candidate's values is a case. Loops (`for`, `while`) and `if`s may hold cases when their
headers are trusted, so HumanEval's `for x in range(2, 8): assert candidate(x, x + 1) == str(x)`
is judged iteration by iteration. Dataset errors (ValueError): a leaf inside a comprehension,
lambda or helper function (it cannot be evaluated apart from its scope), a candidate name in a
loop or `if` header, `try`/`with`/`class` blocks that use candidate names, an import the judge
does not allow, a private attribute (`random._os`), no case at all, an exposed answer.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from rollout_servers.rewards.code.formats import IoTests, ProgramTests
from rollout_servers.rewards.code.scope import (
    JUDGE_BUILTINS,
    JUDGE_MODULES,
    PLAIN,
    SIMPLE,
    Split,
    all_names,
    bound_names,
    check_private_attributes,
    claimed_names,
    free_names,
    is_leaf_ref,
    judge_only_statements,
    refuse_exposed,
)

__all__ = ["JUDGE_BUILTINS", "JUDGE_MODULES", "CodeChecks", "plan_checks"]


@dataclass(frozen=True)
class CodeChecks:
    """The tests of one row, split into what the sandbox runs and what only the judge sees."""

    mode: Literal["io", "program"]
    inputs: list[str] = field(default_factory=list)
    """io: each case's stdin (sent to the sandbox)."""
    outputs: list[str] = field(default_factory=list)
    """io: each case's expected stdout (never sent)."""
    sandbox_units: list[str] = field(default_factory=list)
    """program: each unit as the sandbox runs it, setup first (sent)."""
    judge_units: list[str] = field(default_factory=list)
    """program: each unit as the judge runs it (never sent)."""
    cases: list[int] = field(default_factory=list)
    """program: the units that are cases."""

    @property
    def total(self) -> int:
        return len(self.inputs) if self.mode == "io" else len(self.cases)


def plan_checks(tests: IoTests | ProgramTests) -> CodeChecks:
    """Split parsed tests (`formats.parse_test_cases`) into sandbox and judge programs."""
    if isinstance(tests, IoTests):
        return CodeChecks("io", inputs=tests.inputs, outputs=tests.outputs)
    trees = []
    for i, text in enumerate([*tests.setup, *tests.units]):
        try:
            trees.append(ast.parse(text.strip()))
        except SyntaxError as e:
            raise ValueError(f"test statement {i} is not valid Python: {e.msg}") from None
    statements = [stmt for tree in trees for stmt in tree.body]
    for stmt in statements:
        check_private_attributes(stmt)
    bound = set().union(*(bound_names(s) for s in statements)) if statements else set()
    trusted = (bound | JUDGE_BUILTINS | JUDGE_MODULES) - {tests.candidate}
    used = set().union(*(all_names(s) for s in statements)) if statements else set()
    imports = sorted((used & JUDGE_MODULES) - bound)  # `math.isclose` without `import math`
    statements = [ast.parse(f"import {name}").body[0] for name in imports] + statements
    n_setup = len(imports) + sum(len(tree.body) for tree in trees[: len(tests.setup)])
    checks = CodeChecks("program")
    judge_only = judge_only_statements(statements, trusted)
    claimed = claimed_names(statements, trusted)
    for u, stmt in enumerate(statements):
        _check_imports(stmt)
        unit = _Unit(u, trusted, judge_only)
        checks.sandbox_units.append(_source(unit.sandbox(stmt)))
        checks.judge_units.append(_source(unit.judge(stmt)))
        has_assert = any(isinstance(n, ast.Assert) for n in ast.walk(stmt))
        if (
            u >= n_setup
            and has_assert
            and (free_names(stmt) - trusted) | (all_names(stmt) & claimed)
        ):
            checks.cases.append(u)  # an assert that reads nothing of the candidate is no case
    if not checks.cases:
        raise ValueError(
            "no assert uses the candidate's code (a name like a builtin's is the builtin)"
        )
    refuse_exposed(statements, trusted, judge_only)
    return checks


def _source(statements: list[ast.stmt]) -> str:
    return ast.unparse(ast.fix_missing_locations(ast.Module(statements, [])))


def _check_imports(stmt: ast.stmt) -> None:
    for n in ast.walk(stmt):
        modules = []
        if isinstance(n, ast.Import):
            modules = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            modules = [n.module or ""] if not n.level else ["." * n.level]
        for module in modules:
            if module.split(".")[0] not in JUDGE_MODULES:
                raise ValueError(f"tests import {module!r}, which the trusted judge does not run")


class _Unit:
    """The two programs of one test statement (see the module docstring)."""

    def __init__(self, index: int, trusted: set[str], judge_only: set[int]) -> None:
        self.index = index
        self.trusted = trusted
        self.judge_only = judge_only  # ids of the assignments the sandbox skips

    def _call(self, name: str, *args: ast.expr) -> ast.Call:
        return ast.Call(ast.Name(name, ast.Load()), [ast.Constant(self.index), *args], [])

    def _split(self, stmt: ast.stmt) -> tuple[ast.stmt, list[ast.expr]]:
        split = Split(self.trusted, self.index)
        targets = getattr(stmt, "targets", None) or [getattr(stmt, "target", None)]
        if any(t is not None and all_names(t) - self.trusted for t in targets):
            raise ValueError(f"test unit {self.index}: assigns to the candidate's objects")
        stmt = copy.deepcopy(stmt)  # the transformer edits in place; both programs need it
        if isinstance(stmt, ast.Assert):
            test = split.visit(stmt.test)
            negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
            truth = test.operand if isinstance(test, ast.UnaryOp) and negated else test
            if isinstance(truth, ast.Subscript) and is_leaf_ref(truth):
                # `assert f(x)`: only its truth is tested (MBPP's regexes return a re.Match)
                index = int(cast(ast.Constant, truth.slice).value)  # type: ignore[arg-type]
                leaf = split.leaves[index]
                split.leaves[index] = ast.Call(ast.Name("bool", ast.Load()), [leaf], [])
            return ast.Assert(test, None), split.leaves
        return cast(ast.stmt, split.generic_visit(stmt)), split.leaves

    def sandbox(self, stmt: ast.stmt) -> list[ast.stmt]:
        return self._walk(stmt, self._sandbox_simple)

    def judge(self, stmt: ast.stmt) -> list[ast.stmt]:
        return self._walk(stmt, self._judge_simple)

    def _sandbox_simple(self, stmt: ast.stmt) -> list[ast.stmt]:
        rest, leaves = self._split(stmt)
        if not leaves:
            return [ast.Pass()] if isinstance(stmt, ast.Assert) else [stmt]
        thunks = ast.List([ast.Lambda(_no_args(), leaf) for leaf in leaves], ast.Load())
        report = self._call("__leaves", thunks)
        if isinstance(stmt, ast.Assert):
            return [ast.Expr(report)]
        return [ast.Assign([ast.Name("__r", ast.Store())], report), rest]

    def _judge_simple(self, stmt: ast.stmt) -> list[ast.stmt]:
        rest, leaves = self._split(stmt)
        if isinstance(rest, ast.Assert):
            test = ast.Lambda(_args("__r"), rest.test)
            return [ast.Expr(self._call("__check", test, ast.Constant(bool(leaves))))]
        if not leaves:
            return [rest]
        return [ast.Assign([ast.Name("__r", ast.Store())], self._call("__take")), rest]

    def _walk(self, stmt: ast.stmt, simple: Any) -> list[ast.stmt]:
        if simple == self._sandbox_simple and id(stmt) in self.judge_only:
            return [ast.Pass()]
        untrusted = free_names(stmt) - self.trusted
        if isinstance(stmt, SIMPLE):
            return simple(stmt)
        if isinstance(stmt, PLAIN) or not untrusted:
            return [stmt]
        if isinstance(stmt, (ast.For, ast.While, ast.If)):
            header = stmt.iter if isinstance(stmt, ast.For) else stmt.test
            if free_names(header) - self.trusted:
                raise ValueError(
                    f"test unit {self.index}: candidate code in a loop or if header is not "
                    f"supported: {ast.unparse(header)!r}"
                )
            out = copy.deepcopy(stmt)  # a copy whose bodies we replace
            assert isinstance(out, (ast.For, ast.While, ast.If))
            out.body = [s for b in stmt.body for s in self._walk(b, simple)] or [ast.Pass()]
            out.orelse = [s for b in stmt.orelse for s in self._walk(b, simple)]
            return [out]
        raise ValueError(
            f"test unit {self.index}: a {type(stmt).__name__} that uses candidate names "
            f"{sorted(untrusted)[:3]} is not supported"
        )


def _no_args() -> ast.arguments:
    return ast.arguments([], [], None, [], [], None, [])


def _args(name: str) -> ast.arguments:
    return ast.arguments([], [ast.arg(name)], None, [], [], None, [])
