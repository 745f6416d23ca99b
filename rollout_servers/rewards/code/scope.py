"""What the sandbox may see of a row's tests: the names of test code, the split of a statement
into the candidate's parts (leaves) and the rest, and the checks that keep expected values with
the judge (`plan` builds the two programs from them).

What the tests compute only to compare with stays out of the sandbox: a trusted statement that
no leaf and no loop or `if` header needs, directly or through statements it keeps, runs only in
the judge (`judge_only_statements`: HumanEval/151's `odd_sum = sum(...)`, an expected list built by a loop
of `append`s); a candidate could otherwise read it from its caller's frame or globals and
return it. What a leaf needs cannot be hidden, so a row whose assert compares with such a value
that the candidate is not handed itself is a dataset error (`refuse_exposed`: HumanEval/38 and
/50 build the input from the answer, `assert candidate(encode(s)) == s`).
"""

from __future__ import annotations

import ast
import builtins
import copy
from typing import Any

JUDGE_MODULES = frozenset(
    {
        "math", "cmath", "random", "string", "copy", "itertools", "collections", "heapq",
        "bisect", "functools", "operator", "re", "fractions", "decimal", "statistics", "typing",
        "numbers", "datetime", "array", "sys",  # sys: a few numbers only (judge)
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
SIMPLE = (ast.Assert, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr)
PLAIN = (ast.Pass, ast.Break, ast.Continue, ast.Import, ast.ImportFrom)
SCOPED = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.NamedExpr)


def claimed_names(statements: list[ast.stmt], trusted: set[str]) -> set[str]:
    """Names bound to what the candidate's code returned, directly (`solution = f(x)`) or
    through other assignments (HumanEval/32's `solution`)."""
    simple = [n for s in statements for n in ast.walk(s) if isinstance(n, SIMPLE)]
    claimed: set[str] = set()
    changed = True
    while changed:
        changed = False
        for n in simple:
            if (free_names(n) - trusted or all_names(n) & claimed) and bound_names(n) - claimed:
                claimed |= bound_names(n)
                changed = True
    return claimed


def check_private_attributes(stmt: ast.stmt) -> None:
    """Test code runs trusted in the judge: an attribute starting with `_` could walk from an
    allowed module to any other (`random._os`), so a row that uses one is refused."""
    for n in ast.walk(stmt):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_"):
            raise ValueError(f"tests use the private attribute {n.attr!r}, which the judge refuses")


GIVEN_THROUGH = frozenset({"deepcopy", "copy", "list", "tuple", "dict", "set", "frozenset"})
"""Calls through which a test hands the candidate its own value (`copy.deepcopy(coeffs)`)."""


def refuse_exposed(statements: list[ast.stmt], trusted: set[str], judge_only: set[int]) -> None:
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
            visible |= bound_names(n.target)
        if isinstance(n, (ast.For, ast.While, ast.If)):
            kept += [*n.body, *n.orelse]
        elif isinstance(n, SIMPLE) and not free_names(n) - trusted:
            visible |= bound_names(n)  # no leaf: a trusted value
    given: set[str] = set()  # names handed to the candidate in any call (as they are)
    compared: dict[int, tuple[ast.Assert, set[str]]] = {}
    for n in (n for stmt in statements for n in ast.walk(stmt) if isinstance(n, SIMPLE)):
        split = Split(trusted, -1)
        try:
            rest = split.visit(copy.deepcopy(n.test if isinstance(n, ast.Assert) else n))
        except ValueError:
            continue  # refused by its unit with its reason
        given |= {name for leaf in split.leaves for name in _given_names(leaf, trusted)}
        if isinstance(n, ast.Assert):
            compared[id(n)] = (n, all_names(rest))
    for node, names in compared.values():
        exposed = sorted((names & visible) - given)
        if exposed:
            raise ValueError(
                f"an assert compares with {exposed[0]!r}, a value the candidate could read "
                f"in the sandbox without being given it: {ast.unparse(node)[:120]!r}"
            )


def _given_names(leaf: ast.expr, trusted: set[str]) -> set[str]:
    """Names a leaf hands the candidate's functions as arguments, as they are or through
    `GIVEN_THROUGH` (not what a trusted call inside makes of them: `f(encode(s))` hands `f`
    no `s`)."""
    names: set[str] = set()
    calls = [n for n in ast.walk(leaf) if isinstance(n, ast.Call)]
    for call in (c for c in calls if free_names(c.func) - trusted):
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


def judge_only_statements(statements: list[ast.stmt], trusted: set[str]) -> set[int]:
    """ids of the trusted assignments the sandbox can skip: no leaf and no loop or `if` header
    reads what they bind, directly or through an assignment it keeps, and skipping them changes
    nothing the sandbox computes (`_inert_assignment`). Walks the statements as `_Unit._walk`
    does: a statement the sandbox runs as it is needs every name it reads."""
    needed: set[str] = set()
    candidates: dict[int, ast.stmt] = {}

    def visit(stmt: ast.stmt) -> None:
        nonlocal needed
        if isinstance(stmt, SIMPLE):
            if _inert_assignment(stmt, trusted):
                candidates[id(stmt)] = stmt
            elif isinstance(stmt, ast.Assert):
                needed |= _leaf_names(stmt, trusted)  # the sandbox keeps only its leaves
            else:
                needed |= all_names(stmt)
        elif isinstance(stmt, (ast.For, ast.While, ast.If)) and _inert_block(stmt, trusted):
            candidates[id(stmt)] = stmt  # `for i in range(6): want.append(i * i)`
        elif isinstance(stmt, (ast.For, ast.While, ast.If)) and free_names(stmt) - trusted:
            needed |= all_names(stmt.iter if isinstance(stmt, ast.For) else stmt.test)
            needed |= bound_names(stmt.target) if isinstance(stmt, ast.For) else set()
            for inner in [*stmt.body, *stmt.orelse]:
                visit(inner)
        else:
            needed |= all_names(stmt)  # runs as it is (or is refused later)

    for stmt in statements:
        visit(stmt)
    changed = True
    while changed:  # what a kept assignment reads is needed too
        changed = False
        for key, stmt in list(candidates.items()):
            if bound_names(stmt) & needed:
                needed |= all_names(stmt)
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
    names = all_names(node)
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
        and not free_names(node) - trusted
    )


def _inert_block(stmt: ast.For | ast.While | ast.If, trusted: set[str]) -> bool:
    """A trusted loop or `if` whose statements are all inert (`_inert_assignment`)."""
    header = stmt.iter if isinstance(stmt, ast.For) else stmt.test
    calls = [n.func for n in ast.walk(header) if isinstance(n, ast.Call)]
    plain_header = "random" not in all_names(header) and all(
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
    split = Split(trusted, -1)
    try:
        split.visit(copy.deepcopy(stmt.test))
    except ValueError:  # refused later, with its unit's number
        return all_names(stmt)
    return set().union(*(all_names(leaf) for leaf in split.leaves))


def bound_names(node: ast.AST) -> set[str]:
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


def all_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def is_leaf_ref(node: ast.expr) -> bool:
    """Whether `node` is `__r[k]`, the claimed value of a leaf."""
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "__r"
        and isinstance(node.slice, ast.Constant)
    )


class Split(ast.NodeTransformer):
    """Replace each maximal candidate-dependent expression by `__r[k]`, collecting it."""

    def __init__(self, trusted: set[str], unit: int) -> None:
        self.trusted = trusted
        self.unit = unit
        self.leaves: list[ast.expr] = []

    def visit(self, node: ast.AST) -> Any:
        if not isinstance(node, ast.expr) or not free_names(node) - self.trusted:
            return self.generic_visit(node) if not isinstance(node, ast.expr) else node
        splittable: tuple[type[ast.AST], ...] = (ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare)
        splittable += (ast.IfExp, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Starred)
        splittable += (ast.Subscript, ast.Slice, ast.JoinedStr, ast.FormattedValue)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call):
            splittable += (ast.Attribute,)  # `f(x).count(3)`: a method of the claimed value
        if isinstance(node, splittable):
            return self.generic_visit(node)
        if isinstance(node, ast.Call) and (
            not free_names(node.func) - self.trusted
            or (isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Call))
        ):
            return self.generic_visit(node)  # a trusted function over candidate values
        if any(isinstance(n, SCOPED) for n in ast.walk(node)):
            raise ValueError(
                f"test unit {self.unit}: candidate code inside a comprehension or lambda cannot "
                f"be judged outside the sandbox: {ast.unparse(node)!r}"
            )
        self.leaves.append(node)
        index = ast.Constant(len(self.leaves) - 1)
        return ast.Subscript(ast.Name("__r", ast.Load()), index, ast.Load())


def free_names(node: ast.AST) -> set[str]:
    """Names `node` reads that it does not bind itself (comprehension targets, lambda and
    function arguments, names assigned inside)."""
    return all_names(node) - bound_names(node)
