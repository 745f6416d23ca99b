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

What the tests compute only to compare with stays out of the sandbox: a trusted assignment
(`odd_sum = sum(...)` in HumanEval/151) that no leaf and no loop or `if` header needs, directly
or through other assignments, runs only in the judge (`_judge_only`); a candidate could
otherwise read it from its caller's frame or globals and return it. What a leaf needs cannot be
hidden: when a test computes its expected value to build an input (HumanEval/38 and /50:
`assert candidate(encode(s)) == s`), `s` is in the sandbox, and a candidate that inspects its
caller's frame can read it (docs/sandbox.md).

A unit holding an assert is a case. Loops (`for`, `while`) and `if`s may hold cases when their
headers are trusted, so HumanEval's `for x in range(2, 8): assert candidate(x, x + 1) == str(x)`
is judged iteration by iteration. Dataset errors (ValueError): a leaf inside a comprehension,
lambda or helper function (it cannot be evaluated apart from its scope), a candidate name in a
loop or `if` header, `try`/`with`/`class` blocks that use candidate names, an import the judge
does not allow.
"""

from __future__ import annotations

import ast
import builtins
import copy
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from rollout_servers.code_formats import IoTests, ProgramTests

JUDGE_MODULES = frozenset(
    {
        "math", "cmath", "random", "string", "copy", "itertools", "collections", "heapq",
        "bisect", "functools", "operator", "re", "fractions", "decimal", "statistics", "typing",
        "numbers", "datetime", "array", "sys",  # sys: a few numbers only (code_judge)
    }
)  # fmt: skip
"""Modules the judge may import (pure computation); a test that imports another is refused."""
_DENIED = {
    "eval", "exec", "compile", "open", "input", "breakpoint", "__import__", "globals", "locals",
    "vars", "help", "exit", "quit", "getattr", "setattr", "delattr", "dir", "memoryview",
    "print", "copyright", "credits", "license", "__loader__", "__spec__", "__name__", "__doc__",
    "__package__",
}  # fmt: skip
JUDGE_BUILTINS = frozenset(n for n in dir(builtins) if n not in _DENIED) | {"print"}
"""Builtins the judge's code may use (`print` is a no-op there): everything but what could turn
a candidate-chosen string into code, a file or an attribute walk."""
_SIMPLE = (ast.Assert, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr)
_PLAIN = (ast.Pass, ast.Break, ast.Continue, ast.Import, ast.ImportFrom)
_SCOPED = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.NamedExpr)


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
    """Split parsed tests (`code_formats.parse_test_cases`) into sandbox and judge programs."""
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
        _check_private_attributes(stmt)
    bound = set().union(*(_bound_names(s) for s in statements)) if statements else set()
    trusted = (bound | JUDGE_BUILTINS | JUDGE_MODULES) - {tests.candidate}
    used = set().union(*(_all_names(s) for s in statements)) if statements else set()
    imports = sorted((used & JUDGE_MODULES) - bound)  # `math.isclose` without `import math`
    statements = [ast.parse(f"import {name}").body[0] for name in imports] + statements
    n_setup = len(imports) + sum(len(tree.body) for tree in trees[: len(tests.setup)])
    checks = CodeChecks("program")
    judge_only = _judge_only(statements, trusted)
    claimed = _claimed_names(statements, trusted)
    for u, stmt in enumerate(statements):
        _check_imports(stmt)
        unit = _Unit(u, trusted, judge_only)
        checks.sandbox_units.append(_source(unit.sandbox(stmt)))
        checks.judge_units.append(_source(unit.judge(stmt)))
        has_assert = any(isinstance(n, ast.Assert) for n in ast.walk(stmt))
        if (
            u >= n_setup
            and has_assert
            and (_free_names(stmt) - trusted) | (_all_names(stmt) & claimed)
        ):
            checks.cases.append(u)  # an assert that reads nothing of the candidate is no case
    if not checks.cases:
        raise ValueError(
            "no assert uses the candidate's code (a name like a builtin's is the builtin)"
        )
    _refuse_exposed(statements, trusted, judge_only)
    return checks


def _claimed_names(statements: list[ast.stmt], trusted: set[str]) -> set[str]:
    """Names bound to what the candidate's code returned, directly (`solution = f(x)`) or
    through other assignments (HumanEval/32's `solution`)."""
    simple = [n for s in statements for n in ast.walk(s) if isinstance(n, _SIMPLE)]
    claimed: set[str] = set()
    changed = True
    while changed:
        changed = False
        for n in simple:
            if (_free_names(n) - trusted or _all_names(n) & claimed) and _bound_names(n) - claimed:
                claimed |= _bound_names(n)
                changed = True
    return claimed


def _check_private_attributes(stmt: ast.stmt) -> None:
    """Test code runs trusted in the judge: an attribute starting with `_` could walk from an
    allowed module to any other (`random._os`), so a row that uses one is refused."""
    for n in ast.walk(stmt):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_"):
            raise ValueError(f"tests use the private attribute {n.attr!r}, which the judge refuses")


GIVEN_THROUGH = frozenset({"deepcopy", "copy", "list", "tuple", "dict", "set", "frozenset"})
"""Calls through which a test hands the candidate its own value (`copy.deepcopy(coeffs)`)."""


def _refuse_exposed(statements: list[ast.stmt], trusted: set[str], judge_only: set[int]) -> None:
    """A dataset error when an assert compares with a value the sandbox holds that the
    candidate is not handed: `for x, y in pairs: assert f(x) == y` (the loop binds `y` in the
    sandbox) or `assert f(encode(s)) == s` (HumanEval/38, /50: `s` builds the input). A
    candidate could read it from its caller's frame and return it."""
    visible: set[str] = set()  # names the sandbox binds to trusted values
    kept = [s for s in statements if id(s) not in judge_only]
    while kept:
        n = kept.pop()
        if id(n) in judge_only:
            continue
        if isinstance(n, ast.For):
            visible |= _bound_names(n.target)
        if isinstance(n, (ast.For, ast.While, ast.If)):
            kept += [*n.body, *n.orelse]
        elif isinstance(n, _SIMPLE) and not _free_names(n) - trusted:
            visible |= _bound_names(n)  # no leaf: a trusted value
    given: set[str] = set()  # names handed to the candidate in any call (as they are)
    compared: dict[int, tuple[ast.Assert, set[str]]] = {}
    for n in (n for stmt in statements for n in ast.walk(stmt) if isinstance(n, _SIMPLE)):
        split = _Split(trusted, -1)
        try:
            rest = split.visit(copy.deepcopy(n.test if isinstance(n, ast.Assert) else n))
        except ValueError:
            continue  # refused by its unit with its reason
        given |= {name for leaf in split.leaves for name in _given_names(leaf)}
        if isinstance(n, ast.Assert):
            compared[id(n)] = (n, _all_names(rest))
    for node, names in compared.values():
        exposed = sorted((names & visible) - given)
        if exposed:
            raise ValueError(
                f"an assert compares with {exposed[0]!r}, a value the candidate could read "
                f"in the sandbox without being given it: {ast.unparse(node)[:120]!r}"
            )


def _given_names(leaf: ast.expr) -> set[str]:
    """Names a leaf hands the candidate as arguments, as they are or through `GIVEN_THROUGH`."""
    names: set[str] = set()
    for call in (n for n in ast.walk(leaf) if isinstance(n, ast.Call)):
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            while (
                isinstance(arg, ast.Call) and len(arg.args) == 1 and _callee(arg) in GIVEN_THROUGH
            ):
                arg = arg.args[0]
            if isinstance(arg, ast.Name):
                names.add(arg.id)
    return names


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _judge_only(statements: list[ast.stmt], trusted: set[str]) -> set[int]:
    """ids of the trusted assignments the sandbox can skip: no leaf and no loop or `if` header
    reads what they bind, directly or through an assignment it keeps, and skipping them changes
    nothing the sandbox computes (`_inert_assignment`). Walks the statements as `_Unit._walk`
    does: a statement the sandbox runs as it is needs every name it reads."""
    needed: set[str] = set()
    candidates: dict[int, ast.stmt] = {}

    def visit(stmt: ast.stmt) -> None:
        nonlocal needed
        if isinstance(stmt, _SIMPLE):
            if _inert_assignment(stmt, trusted):
                candidates[id(stmt)] = stmt
            elif isinstance(stmt, ast.Assert):
                needed |= _leaf_names(stmt, trusted)  # the sandbox keeps only its leaves
            else:
                needed |= _all_names(stmt)
        elif isinstance(stmt, (ast.For, ast.While, ast.If)) and _inert_block(stmt, trusted):
            candidates[id(stmt)] = stmt  # `for i in range(6): want.append(i * i)`
        elif isinstance(stmt, (ast.For, ast.While, ast.If)) and _free_names(stmt) - trusted:
            needed |= _all_names(stmt.iter if isinstance(stmt, ast.For) else stmt.test)
            needed |= _bound_names(stmt.target) if isinstance(stmt, ast.For) else set()
            for inner in [*stmt.body, *stmt.orelse]:
                visit(inner)
        else:
            needed |= _all_names(stmt)  # runs as it is (or is refused later)

    for stmt in statements:
        visit(stmt)
    changed = True
    while changed:  # what a kept assignment reads is needed too
        changed = False
        for key, stmt in list(candidates.items()):
            if _bound_names(stmt) & needed:
                needed |= _all_names(stmt)
                del candidates[key]
                changed = True
    return set(candidates)


def _inert_assignment(node: ast.stmt, trusted: set[str]) -> bool:
    """A trusted statement the sandbox may skip when nothing it touches is needed: it uses no
    candidate name, draws nothing from `random`, and calls no function the tests define (which
    could change what a leaf reads); it can only change the names it mentions
    (`want.append(...)`, `want += ...`, `want = 'ab'.upper()`)."""
    if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr)):
        return False
    names = _all_names(node)
    calls = [n.func for n in ast.walk(node) if isinstance(n, ast.Call)]
    known = all(
        (isinstance(f, ast.Name) and f.id in JUDGE_BUILTINS) or isinstance(f, ast.Attribute)
        for f in calls
    )
    helpers = {
        f.value.id for f in calls if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
    }
    return (
        known
        and "random" not in names
        and not (helpers & (JUDGE_MODULES - {"math", "string", "operator"}))
        and not _free_names(node) - trusted
    )


def _inert_block(stmt: ast.For | ast.While | ast.If, trusted: set[str]) -> bool:
    """A trusted loop or `if` whose statements are all inert (`_inert_assignment`)."""
    header = stmt.iter if isinstance(stmt, ast.For) else stmt.test
    calls = [n.func for n in ast.walk(header) if isinstance(n, ast.Call)]
    plain_header = "random" not in _all_names(header) and all(
        isinstance(f, ast.Name) and f.id in JUDGE_BUILTINS for f in calls
    )
    inner = [*stmt.body, *stmt.orelse]
    return plain_header and all(
        _inert_block(b, trusted) if isinstance(b, (ast.For, ast.While, ast.If))
        else isinstance(b, (ast.Pass, ast.Break, ast.Continue)) or _inert_assignment(b, trusted)
        for b in inner
    )  # fmt: skip


def _leaf_names(stmt: ast.Assert, trusted: set[str]) -> set[str]:
    """The names the sandbox's version of an assert reads: its leaves' only."""
    split = _Split(trusted, -1)
    try:
        split.visit(copy.deepcopy(stmt.test))
    except ValueError:  # refused later, with its unit's number
        return _all_names(stmt)
    return set().union(*(_all_names(leaf) for leaf in split.leaves))


def _source(statements: list[ast.stmt]) -> str:
    return ast.unparse(ast.fix_missing_locations(ast.Module(statements, [])))


def _bound_names(node: ast.AST) -> set[str]:
    names: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, ast.alias):
            names.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
    return names


def _all_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


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
        split = _Split(self.trusted, self.index)
        targets = getattr(stmt, "targets", None) or [getattr(stmt, "target", None)]
        if any(t is not None and _all_names(t) - self.trusted for t in targets):
            raise ValueError(f"test unit {self.index}: assigns to the candidate's objects")
        stmt = copy.deepcopy(stmt)  # the transformer edits in place; both programs need it
        if isinstance(stmt, ast.Assert):
            test = split.visit(stmt.test)
            negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
            truth = test.operand if isinstance(test, ast.UnaryOp) and negated else test
            if isinstance(truth, ast.Subscript) and _is_leaf_ref(truth):
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
        untrusted = _free_names(stmt) - self.trusted
        if isinstance(stmt, _SIMPLE):
            return simple(stmt)
        if isinstance(stmt, _PLAIN) or not untrusted:
            return [stmt]
        if isinstance(stmt, (ast.For, ast.While, ast.If)):
            header = stmt.iter if isinstance(stmt, ast.For) else stmt.test
            if _free_names(header) - self.trusted:
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


def _is_leaf_ref(node: ast.expr) -> bool:
    """Whether `node` is `__r[k]`, the claimed value of a leaf."""
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "__r"
        and isinstance(node.slice, ast.Constant)
    )


def _no_args() -> ast.arguments:
    return ast.arguments([], [], None, [], [], None, [])


def _args(name: str) -> ast.arguments:
    return ast.arguments([], [ast.arg(name)], None, [], [], None, [])


class _Split(ast.NodeTransformer):
    """Replace each maximal candidate-dependent expression by `__r[k]`, collecting it."""

    def __init__(self, trusted: set[str], unit: int) -> None:
        self.trusted = trusted
        self.unit = unit
        self.leaves: list[ast.expr] = []

    def visit(self, node: ast.AST) -> Any:
        if not isinstance(node, ast.expr) or not _free_names(node) - self.trusted:
            return self.generic_visit(node) if not isinstance(node, ast.expr) else node
        splittable: tuple[type[ast.AST], ...] = (ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare)
        splittable += (ast.IfExp, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Starred)
        splittable += (ast.Subscript, ast.Slice, ast.JoinedStr, ast.FormattedValue)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call):
            splittable += (ast.Attribute,)  # `f(x).count(3)`: a method of the claimed value
        if isinstance(node, splittable):
            return self.generic_visit(node)
        if isinstance(node, ast.Call) and (
            not _free_names(node.func) - self.trusted
            or (isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Call))
        ):
            return self.generic_visit(node)  # a trusted function over candidate values
        if any(isinstance(n, _SCOPED) for n in ast.walk(node)):
            raise ValueError(
                f"test unit {self.unit}: candidate code inside a comprehension or lambda cannot "
                f"be judged outside the sandbox: {ast.unparse(node)!r}"
            )
        self.leaves.append(node)
        index = ast.Constant(len(self.leaves) - 1)
        return ast.Subscript(ast.Name("__r", ast.Load()), index, ast.Load())


def _free_names(node: ast.AST) -> set[str]:
    """Names `node` reads that it does not bind itself (comprehension targets, lambda and
    function arguments, names assigned inside)."""
    return _all_names(node) - _bound_names(node)
