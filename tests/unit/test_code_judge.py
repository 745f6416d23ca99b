"""The code reward's trusted judge, fed claims by hand: output comparison, limits that speak,
and the bound on what it evaluates with values the candidate chose."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import pytest

from rollout_servers.rewards.code.formats import IoTests, ProgramTests
from rollout_servers.rewards.code.harness import HARNESS
from rollout_servers.rewards.code.judge import judge, same_output
from rollout_servers.rewards.code.plan import plan_checks
from rollout_servers.rewards.code.values import plain, unplain


def checks_of(tests) -> dict:
    return dataclasses.asdict(plan_checks(tests))


def claims(*items: dict) -> str:
    return "\n".join(json.dumps(i) for i in items)


def test_outputs_compare_by_lines_up_to_trailing_whitespace():
    assert same_output("1 \n2\n\n\n", "1\n2")
    assert not same_output("1\n2\n3", "1\n2")
    assert not same_output("1\n", "1\n2")
    big = "".join(f"{i}\n" for i in range(200_000))  # ~1.3 MB
    assert same_output(big, big.replace("\n", " \n"))
    assert not same_output(big, big[:-2] + "0\n")


def test_io_output_over_its_limit_is_truncated_never_a_silent_zero():
    checks = checks_of(IoTests(["", ""], ["1", "2"]))
    got = claims({"case": 0, "exit": 0, "stdout": "1\n", "truncated": False},
                 {"case": 1, "exit": 0, "stdout": "2", "truncated": True})  # fmt: skip
    verdict = judge(checks, got, partial_credit=True)
    assert verdict == {"score": 0.5, "passed": 1.0, "total": 2.0, "truncated": 1.0}
    assert judge(checks, got.replace("true", "false"))["score"] == 1.0


def test_a_loop_is_judged_execution_by_execution_with_the_same_random_draws():
    tests = ProgramTests(
        units=["for _ in range(3):\n    x = random.randint(0, 99)\n    assert inc(x) == x + 1"],
        setup=["import random"],
    )
    checks = checks_of(tests)
    import random

    random.seed(0)
    draws = [random.randint(0, 99) for _ in range(3)]
    right = claims(*({"u": 1, "v": [x + 1]} for x in draws))
    assert judge(checks, right)["score"] == 1.0
    wrong = claims(*({"u": 1, "v": [x + 1 if i < 2 else x]} for i, x in enumerate(draws)))
    assert judge(checks, wrong)["score"] == 0.0
    assert judge(checks, right + "\n" + claims({"u": 1, "v": [0]}))["score"] == 0.0  # extra
    assert judge(checks, claims({"u": 1, "v": [draws[0] + 1]}))["score"] == 0.0  # missing


def test_a_value_claimed_truncated_fails_its_case_and_says_so():
    checks = checks_of(ProgramTests(units=["assert f() == list(range(20000))"]))
    big = claims({"u": 0, "v": [{"l": list(range(20000))}]})
    assert judge(checks, big)["score"] == 1.0  # 20,000 items: well within the default
    verdict = judge(checks, claims({"u": 0, "e": "truncated"}))
    assert verdict == {"score": 0.0, "passed": 0.0, "total": 1.0, "truncated": 1.0}
    assert judge(checks, big, max_value_bytes=1000)["score"] == 0.0  # forged past the limit


MEMORY_PROBE = """
import dataclasses, json, resource, time
from rollout_servers.rewards.code.formats import ProgramTests
from rollout_servers.rewards.code.judge import judge
from rollout_servers.rewards.code.plan import plan_checks
checks = dataclasses.asdict(plan_checks(ProgramTests(units=[
    'assert "ab" * f(2) == "abab"', "assert g() == 1"])))
claims = json.dumps({"u": 0, "v": [10**10]}) + "\\n" + json.dumps({"u": 1, "v": [1]})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.monotonic()
verdict = judge(checks, claims)
print(json.dumps({
    "verdict": verdict, "seconds": time.monotonic() - start, "before": before,
    "self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
}))
"""


def test_the_judge_is_bounded_in_memory_and_reports_judge_limit():
    # In a fresh interpreter: RUSAGE_CHILDREN is the largest child a process ever waited for,
    # and pytest's own process has run far larger children (launches, engines) by now.
    run = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["verdict"] == {"score": 0.0, "passed": 1.0, "total": 2.0, "judge_limit": 1.0}
    assert got["seconds"] < 5.0
    assert got["self"] - got["before"] < 50_000  # KiB: the judge's memory was the child's
    assert got["children"] < 600_000 + got["before"]  # the forked judge child, bounded
    checks = checks_of(ProgramTests(units=['assert "ab" * f(2) == "abab"', "assert g() == 1"]))
    assert judge(checks, claims({"u": 0, "v": [2]}, {"u": 1, "v": [1]}))["score"] == 1.0


def test_the_judge_is_bounded_in_cpu_and_reports_judge_limit():
    checks = checks_of(ProgramTests(units=["assert pow(3, f(), 10**60 + 7) > -1"]))
    start = time.monotonic()
    verdict = judge(checks, claims({"u": 0, "v": [1]}), judge_cpu_s=1.0)
    assert verdict["score"] == 1.0  # cheap: fine
    checks = checks_of(ProgramTests(units=["assert len(str(10 ** f())) > 0"]))
    verdict = judge(checks, claims({"u": 0, "v": [10**8]}), judge_cpu_s=1.0)
    assert verdict.get("judge_limit") == 1.0 and verdict["score"] == 0.0
    assert time.monotonic() - start < 6.0


@pytest.mark.parametrize(
    "value", [None, True, 3, 2.5, float("inf"), "s", b"\x00", 1j, [1, (2, {3})], {"k": [None]}]
)
def test_plain_values_round_trip_and_the_harness_embeds_the_same_functions(value):
    assert unplain(json.loads(json.dumps(plain(value)))) == value
    assert "def plain(" in HARNESS and "def unplain(" in HARNESS


def test_objects_that_are_not_plain_data_are_refused():
    class Anything:
        def __eq__(self, other):
            return True

    with pytest.raises(TypeError):
        plain(Anything())
    with pytest.raises(ValueError):
        unplain({"x": 1})


def test_the_judges_modules_are_pure_and_its_sys_only_numbers():
    import sys

    size = sys.getsizeof((1, 2))
    checks = checks_of(ProgramTests(units=["assert f() == sys.getsizeof((1, 2))"]))
    assert judge(checks, claims({"u": 1, "v": [size]}))["score"] == 1.0  # unit 0: import sys
    reach = checks_of(ProgramTests(units=["assert f() == len(sys.modules)"]))
    assert judge(reach, claims({"u": 1, "v": [len(sys.modules)]}))["score"] == 0.0
