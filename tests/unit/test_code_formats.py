"""The code reward's dataset formats and its plan (what the sandbox gets, what only the judge
sees), without running anything (tests/integration/test_code_formats_e2e.py runs them)."""

from __future__ import annotations

import json

import pytest

from rollout_servers.rewards.code.formats import IoTests, ProgramTests, parse_test_cases
from rollout_servers.rewards.code.plan import plan_checks

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


@pytest.mark.parametrize(
    "setup",
    [
        ["want = []", "for i in range(6):\n    want.append(i * i % 11)"],  # built in a loop
        ["want = 'hello'.title().swapcase()"],  # a method call
        ["want = 0", "for i in range(9):\n    want += i * i % 7"],  # augmented
    ],
)
def test_an_expected_value_however_built_stays_with_the_judge(setup):
    """Red team: each of these left `want` in the candidate's globals, where `return want`
    scored without solving anything."""
    checks = plan_checks(ProgramTests(units=["assert f(6) == want"], setup=setup))
    assert "want" not in "\n".join(checks.sandbox_units)
    assert all(line in "\n".join(checks.judge_units) for line in setup[:1])


@pytest.mark.parametrize(
    "tests, named",
    [
        (ProgramTests(units=["for x, y in [(1, 2), (5, 10)]:\n    assert double(x) == y"]), "y"),
        (
            ProgramTests(
                units=[
                    "for _ in range(3):\n    s = str(_) * 3\n    e = enc(s)\n    assert f(e) == s"
                ],
                setup=["def enc(s):\n    return s[::-1]"],
            ),
            "s",
        ),  # HumanEval/38 and /50's shape: the input is built from the answer
    ],
)
def test_an_answer_the_sandbox_must_hold_is_a_dataset_error(tests, named):
    with pytest.raises(ValueError, match=f"compares with {named!r}"):
        plan_checks(tests)


def test_inputs_handed_to_the_candidate_may_be_compared_with():
    """HumanEval/44, /53 and /32: the candidate is given x (or a copy of it) anyway."""
    plan_checks(ProgramTests(units=["for x in range(2, 8):\n    assert f(x, x + 1) == str(x)"]))
    coeffs = [
        "coeffs = [1, 2]",
        "solution = f(copy.deepcopy(coeffs))",
        "assert g(coeffs, solution)",
    ]
    checks = plan_checks(ProgramTests(units=coeffs, setup=["def g(c, s):\n    return True"]))
    assert checks.cases == [checks.judge_units.index(checks.judge_units[-1])]


def test_test_code_may_not_reach_through_private_attributes():
    """Red team: `random._os.system(...)` in a row's tests ran as the reward worker."""
    with pytest.raises(ValueError, match="private attribute '_os'"):
        plan_checks(ProgramTests(units=["random._os.system('true')", "assert f(1) == 1"]))


def test_an_assert_that_reads_nothing_of_the_candidate_is_no_case():
    """HumanEval's `assert True, 'debug'` lines were free cases under partial credit; a row
    whose asserts all use builtins only (the candidate never called) is a dataset error."""
    checks = plan_checks(ProgramTests(units=["assert f(1) == 2", "assert True, 'dbg'"]))
    assert len(checks.cases) == 1
    with pytest.raises(ValueError, match="no assert uses the candidate's code"):
        plan_checks(ProgramTests(units=["assert sorted([3, 1]) == [1, 3]"]))


def test_an_entry_point_named_like_a_builtin_is_the_candidates():
    """MBPP/HumanEval rows name their function; `sum` there is the candidate's, not the
    builtin that would pass its asserts without any code."""
    row = {"test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n",
           "entry_point": "sum", "prompt": ""}  # fmt: skip
    checks = plan_checks(parse_test_cases(json.dumps(row), None))
    assert "sum([1, 2])" in "\n".join(checks.sandbox_units)


def test_an_answer_encoded_inline_in_the_call_is_exposed_too():
    """`f(encode(s))` hands `f` the encoding, not `s`: still a dataset error."""
    tests = ProgramTests(
        units=["for i in range(3):\n    s = str(i) * 3\n    assert f(enc(s)) == s"],
        setup=["def enc(s):\n    return s[::-1]"],
    )
    with pytest.raises(ValueError, match="compares with 's'"):
        plan_checks(tests)
