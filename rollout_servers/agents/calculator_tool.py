"""The `calculator` tool: arithmetic on the model's expression without `eval`.

`evaluate_expression` walks the expression's syntax tree and evaluates only numbers and the
arithmetic operators, every value bounded in digits (its docstring says how). A refusal comes
back to the model as `Error: ...` text.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

from rollout_servers.agents.tools import Tool, ToolResponse


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the message is for the model)."""


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def evaluate_expression(text: str, max_chars: int = 200, max_digits: int = 100) -> int | float:
    """The value of an arithmetic expression: ints and floats, + - * / // % **, parentheses,
    unary minus and plus, with Python's precedence.

    Parsed by `ast` and walked by hand; only the node types above are evaluated, so names,
    calls, attributes, subscripts and the like are refused, never run (no eval or exec). Every
    intermediate value must stay below 10**max_digits in magnitude, and a power is refused
    before it is computed when its result would not, so no input can make it burn CPU or
    memory. Raises CalculatorError.
    """
    if len(text) > max_chars:
        raise CalculatorError(f"expression longer than {max_chars} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not an arithmetic expression: {e}") from None
    try:
        return _evaluate(tree.body, max_digits)
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def _evaluate(node: ast.AST, max_digits: int) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value, max_digits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, max_digits))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, max_digits), _evaluate(node.right, max_digits)
        power = isinstance(node.op, ast.Pow) and left != 0
        if power and float(right) * math.log10(abs(left)) > max_digits:
            raise CalculatorError(f"result would exceed 10**{max_digits}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right), max_digits)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError(f"result would exceed 10**{max_digits}") from None
    if isinstance(node, ast.Constant):
        what = repr(node.value)
    elif isinstance(node, (ast.BinOp, ast.UnaryOp)):
        what = f"operator {type(node.op).__name__}"
    else:
        what = type(node).__name__
    raise CalculatorError(f"unsupported element {what}: only numbers and + - * / // % ** ( )")


def _bounded(value: Any, max_digits: int) -> int | float:
    if not isinstance(value, (int, float)):  # e.g. (-8) ** 0.5 is complex
        raise CalculatorError("result is not a real number")
    if isinstance(value, float) and math.isnan(value):
        raise CalculatorError("result is not a number")
    if abs(value) >= 10**max_digits:
        raise CalculatorError(f"result would exceed 10**{max_digits}")
    return value


class CalculatorTool(Tool):
    """Evaluates `arguments["expression"]` with `evaluate_expression`; refusals come back as
    `Error: ...` text, counted in the `error` metric."""

    def __init__(self, schema: Mapping[str, Any], max_chars: int = 200, max_digits: int = 100):
        super().__init__(schema)
        self.max_chars, self.max_digits = max_chars, max_digits

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        try:
            value = evaluate_expression(arguments["expression"], self.max_chars, self.max_digits)
        except CalculatorError as e:
            return ToolResponse(f"Error: {e}", metrics={"error": 1.0})
        return ToolResponse(repr(value))
