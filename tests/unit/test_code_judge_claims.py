"""The judge against claims that used to mislead it: a stale value after a failed step, line
separators inside values, huge ints, deep nesting; and the judge child's isolation from the
reward worker (its descriptors, the processes dataset code could fork)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from rollout_servers.rewards.code import judge as code_judge
from rollout_servers.rewards.code.formats import IoTests, ProgramTests
from rollout_servers.rewards.code.harness import HARNESS, harness_stdin
from rollout_servers.rewards.code.judge import judge
from rollout_servers.rewards.code.plan import plan_checks


def checks_of(tests) -> dict:
    return dataclasses.asdict(plan_checks(tests))


def claims(*items: dict) -> str:
    return "\n".join(json.dumps(i, ensure_ascii=False) for i in items)


def harness_claims(code: str, tests: ProgramTests) -> str:
    """What the real harness claims for `code` (run here, without a sandbox: trusted input)."""
    job = harness_stdin(
        code, plan_checks(tests), case_timeout_s=5.0, max_output=1 << 20, max_value=4 << 20, seed=0
    )
    run = subprocess.run([sys.executable, "-c", HARNESS], input=job, capture_output=True, text=True)
    return run.stdout


STALE = ProgramTests(
    units=["r = solve(3)", "assert r % 2 == 0", "r = solve(99)", "assert r % 2 == 0"]
)


def test_a_step_whose_claim_failed_fails_every_case_after_it():
    checks = checks_of(STALE)
    first = {"u": 0, "v": [6]}
    verdict = judge(checks, claims(first, {"u": 2, "e": "ValueError"}))
    assert verdict == {"score": 0.0, "passed": 1.0, "total": 2.0}  # not the old r = 6
    verdict = judge(checks, claims(first))  # no claim at all
    assert verdict["passed"] == 1.0
    truncated = judge(checks, claims(first, {"u": 2, "e": "truncated"}))
    assert truncated["passed"] == 1.0 and truncated["truncated"] == 1.0
    both = claims(first, {"u": 2, "v": [8]})
    assert judge(checks, both)["score"] == 1.0


def test_a_failed_case_alone_leaves_the_cases_after_it_alone():
    checks = checks_of(ProgramTests(units=["assert f(1) == 2", "assert f(2) == 4"]))
    verdict = judge(checks, claims({"u": 0, "v": [3]}, {"u": 1, "v": [4]}), partial_credit=True)
    assert verdict["score"] == 0.5


def test_line_separators_inside_values_and_outputs_are_not_claim_breaks():
    for text in ("a\x85b", "a\u2028b", "a\u2029b", "a\x1cb"):
        checks = checks_of(ProgramTests(units=[f"assert f() == {text!r}"]))
        assert judge(checks, claims({"u": 0, "v": [text]}))["score"] == 1.0, repr(text)
        io = dataclasses.asdict(plan_checks(IoTests([""], [text])))
        got = claims({"case": 0, "exit": 0, "stdout": text + "\n", "truncated": False})
        assert judge(io, got)["score"] == 1.0, repr(text)


def test_ints_past_4300_digits_are_claimed_and_judged():
    tests = ProgramTests(units=["assert f() == 10 ** 5000"])
    got = harness_claims("def f():\n    return 10 ** 5000", tests)
    assert got.startswith('{"u": 0, "v": [1000') and len(got) > 5000
    assert judge(checks_of(tests), got)["score"] == 1.0


def test_a_value_nested_past_the_limit_is_truncated_not_a_silent_zero():
    units = ["x = []", "for _ in range(31):\n    x = [x]", "assert f() == x"]
    tests = ProgramTests(units=units)
    code = "def f():\n    x = []\n    for _ in range(31):\n        x = [x]\n    return x"
    verdict = judge(checks_of(tests), harness_claims(code, tests))
    assert verdict == {"score": 0.0, "passed": 0.0, "total": 1.0, "truncated": 1.0}


def escaped_checks(*units: str) -> dict:
    """Judge units as if dataset code reached `os` (the planner refuses such code; this is the
    next line of defence), then one case that passes."""
    judge_units = [*units, f"__check({len(units)}, lambda __r: True, False)"]
    return {"mode": "program", "judge_units": judge_units, "cases": [len(units)]}


def test_the_judge_child_holds_no_worker_descriptor(monkeypatch):
    monkeypatch.setattr(code_judge, "JUDGE_MODULES", {*code_judge.JUDGE_MODULES, "os"})
    ours, theirs = socket.socketpair()
    try:
        write = f"import os\nos.write({ours.fileno()}, b'forged')"
        assert judge(escaped_checks(write), "")["score"] == 1.0
        theirs.setblocking(False)
        try:
            got = theirs.recv(100)
        except BlockingIOError:
            got = b""
        assert got == b""
        fds = "import os\nfds = os.listdir('/proc/self/fd')"  # 0-2, the pipe, listdir's own
        checks = {
            "mode": "program",
            "judge_units": [fds, "__check(1, lambda __r: len(fds) <= 5, False)"],
            "cases": [1],
        }
        assert judge(checks, "")["score"] == 1.0
    finally:
        ours.close()
        theirs.close()


def test_a_process_the_judge_forks_dies_with_it(monkeypatch, tmp_path):
    monkeypatch.setattr(code_judge, "JUDGE_MODULES", {*code_judge.JUDGE_MODULES, "os"})
    pid_file = tmp_path / "pid"
    fork = (
        "import os\n"
        "pid = os.fork()\n"
        "_ = pid or os.execv('/bin/sleep', ['sleep', '30'])\n"
        f"os.write(os.open({str(pid_file)!r}, os.O_WRONLY | os.O_CREAT), str(pid).encode())"
    )
    start = time.monotonic()
    assert judge(escaped_checks(fork), "", judge_cpu_s=1.0)["score"] == 1.0
    assert time.monotonic() - start < 2.0  # not the 4 s deadline: the forked one holds the pipe
    pid = int(pid_file.read_text())
    for _ in range(100):  # killed: gone, or a zombie where nothing reaps orphans
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or stat.read_text().split()[2] == "Z":
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        raise AssertionError("the judge's grandchild outlived it")
