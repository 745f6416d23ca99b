"""Tools: the calculator (values by hand, refusals), argument validation, tool configs, and the
python tool over a fake sandbox of the real one's shape (and over the real sandbox)."""

from __future__ import annotations

import asyncio
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout_servers.agents.calculator_tool import (
    CalculatorError,
    CalculatorTool,
    evaluate_expression,
)
from rollout_servers.agents.python_tool import PythonTool
from rollout_servers.agents.tools import (
    check_tool_schema,
    load_tool_config,
    truncate_middle,
    validate_arguments,
)

REPO = Path(__file__).resolve().parents[2]


def schema(name: str = "f", properties: dict | None = None, required: list | None = None) -> dict:
    props = {"x": {"type": "string"}} if properties is None else properties
    params = {"type": "object", "properties": props, "required": required or []}
    return {"type": "function", "function": {"name": name, "parameters": params}}


# ---- calculator ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("2 ** 3 ** 2", 512),  # right-associative
        ("-2 ** 2", -4),  # ** binds tighter than unary minus
        ("(-2) ** 2", 4),
        ("--3 + +1", 4),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("-7 % 3", 2),
        ("1.5 * 2 - 0.5", 2.5),
        ("2 ** -1", 0.5),
        ("10 ** 99", 10**99),
        ("100 - 10 - 1", 89),  # left-associative
        ("2 * (3 + (4 - 1)) / 3", 4.0),
    ],
)
def test_calculator_values(expression: str, value: int | float):
    result = evaluate_expression(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("1 / 0", "division by zero"),
        ("1 // 0", "division by zero"),
        ("1 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9 ** 9 ** 9", "exceed 10**100"),
        ("10 ** 100", "exceed 10**100"),
        ("2.0 ** 5000", "exceed 10**100"),
        ("0.5 ** -1000", "exceed 10**100"),
        ("(10 ** 60) * (10 ** 60)", "exceed 10**100"),
        ("1e999", "exceed 10**100"),
        ("(-8) ** 0.5", "not a real number"),
        ("__import__('os')", "unsupported element Call"),
        ("x + 1", "unsupported element Name"),
        ("(1).real", "unsupported element Attribute"),
        ("[1, 2][0]", "unsupported element Subscript"),
        ("'a' * 3", "unsupported element 'a'"),
        ("True + 1", "unsupported element True"),
        ("1j", "unsupported element 1j"),
        ("1 < 2", "unsupported element Compare"),
        ("2 ^ 3", "unsupported element operator BitXor"),
        ("1 +", "not an arithmetic expression"),
        ("import os", "not an arithmetic expression"),
        ("1" * 201, "longer than 200"),
    ],
)
def test_calculator_refusals(expression: str, error: str):
    with pytest.raises(CalculatorError, match=re.escape(error)):
        evaluate_expression(expression)


async def test_calculator_tool_returns_values_and_error_text():
    tool = CalculatorTool(schema("calculator", {"expression": {"type": "string"}}, ["expression"]))
    assert (await tool.execute("i", {"expression": "6 * 7"})).text == "42"
    refused = await tool.execute("i", {"expression": "1 / 0"})
    assert refused.text == "Error: division by zero" and refused.metrics == {"error": 1.0}


# ---- schemas and arguments ------------------------------------------------------------------------
def test_validate_arguments_checks_types_required_and_nesting():
    params = {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "n": {"type": "number"},
            "i": {"type": "integer"},
            "b": {"type": "boolean"},
            "mode": {"type": "string", "enum": ["fast", "slow"]},
            "xs": {"type": "array", "items": {"type": "integer"}},
            "opt": {"type": ["string", "null"]},
        },
        "required": ["s", "i"],
    }
    good = {"s": "a", "n": 1, "i": 2, "b": False, "mode": "fast", "xs": [1, 2], "opt": None}
    assert validate_arguments(params, good) is None
    assert validate_arguments(params, {**good, "n": 1.5, "extra": 1}) is None
    cases = [
        ({"i": 1}, "missing the required property 's'"),
        ({**good, "i": 1.5}, "arguments.i must be integer, got number"),
        ({**good, "i": True}, "arguments.i must be integer, got boolean"),
        ({**good, "n": "1"}, "arguments.n must be number, got string"),
        ({**good, "b": 0}, "arguments.b must be boolean, got integer"),
        ({**good, "mode": "medium"}, "arguments.mode must be one of"),
        ({**good, "xs": [1, "2"]}, "arguments.xs[1] must be integer, got string"),
        ([1], "arguments must be object, got array"),
    ]
    for value, error in cases:
        assert error in (validate_arguments(params, value) or ""), value
    closed = {**params, "additionalProperties": False}
    assert "unexpected property 'extra'" in (validate_arguments(closed, {**good, "extra": 1}) or "")


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"type": "object"}, "type: function"),
        ({**schema(), "type": "tool"}, "type: function"),
        (schema(name="bad name"), "needs a name"),
        (schema(required=["y"]), r"required \['y'\] are not among the properties"),
        (schema(properties={"x": {"type": "date"}}), "unsupported type"),
        (
            {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}},
            "object",
        ),
    ],
)
def test_check_tool_schema_rejects_what_it_cannot_validate(bad: dict, error: str):
    with pytest.raises(ValueError, match=error):
        check_tool_schema(bad)


# ---- tool configs -------------------------------------------------------------------------------
def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_load_tool_config_by_name_and_import_path(tmp_path: Path):
    path = write(
        tmp_path,
        """
        tools:
          - class_name: calculator
            config: {max_digits: 10}
            tool_schema:
              type: function
              function:
                name: calc
                parameters: {type: object, properties: {expression: {type: string}}}
          - class_name: rollout_servers.agents.calculator_tool:CalculatorTool
            tool_schema: {type: function, function: {name: calc2}}
        """,
    )
    toolset = load_tool_config(path)
    assert list(toolset.tools) == ["calc", "calc2"]
    calc = toolset.tools["calc"]
    assert isinstance(calc, CalculatorTool) and calc.max_digits == 10
    assert [s["function"]["name"] for s in toolset.schemas] == ["calc", "calc2"]
    assert toolset.check_call("calc", {"expression": "1"}) is None
    assert "unknown tool 'other'" in (toolset.check_call("other", {}) or "")
    assert "arguments.expression must be string" in (
        toolset.check_call("calc", {"expression": 1}) or ""
    )


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        (
            "class_name: nope",
            r"unknown tool 'nope': registered are \['calculator', 'python', 'search'\]",
        ),
        ("class_name: rollout_servers.agents.tools:ToolSet", "is not a Tool subclass"),
        ("class_name: calculator\n    config: {bogus: 1}", "tools\\[0\\].*bogus"),
        ("class_name: calculator\n    colour: red", "expected only keys"),
    ],
)
def test_load_tool_config_errors_name_the_entry(tmp_path: Path, entry: str, error: str):
    text = f"tools:\n  - {entry}\n    tool_schema: {{type: function, function: {{name: f}}}}\n"
    with pytest.raises(ValueError, match=error):
        load_tool_config(write(tmp_path, text))


def test_load_tool_config_rejects_duplicates_and_other_layouts(tmp_path: Path):
    entry = "  - class_name: calculator\n    tool_schema: {type: function, function: {name: f}}\n"
    with pytest.raises(ValueError, match="two tools are named 'f'"):
        load_tool_config(write(tmp_path, "tools:\n" + entry + entry))
    with pytest.raises(ValueError, match="top-level `tools:` list"):
        load_tool_config(write(tmp_path, "calculator: {}\n"))


# ---- python -----------------------------------------------------------------------------------
@dataclass
class FakeResult:
    status: str
    stdout: str
    stderr: str
    exit_code: int | None
    wall_s: float


class FakeSandbox:
    """The real sandbox's shape: `await run(code, stdin) -> result`; records what it ran."""

    def __init__(self, result: FakeResult):
        self.result = result
        self.runs: list[tuple[str, str]] = []

    async def run(self, code: str, stdin: str = "") -> FakeResult:
        self.runs.append((code, stdin))
        return self.result


PYTHON_SCHEMA = schema(
    "python", {"code": {"type": "string"}, "stdin": {"type": "string"}}, ["code"]
)


async def test_python_tool_reports_status_and_cut_streams():
    sandbox = FakeSandbox(FakeResult("error", "a" * 50 + "b" * 50, "Traceback...\nBoom", 1, 0.25))
    tool = PythonTool(PYTHON_SCHEMA, max_output_chars=20, sandbox=sandbox)
    response = await tool.execute("i", {"code": "print(1)", "stdin": "in"})
    assert sandbox.runs == [("print(1)", "in")]
    assert response.text == (
        "status: error, exit code: 1\n"
        "stdout:\n" + "a" * 10 + "\n...[80 characters cut]...\n" + "b" * 10 + "\n"
        "stderr:\nTraceback...\nBoom"
    )
    assert response.metrics == {"status_error": 1.0, "wall_s": 0.25}
    quiet = PythonTool(PYTHON_SCHEMA, sandbox=FakeSandbox(FakeResult("timeout", "", "", None, 5)))
    assert (await quiet.execute("i", {"code": "while True: pass"})).text == (
        "status: timeout, exit code: None"
    )


def test_truncate_middle_keeps_head_and_tail():
    assert truncate_middle("short", 10) == "short"
    assert truncate_middle("0123456789", 4) == "01\n...[6 characters cut]...\n89"


def test_default_tool_config_runs_code_in_the_real_sandbox():
    """configs/tools/default_tools.yaml as the server loads it: before its event loop starts."""
    toolset = load_tool_config(REPO / "configs/tools/default_tools.yaml")
    try:
        assert list(toolset.tools) == ["calculator", "python"]
        assert toolset.check_call("python", {"code": "print(1)"}) is None
        assert "missing the required property 'code'" in (toolset.check_call("python", {}) or "")
        code = "import sys\nprint(input() * 2)\nprint('oops', file=sys.stderr)\nsys.exit(3)"
        response = asyncio.run(
            toolset.tools["python"].execute("i", {"code": code, "stdin": "ab\n"})
        )
        assert response.text == "status: error, exit code: 3\nstdout:\nabab\nstderr:\noops"
        assert response.metrics["status_error"] == 1.0
        calc = asyncio.run(toolset.tools["calculator"].execute("i", {"expression": "2 ** 10"}))
        assert calc.text == "1024"
    finally:
        toolset.close()


def test_calculator_refuses_deep_nesting_without_crashing():
    for expression in ("-" * 5000 + "1", "(" * 300 + "1" + ")" * 300, "2**" * 2000 + "2"):
        with pytest.raises(CalculatorError):
            evaluate_expression(expression, max_chars=100_000)
