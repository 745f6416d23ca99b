"""The code reward's dataset formats and limits end to end: the real sandbox (bubblewrap), the
harness and the bounded judge, through `RewardComputer` and through verl's `compute_score`."""

from __future__ import annotations

import asyncio
import json
import os
import resource
from collections.abc import Iterator

import pytest

from rollout_servers.rewards.computer import RewardComputer
from rollout_servers.rewards.functions import REWARD_FNS
from rollout_servers.sandbox import Sandbox, SandboxConfig, SharedSandbox

pytestmark = pytest.mark.integration

HUMANEVAL = {
    "prompt": "def shift(s):\n    return ''.join(chr(ord(c) + 1) for c in s)\n"
    "def unshift(s):\n    '''Undo shift.'''\n",
    "entry_point": "unshift",
    "test": "def check(candidate):\n    import random, string\n"
    "    assert candidate('b') == 'a'\n"
    "    for _ in range(20):\n"
    "        s = ''.join(random.choice(string.ascii_lowercase) for _ in range(8))\n"
    "        assert shift(candidate(s)) == s\n",
}  # not `candidate(shift(s)) == s`: that hands the answer to the sandbox (a dataset error)
UNSHIFT = "def unshift(s):\n    return ''.join(chr(ord(c) - 1) for c in s)"
MBPP = {"test_list": ["assert math.isclose(area(2), 12.566, rel_tol=0.001)",
                      "assert area(0) == 0"], "test_imports": ["import math"]}  # fmt: skip


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


@pytest.fixture(scope="module")
def shared() -> Iterator[SharedSandbox]:
    sandbox = SharedSandbox(SandboxConfig(wall_timeout_s=10.0, memory_mb=512, max_concurrent=2))
    yield sandbox
    sandbox.close()


_COMPUTERS: dict[str, RewardComputer] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_computers() -> Iterator[None]:
    yield
    for rc in _COMPUTERS.values():
        rc.close()
    _COMPUTERS.clear()


def score(shared: SharedSandbox, solution: str, tests, **kwargs):
    """(score, extras, failures, limits) of one response; one RewardComputer per set of
    options for the module (a worker's start is most of a call's time), counters as deltas."""
    key = json.dumps(kwargs, sort_keys=True)
    if key not in _COMPUTERS:
        _COMPUTERS[key] = RewardComputer(20.0, num_workers=1, reward_kwargs=kwargs, sandbox=shared)
    rc = _COMPUTERS[key]
    failures, limits = dict(rc.failures), dict(rc.limits)

    async def go():
        return await rc.score("code", solution, json.dumps(tests), None)

    got = asyncio.run(go())
    new_failures = {
        k: v - failures.get(k, 0) for k, v in rc.failures.items() if v != failures.get(k, 0)
    }
    new_limits = {k: v - limits.get(k, 0) for k, v in rc.limits.items() if v != limits.get(k, 0)}
    return (*got, new_failures, new_limits)


def test_humaneval_native_loops_random_draws_and_trusted_helpers(shared):
    assert score(shared, fenced(UNSHIFT), HUMANEVAL)[0] == 1.0
    assert score(shared, fenced("def unshift(s):\n    return None"), HUMANEVAL)[0] == 0.0
    # redefining the prompt's helper does not help: the judge uses the dataset's own
    hack = "def shift(s):\n    return s\ndef unshift(s):\n    return s"
    assert score(shared, fenced(hack), HUMANEVAL)[0] == 0.0


EXPECTED_IN_SETUP = {
    "prompt": 'def odd_sum(lst):\n    """The sum of the odd numbers."""\n',
    "entry_point": "odd_sum",
    "test": "def check(candidate):\n    lst = list(range(-99, 100, 2))\n"
    "    odd_total = sum([i for i in lst if i % 2 == 1])\n"
    "    assert candidate(lst) == odd_total\n    assert candidate([1, 2]) == 1\n",
}  # HumanEval/151's shape: the expected value computed in a setup statement


def test_an_expected_value_computed_in_setup_never_enters_the_sandbox(shared):
    """A candidate that reads the test's variables from its caller's frames finds nothing to
    copy: the setup statement only the judge needs does not run in the sandbox."""
    peek = (
        "def odd_sum(lst):\n    import sys\n    frame = sys._getframe(1)\n"
        "    while frame is not None:\n"
        "        for scope in (frame.f_locals, frame.f_globals):\n"
        "            if 'odd_total' in scope and scope.get('lst') is lst:\n"
        "                return scope['odd_total']\n"
        "        frame = frame.f_back\n    return 1"
    )
    assert score(shared, fenced(peek), EXPECTED_IN_SETUP)[0] == 0.0
    right = "def odd_sum(lst):\n    return sum(x for x in lst if x % 2)"
    assert score(shared, fenced(right), EXPECTED_IN_SETUP)[0] == 1.0


def test_mbpp_with_its_imports(shared):
    assert score(shared, fenced("import math\ndef area(r):\n    return math.pi * r * r"), MBPP)[0]
    assert score(shared, fenced("def area(r):\n    return 3 * r * r"), MBPP)[0] == 0.0


def test_functional_cases_call_a_leetcode_solution_class(shared):
    lcb = {"func_name": "add", "cases": [
        {"input": "1\n2", "output": "3", "testtype": "functional"},
        {"input": "[1]\n[2]", "output": "[1, 2]", "testtype": "functional"}]}  # fmt: skip
    right = "class Solution:\n    def add(self, a, b):\n        return a + b"
    assert score(shared, fenced(right), lcb)[0] == 1.0
    assert score(shared, fenced(right.replace("a + b", "b + a")), lcb)[0] == 0.0


def test_one_mib_of_expected_output_and_the_limit_past_it(shared):
    lines = 180_000  # "0\n" .. "179999\n": over 1 MiB
    expected = "".join(f"{i}\n" for i in range(lines))
    assert len(expected) > 1 << 20
    tests = {"inputs": [f"{lines}\n"], "outputs": [expected]}
    right = "import sys\nn = int(input())\nsys.stdout.write(''.join(f'{i}\\n' for i in range(n)))"
    s, _, failures, limits = score(shared, fenced(right), tests)
    assert (s, failures, limits) == (1.0, {}, {})
    off_by_one = right.replace("range(n)", "range(1, n + 1)")
    assert score(shared, fenced(off_by_one), tests)[0] == 0.0
    s, extras, failures, limits = score(shared, fenced(right), tests, max_output_bytes=1 << 19)
    assert (s, extras["truncated"], failures, limits) == (0.0, 1.0, {}, {"truncated": 1})


def test_many_cases_of_several_kib_and_a_large_value(shared):
    out = "".join(f"{i}\n" for i in range(1, 1200))  # 5.4 KB per case, 12 cases
    tests = {"inputs": ["1199\n"] * 12, "outputs": [out] * 12}
    program = "n = int(input())\nfor i in range(1, n + 1):\n    print(i)"
    assert score(shared, fenced(program), tests)[0] == 1.0
    big = {"asserts": ["assert f() == list(range(20000))"]}
    assert score(shared, fenced("def f():\n    return list(range(20000))"), big)[0] == 1.0
    s, extras, _, limits = score(shared, fenced("def f():\n    return list(range(20000))"),
                                 big, max_value_bytes=1000)  # fmt: skip
    assert (s, extras["truncated"], limits) == (0.0, 1.0, {"truncated": 1})


def test_the_judge_bound_holds_for_a_value_the_candidate_chose(shared):
    tests = {"asserts": ['assert "ab" * f(2) == "abab"']}
    s, extras, failures, limits = score(shared, fenced("def f(n):\n    return 10**10"), tests)
    assert (s, extras["judge_limit"], failures, limits) == (0.0, 1.0, {}, {"judge_limit": 1})
    assert score(shared, fenced("def f(n):\n    return n"), tests)[0] == 1.0


def test_compute_score_with_verls_signature_runs_its_own_sandbox():
    compute_score = REWARD_FNS["code"]
    tests = json.dumps(MBPP)
    right = fenced("import math\ndef area(r):\n    return math.pi * r * r")
    verdict = compute_score(data_source="mbpp", solution_str=right, ground_truth=tests,
                            extra_info=None)  # fmt: skip
    assert (verdict["score"], verdict["passed"]) == (1.0, 2.0)
    assert compute_score("code", fenced("def area(r):\n    return 0"), tests, None)["score"] == 0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    limited = compute_score("code", fenced("def f(n):\n    return 10**10"),
                            json.dumps({"asserts": ['assert "ab" * f(2) == "abab"']}))  # fmt: skip
    assert (limited["score"], limited["judge_limit"]) == (0.0, 1.0)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB


def test_lock_files_go_when_the_sandbox_closes():
    """As root each slot's uid is claimed with a lock file; not root, there are none."""
    sandbox = Sandbox(SandboxConfig(sandbox_uid_base=1_900_060_000, max_concurrent=2))
    mine = {f"{uid}.lock" for uid in sandbox.uids}
    assert len(mine) == (2 if os.geteuid() == 0 else 0)
    held = set(os.listdir("/run/asyncrl-sandbox")) if mine else set()
    assert mine <= held
    sandbox.close()
    assert not mine & (set(os.listdir("/run/asyncrl-sandbox")) if mine else set())
