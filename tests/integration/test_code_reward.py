"""The code reward end to end: the real sandbox (bubblewrap), the harness and the trusted judge,
through `RewardComputer` as a rollout server calls it.

- both test-case formats, partial credit, the time limits, malformed cases;
- the reward-hack suite: a wrong solution plus each hack scores 0, the right one 1;
- correctness: every reference solution of `code_problems` scores 1, each planted bug 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import textwrap
import time
from collections.abc import Iterator

import pytest
from code_problems import PROBLEMS  # tests/integration/ is on sys.path (pytest rootdir mode)

from rollout_servers.rewards.code.formats import ProgramTests
from rollout_servers.rewards.code.judge import judge
from rollout_servers.rewards.code.plan import plan_checks
from rollout_servers.rewards.code.reward import extract_code
from rollout_servers.rewards.computer import RewardComputer
from rollout_servers.sandbox import SandboxConfig, SharedSandbox

pytestmark = pytest.mark.integration

IO = json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})
ADD = {"test_cases": {"asserts": ["assert add(1, 2) == 3", "assert add(2, 5) == 7"]}}
WRONG_ADD = "def add(a, b):\n    return 3"  # right for the first case only
RIGHT_ADD = "def add(a, b):\n    return a + b"


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{textwrap.dedent(code).strip()}\n```\n"


@pytest.fixture(scope="module")
def shared() -> Iterator[SharedSandbox]:
    sandbox = SharedSandbox(SandboxConfig(wall_timeout_s=10.0, memory_mb=512, max_concurrent=4))
    assert sandbox.get().backend == "bwrap"
    yield sandbox
    sandbox.close()


def score(shared: SharedSandbox, solution: str, ground_truth: str, extra=None, **kwargs):
    """(score, extras, failures) of one response, through a fresh RewardComputer."""

    async def go():
        rc = RewardComputer(20.0, num_workers=1, reward_kwargs=kwargs, sandbox=shared)
        try:
            got = await rc.score("code", solution, ground_truth, extra)
            return (*got, dict(rc.failures))
        finally:
            rc.close()

    return asyncio.run(go())


# ---- formats and limits ------------------------------------------------------------------------
def test_stdin_stdout_cases_all_or_nothing_and_partial(shared):
    good = fenced("a, b = map(int, input().split())\nprint(a + b)")
    half = fenced("a, b = map(int, input().split())\nprint(3)")
    s, extras, failures = score(shared, good, IO)
    assert (s, extras["passed"], extras["sandbox_ok"], failures) == (1.0, 2.0, 1.0, {})
    s, extras, failures = score(shared, half, IO)
    assert (s, extras["passed"], extras["total"], failures) == (0.0, 1.0, 2.0, {})
    assert score(shared, half, IO, partial_credit=True)[0] == 0.5
    assert score(shared, fenced("import sys\nsys.exit(1)"), IO)[0] == 0.0


def test_asserts_from_extra_info_and_from_ground_truth(shared):
    assert score(shared, fenced(RIGHT_ADD), "", ADD)[0] == 1.0
    assert score(shared, fenced(RIGHT_ADD), json.dumps(ADD["test_cases"]))[0] == 1.0
    s, extras, _ = score(shared, fenced(WRONG_ADD), "", ADD, partial_credit=True)
    assert (s, extras["passed"]) == (0.5, 1.0)


def test_no_code_scores_zero_without_running_anything(shared):
    s, extras, failures = score(shared, "I think the answer is 3.", IO)
    assert (s, extras, failures) == (0.0, {"passed": 0.0, "total": 2.0, "no_code": 1.0}, {})


def test_malformed_cases_are_counted_as_the_datasets_error(shared):
    bad = json.dumps({"inputs": ["1"], "outputs": []})
    assert score(shared, fenced("print(1)"), bad) == (0.0, {}, {"exception": 1})
    comprehension = {"test_cases": {"asserts": ["assert all(f(x) for x in range(3))"]}}
    assert score(shared, fenced("def f(x): return 1"), "", comprehension)[2] == {"exception": 1}


@pytest.mark.parametrize("body", ["import time\ntime.sleep(60)", "while True:\n    pass"])
def test_a_hanging_case_fails_within_its_limit_and_the_others_still_count(shared, body):
    program = (
        f"def add(a, b):\n    if a == 1:\n{textwrap.indent(body, '        ')}\n    return a + b"
    )
    start = time.monotonic()
    s, extras, _ = score(shared, fenced(program), "", ADD, partial_credit=True, case_timeout_s=0.5)
    assert (s, extras["passed"]) == (0.5, 1.0)
    assert time.monotonic() - start < 5.0


def test_the_whole_run_stops_at_max_total_s(shared):
    cases = json.dumps({"inputs": [""] * 10, "outputs": ["x"] * 10})
    start = time.monotonic()
    result = score(shared, fenced("while True: pass"), cases, case_timeout_s=1.0, max_total_s=1.5)
    assert result[0] == 0.0 and time.monotonic() - start < 5.0


def test_one_sandbox_run_per_sample_whatever_the_number_of_cases(shared):
    cases = {"test_cases": {"asserts": [f"assert add({i}, 1) == {i + 1}" for i in range(10)]}}
    sandbox = shared.get()
    before = _runs(sandbox)
    assert score(shared, fenced(RIGHT_ADD), "", cases)[0] == 1.0
    assert _runs(sandbox) == before + 1


def _runs(sandbox) -> int:
    return sandbox.runs_started


def test_extract_code_takes_the_last_python_block():
    assert extract_code("```py\nA\n```\n```python\nB\n```\n```\nC\n```") == "B\n"
    assert extract_code("```\nC\n```") == "C\n"
    assert extract_code("no code") is None


def test_the_judge_alone_by_hand():
    """What the sandbox reports are claims; the judge compares them with what only it knows."""
    tests = ProgramTests(units=["assert sorted(f(3)) == [1, 2, 3]", "assert g() is None"])
    checks = plan_checks(tests)
    assert checks.sandbox_units == ["__leaves(0, [lambda: f(3)])", "__leaves(1, [lambda: g()])"]
    assert checks.judge_units == [
        "__check(0, lambda __r: sorted(__r[0]) == [1, 2, 3], True)",
        "__check(1, lambda __r: __r[0] is None, True)",
    ]
    claims = '{"u": 0, "v": [{"t": [3, 1, 2]}]}\n{"u": 1, "v": [null]}'
    assert judge(dataclasses.asdict(checks), claims)["passed"] == 2.0
    forged = '{"u": 0, "v": ["anything"]}\n{"u": 1, "e": "X"}'
    assert judge(dataclasses.asdict(checks), forged) == {"score": 0.0, "passed": 0.0, "total": 2.0}


# ---- reward hacks: a wrong solution scores 0 whatever it adds ----------------------------------
HACKS = {
    "sys.exit(0) at the end": f"{WRONG_ADD}\nimport sys\nsys.exit(0)",
    "os._exit(0) at the end": f"{WRONG_ADD}\nimport os\nos._exit(0)",
    "atexit handler exits 0": f"{WRONG_ADD}\nimport atexit, os\natexit.register(lambda: os._exit(0))",
    "sys.exit(0) inside the function": "def add(a, b):\n    import sys\n    sys.exit(0)",
    "fake success lines": f"{WRONG_ADD}\nprint('All tests passed!')\nprint('OK')\nprint('3\\n7')",
    "fake claims on every descriptor": WRONG_ADD
    + "\nimport json, os\nfor fd in range(64):\n    for c in range(4):\n        try:\n"
    "            os.write(fd, (json.dumps({'case': c, 'leaf': 0, 'value': 7}) + '\\n').encode())\n"
    "        except OSError:\n            pass",
    "object equal to anything": "class Any:\n    def __eq__(self, other): return True\n"
    "    def __ne__(self, other): return False\n    __hash__ = object.__hash__\n"
    "    def __repr__(self): return '3'\ndef add(a, b):\n    return Any()",
    "int subclass equal to anything": "class I(int):\n    def __eq__(self, other): return True\n"
    "    __hash__ = int.__hash__\ndef add(a, b):\n    return I(0)",
    "patching the harness's reporting": WRONG_ADD
    + "\nimport sys\nm = sys.modules['__main__']\nm.__dict__['claim'] = lambda **k: None",
    "disabling asserts and AssertionError": WRONG_ADD
    + "\nimport builtins\nbuiltins.AssertionError = type('Never', (Exception,), {})",
    "killing its parent": WRONG_ADD + "\nimport os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "looking for the expected values": "import json, re, sys\n"
    "seen = json.dumps(sys.modules['__main__'].__dict__.get('job', {}))\n"
    "for path in ('/proc/1/cmdline', '/proc/1/environ', '/proc/self/environ'):\n"
    "    try:\n        seen += open(path, 'rb').read().decode(errors='replace')\n"
    "    except OSError:\n        pass\n"
    "found = re.findall(r'== *(\\d+)', seen)\n"
    "def add(a, b):\n    return int(found.pop(0)) if found else -1",
    "an exception that prints success": f"{WRONG_ADD}\nraise SystemExit('tests passed')",
}


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_a_wrong_solution_with_a_hack_scores_zero(shared, hack):
    assert score(shared, fenced(HACKS[hack]), "", ADD)[0] == 0.0


@pytest.mark.parametrize(
    "hack",
    [
        "import sys\nprint('3')\nprint('7')\nsys.exit(0)",
        "import os\nos.write(1, b'3\\n7\\n')\nos._exit(0)",
        "import atexit\natexit.register(lambda: print('3\\n7'))",
    ],
)
def test_stdio_hacks_score_zero(shared, hack):
    assert score(shared, fenced(hack), IO)[0] == 0.0


def test_the_right_solution_scores_one(shared):
    assert score(shared, fenced(RIGHT_ADD), "", ADD)[0] == 1.0


# ---- correct code passes, a planted bug fails --------------------------------------------------
@pytest.mark.parametrize("problem", PROBLEMS, ids=[p.name for p in PROBLEMS])
def test_reference_solutions_pass_and_planted_bugs_fail(shared, problem):
    cases = {"test_cases": {"asserts": problem.asserts}}
    assert score(shared, fenced(problem.solution), "", cases)[0] == 1.0
    assert score(shared, fenced(problem.buggy), "", cases)[0] == 0.0


# ---- no silent fallback ------------------------------------------------------------------------
def _no_bwrap(monkeypatch):
    import shutil

    from rollout_servers.sandbox import backends

    real = shutil.which
    monkeypatch.setattr(
        backends.shutil, "which", lambda name: None if name == "bwrap" else real(name)
    )


def test_a_server_whose_backend_is_missing_fails_at_start_up_naming_the_install(
    monkeypatch, tmp_path
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from asyncrl.config import load_config
    from rollout_servers.factories import sandboxed_sources, setup_sandbox

    rows = [{"data_source": "code", "prompt": [{"role": "user", "content": "q"}],
             "reward_model": {"ground_truth": "{}", "style": "rule"}}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "code.parquet")
    cfg = load_config(None, [f"data.train_files=[{tmp_path / 'code.parquet'}]"])
    assert sandboxed_sources(cfg) == ["code"]
    _no_bwrap(monkeypatch)
    with pytest.raises(
        RuntimeError, match=r"'bwrap' does not work here.*apt-get install -y bubblewrap"
    ):
        setup_sandbox(cfg)
    # without code in its data the server starts; the first code reward then fails loudly
    plain = load_config(None, [])
    shared = setup_sandbox(plain)
    score_, extras, failures = score(shared, fenced(RIGHT_ADD), "", ADD)
    assert (score_, failures) == (0.0, {"sandbox_unavailable": 1})


def test_a_weaker_backend_runs_only_when_named_and_says_so_at_start_up(caplog):
    import logging

    from asyncrl.config import load_config
    from rollout_servers.factories import setup_sandbox

    assert load_config(None, []).rollout.sandbox.backend == "bwrap"  # the default
    caplog.set_level(logging.WARNING)
    shared = setup_sandbox(load_config(None, ["rollout.sandbox.backend=unshare"]))
    try:
        assert "SANDBOX BACKEND 'unshare' (named in the config): weaker" in caplog.text
        assert shared.get().backend == "unshare"
    finally:
        shared.close()
