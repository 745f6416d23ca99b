"""The code reward's dataset formats and its plan (what the sandbox gets, what only the judge
sees), without running anything (tests/integration/test_code_formats_e2e.py runs them)."""

from __future__ import annotations

import json

import pytest

from rollout_servers.code_formats import IoTests, ProgramTests, parse_test_cases
from rollout_servers.code_plan import plan_checks

HUMANEVAL = {
    "prompt": "import math\ndef helper(x):\n    return x + 1\ndef inc(x):\n    '''doc'''\n",
    "entry_point": "inc",
    "test": "METADATA = {}\n\ndef check(candidate):\n    import random\n"
    "    assert candidate(1) == 2, 'one'\n"
    "    for _ in range(3):\n        x = random.randint(0, 9)\n"
    "        assert candidate(x) == helper(x)\n",
}


def parse(cases) -> IoTests | ProgramTests:
    return parse_test_cases(json.dumps(cases), None)


def test_humaneval_check_becomes_units_and_the_prompts_helpers_trusted_setup():
    tests = parse(HUMANEVAL)
    assert isinstance(tests, ProgramTests)
    assert tests.setup == ["import math", "def helper(x):\n    return x + 1", "METADATA = {}"]
    assert tests.units[1] == "assert inc(1) == 2, 'one'"  # candidate -> the entry point
    checks = plan_checks(tests)
    assert checks.total == 2  # the assert, and the loop holding one
    sandbox = "\n".join(checks.sandbox_units)
    assert "== 2" not in sandbox and "helper(x)" not in sandbox.split("__leaves")[-1]
    assert "__leaves(5, [lambda: inc(x)])" in sandbox  # the loop's assert keeps only its leaf
    assert "__check(5, lambda __r: __r[0] == helper(x), True)" in checks.judge_units[5]


def test_mbpp_setup_and_asserts_and_modules_imported_for_the_judge():
    row = {"test_list": ["assert math.isclose(area(2), 12.56, rel_tol=0.01)"], "test_imports": []}
    checks = plan_checks(parse(row))
    assert checks.sandbox_units[0] == "import math"  # `math` is the judge's, never the candidate's
    assert checks.judge_units[-1] == (
        "__check(1, lambda __r: math.isclose(__r[0], 12.56, rel_tol=0.01), True)"
    )
    assert checks.cases == [1]  # an empty test_setup_code adds no unit


def test_stdin_stdout_formats():
    assert parse({"inputs": ["1\n"], "outputs": ["2\n"]}) == IoTests(["1\n"], ["2\n"])
    contests = {"public_tests": {"input": ["a"], "output": ["b"]},
                "private_tests": {"input": ["c"], "output": ["d"]}}  # fmt: skip
    assert parse(contests) == IoTests(["a", "c"], ["b", "d"])
    lcb = [{"input": "5\n", "output": "6\n", "testtype": "stdin"}]
    assert parse(lcb) == IoTests(["5\n"], ["6\n"])


def test_functional_formats_call_the_entry_with_literal_arguments():
    lcb = {"func_name": "twoSum", "public_test_cases": json.dumps(
        [{"input": "[2, 7]\n9", "output": "[0, 1]", "testtype": "functional"}])}  # fmt: skip
    tests = parse(lcb)
    assert isinstance(tests, ProgramTests)
    assert tests.units == ["assert (lambda __c: __c == [0, 1])(__entry__('twoSum')([2, 7], 9))"]
    checks = plan_checks(tests)
    assert checks.sandbox_units == ["__leaves(0, [lambda: __entry__('twoSum')([2, 7], 9)])"]
    apps = {"fn_name": "f", "inputs": [[1]], "outputs": [[2]]}  # APPS wraps the result
    assert "__c == [2] or __c == 2" in parse(apps).units[0]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("cases", "message"),
    [
        ({"inputs": ["1"], "outputs": []}, "same length"),
        ({"asserts": ["assert all(f(x) for x in range(3))"]}, "comprehension or lambda"),
        ({"asserts": ["import os\nassert f() == os.sep"]}, "does not run"),
        ({"asserts": ["for x in f():\n    assert x"]}, "loop or if header"),
        ({"asserts": ["try:\n    f()\nexcept ValueError:\n    pass"]}, "Try"),
        ({"asserts": ["f.cache = {}", "assert f(1) == 1"]}, "candidate's objects"),
        ({"test": "def nope(c):\n    pass", "entry_point": "f"}, "def check"),
        ({"func_name": "f", "cases": [{"input": "x", "output": "1", "testtype": "functional"}]},
         "JSON lines"),
        ("not json", "not JSON"),
        ([{"input": "1", "output": "1", "testtype": "functional"}], "func_name"),
    ],
)  # fmt: skip
def test_rows_the_reward_cannot_judge_are_errors_that_say_why(cases, message):
    with pytest.raises(ValueError, match=message):
        raw = cases if isinstance(cases, str) else json.dumps(cases)
        plan_checks(parse_test_cases(raw, None))


def test_test_cases_in_extra_info_win_over_ground_truth():
    extra = {"test_cases": {"asserts": ["assert f() == 1"]}}
    assert parse_test_cases("garbage", extra) == ProgramTests(units=["assert f() == 1"])


def test_an_assert_on_a_bare_call_claims_only_its_truth():
    """`assert check(x)` (MBPP's regex problems return a re.Match): the sandbox claims
    `bool(...)`, the judge tests that."""
    checks = plan_checks(ProgramTests(units=["assert f('a')", "assert not f('b')"]))
    assert checks.sandbox_units == [
        "__leaves(0, [lambda: bool(f('a'))])",
        "__leaves(1, [lambda: bool(f('b'))])",
    ]
    assert checks.judge_units[1] == "__check(1, lambda __r: not __r[0], True)"


def test_what_only_the_judge_needs_is_not_sent_and_what_a_leaf_needs_is():
    """An assignment no leaf or header needs (`hidden`) is skipped in the sandbox but run by the
    judge; one that a trusted loop or a leaf reads (`base`, `shown`) is kept."""
    tests = ProgramTests(
        setup=["base = 5", "shown = 7"],
        units=[
            "for i in range(2):\n    total = base + i",
            "hidden = base * 2",
            "assert f(total) == hidden",
            "assert f(shown) == 1",
        ],
    )
    checks = plan_checks(tests)
    sandbox = "\n".join(checks.sandbox_units)
    assert "hidden" not in sandbox
    assert "base = 5" in sandbox and "shown = 7" in sandbox and "total = base + i" in sandbox
    assert "hidden = base * 2" in "\n".join(checks.judge_units)
