"""Red team: every attack runs through both doors model code has, the python tool and the code
reward, in the one bubblewrap sandbox a server shares between them.

Each attack is a program that tries something and sets RESULT to "BREACHED" if any attempt
worked (DETAIL says which). Through the tool the program prints RESULT; through the reward it
is the candidate of a problem whose only passing answer is `leak() == "BREACHED"`, so a breach
would score 1. Besides the program's own report, the host checks what it can: nothing written,
the server and a bystander untouched, the run's memory under its limit, nothing of the run
alive afterwards, nothing left for the next run.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from rollout_servers.agents.python_tool import PythonTool
from rollout_servers.rewards.computer import RewardComputer
from rollout_servers.sandbox import SandboxConfig, SharedSandbox

pytestmark = pytest.mark.integration

LIMITS = dict(wall_timeout_s=8.0, cpu_seconds=6.0, memory_mb=256, max_processes=24)
SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
    },
}
LEAK_CASE = {"test_cases": {"asserts": ["assert leak() == 'BREACHED'"]}}
TOKEN = secrets.token_hex(6)
SECRET = f"asyncrl-secret-{TOKEN}"
HOST_DIRS = ("/root", "/var/lib", "/opt")


@pytest.fixture(scope="module")
def shared() -> Iterator[SharedSandbox]:
    sandbox = SharedSandbox(SandboxConfig(**LIMITS, max_concurrent=2))
    assert sandbox.get().backend == "bwrap"
    yield sandbox
    sandbox.close()


@pytest.fixture(scope="module")
def one_slot() -> Iterator[SharedSandbox]:
    """One slot: consecutive runs share the slot's uid (the strongest case for leftovers)."""
    sandbox = SharedSandbox(SandboxConfig(**LIMITS, max_concurrent=1))
    yield sandbox
    sandbox.close()


async def tool_run(shared: SharedSandbox, program: str) -> tuple[str, dict[str, float]]:
    tool = PythonTool(SCHEMA, max_output_chars=4000, sandbox=shared.get())
    response = await tool.execute("red-team", {"code": program + "\nprint(RESULT, DETAIL)"})
    return response.text, response.metrics


async def reward_run(shared: SharedSandbox, program: str) -> tuple[float, dict[str, float]]:
    rc = RewardComputer(30.0, num_workers=1, sandbox=shared)
    try:
        candidate = f"```python\n{program}\ndef leak():\n    return RESULT\n```"
        return await rc.score("code", candidate, "", LEAK_CASE)
    finally:
        rc.close()


def via_tool(shared: SharedSandbox, program: str) -> tuple[str, dict[str, float]]:
    return asyncio.run(tool_run(shared, program))


def via_reward(shared: SharedSandbox, program: str) -> tuple[float, dict[str, float]]:
    return asyncio.run(reward_run(shared, program))


def attack_both(shared: SharedSandbox, program: str) -> dict[str, float]:
    """Run `program` through both doors; both must report no breach. Returns the tool's metrics."""
    text, metrics = via_tool(shared, program)
    assert "BREACHED" not in text, text
    score, _ = via_reward(shared, program)
    assert score == 0.0
    assert not leftovers(shared), leftovers(shared)
    return metrics


def leftovers(shared: SharedSandbox) -> list[int]:
    """Live processes of the sandbox's uids (every process a run starts runs as one)."""
    uids = set(shared.get().uids)
    found = []
    for proc in psutil.process_iter(["uids", "status"]):
        try:
            if proc.info["uids"].real in uids and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, TypeError):
            continue
    return found


PRELUDE = 'RESULT, DETAIL = "contained", ""\ndef breach(what):\n    global RESULT, DETAIL\n    RESULT, DETAIL = "BREACHED", DETAIL + " " + what\n'


def test_writing_outside_the_sandbox_interpreter_included(shared):
    targets = [f"{d}/asyncrl-pwn-{TOKEN}" for d in ("/usr", "/etc", "/", *HOST_DIRS)]
    import site
    import sys

    targets += [f"{sys.prefix}/asyncrl-pwn-{TOKEN}", f"{Path(__file__).parent}/pwn-{TOKEN}"]
    targets += [f"{d}/asyncrl-pwn-{TOKEN}" for d in site.getsitepackages()]
    program = PRELUDE + (
        f"for t in {targets!r}:\n    try:\n        open(t, 'w').write('x')\n        breach(t)\n"
        "    except OSError:\n        pass\n"
    )
    attack_both(shared, program)
    assert [t for t in targets if os.path.exists(t)] == []


def test_reading_host_files_and_the_servers_proc(shared, monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCRL_TEST_SECRET", SECRET)  # in the server's environment
    canaries = [Path(d) / f"asyncrl-canary-{TOKEN}" for d in HOST_DIRS if os.path.isdir(d)]
    for canary in canaries:
        canary.write_text(SECRET)
    try:
        paths = [str(c) for c in canaries] + [f"/proc/{os.getpid()}/environ", "/proc/1/environ"]
        program = PRELUDE + (
            "import os\n"
            f"paths = {paths!r} + ['/proc/%s/%s' % (p, f) for p in os.listdir('/proc') "
            "if p.isdigit() for f in ('environ', 'cmdline')]\n"
            "for path in paths:\n    try:\n"
            f"        if {SECRET.encode()!r} in open(path, 'rb').read():\n            breach(path)\n"
            "    except OSError:\n        pass\n"
        )
        attack_both(shared, program)
    finally:
        for canary in canaries:
            canary.unlink()


def test_ptrace_and_signals_cannot_reach_the_server_or_a_bystander(shared):
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        pids = [os.getpid(), bystander.pid]
        program = PRELUDE + (
            "import ctypes, os, signal\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"for pid in {pids!r}:\n"
            "    if libc.ptrace(16, pid, 0, 0) == 0:\n        breach('ptrace %d' % pid)\n"
            "    for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL):\n"
            "        try:\n            os.kill(pid, sig)\n            breach('kill %d' % pid)\n"
            "        except OSError:\n            pass\n"
            "try:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n"
        )
        attack_both(shared, program)
        assert bystander.poll() is None
        status = Path(f"/proc/{os.getpid()}/status").read_text()
        assert "TracerPid:\t0" in status
    finally:
        bystander.kill()
        bystander.wait()


def test_no_way_to_root_no_setuid_no_capabilities(shared):
    program = PRELUDE + (
        "import os, subprocess\n"
        "for name, call in (('setuid', lambda: os.setuid(0)), ('setgid', lambda: os.setgid(0)),\n"
        "                   ('seteuid', lambda: os.seteuid(0))):\n"
        "    try:\n        call()\n        breach(name)\n    except OSError:\n        pass\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())\n"
        "if int(status['CapEff'].strip(), 16) or int(status['CapPrm'].strip(), 16):\n"
        "    breach('capabilities ' + status['CapEff'].strip())\n"
        "if status['NoNewPrivs'].strip() != '1':\n    breach('setuid binaries would work')\n"
        "if os.getuid() == 0 or os.geteuid() == 0:\n    breach('runs as root')\n"
        "try:\n"
        "    out = subprocess.run(['/usr/bin/newgrp'], input=b'id -u', capture_output=True)\n"
        "    if out.stdout.strip() == b'0':\n        breach('setuid newgrp gave root')\n"
        "except OSError:\n    pass\n"
    )
    attack_both(shared, program)


def test_fork_bomb_is_contained(shared):
    program = PRELUDE + (
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        n += 1\nexcept OSError:\n"
        f"    pass\nif n >= {LIMITS['max_processes']}:\n    breach('forked %d' % n)\n"
    )
    attack_both(shared, program)


def test_memory_spread_over_processes_stays_under_the_runs_limit(shared):
    program = PRELUDE + (
        "import os, time\nfor i in range(8):\n    if os.fork() == 0:\n        hoard = []\n"
        "        try:\n            while True:\n                hoard.append(bytearray(16 << 20))\n"
        "        except MemoryError:\n            time.sleep(20)\n        os._exit(0)\n"
        "time.sleep(3)\n"
    )
    metrics = attack_both(shared, program)
    assert metrics.get("status_oom") == 1.0, metrics
    assert metrics["peak_memory_mb"] <= LIMITS["memory_mb"] + 1, metrics


def test_a_gigabyte_of_output_is_cut_and_killed(shared):
    program = PRELUDE + (
        "import os\nchunk = b'x' * (1 << 20)\nfor _ in range(1024):\n"
        "    for fd in range(1, 16):\n        try:\n            os.write(fd, chunk)\n"
        "        except OSError:\n            pass\n"
    )
    server = psutil.Process()
    before = server.memory_info().rss
    text, metrics = via_tool(shared, program)
    assert metrics.get("status_killed") == 1.0 and len(text) < 10_000
    score, extras = via_reward(shared, program)
    assert score == 0.0 and extras.get("sandbox_killed") == 1.0
    assert server.memory_info().rss - before < 64 << 20  # the server kept only the heads
    assert not leftovers(shared)


def test_thousands_of_open_files_are_refused(shared):
    program = PRELUDE + (
        "import os\nfds = []\ntry:\n    for _ in range(5000):\n"
        "        fds.append(os.open('/dev/null', os.O_RDONLY))\nexcept OSError:\n    pass\n"
        "if len(fds) > 100:\n    breach('%d descriptors' % len(fds))\n"
    )
    attack_both(shared, program)


def test_a_double_forked_daemon_does_not_outlive_the_run(shared):
    program = PRELUDE + (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(300)\n    os._exit(0)\ntime.sleep(0.2)\n"
    )
    attack_both(shared, program)  # asserts no process of the sandbox's uids is left


def test_abstract_unix_sockets_do_not_cross_runs_or_reach_the_host(shared):
    name = f"\0asyncrl-abstract-{TOKEN}"
    server = PRELUDE + (
        f"import socket, time\ns = socket.socket(socket.AF_UNIX)\ns.bind({name!r})\n"
        "s.listen(1)\ntime.sleep(2.5)\n"
    )
    client = PRELUDE + (
        "import socket, time\ntime.sleep(1.0)\ns = socket.socket(socket.AF_UNIX)\n"
        f"try:\n    s.connect({name!r})\n    breach('connected')\nexcept OSError:\n    pass\n"
    )

    async def both(run):
        return await asyncio.gather(run(shared, server), run(shared, client))

    for run in (tool_run, reward_run):
        _, second = asyncio.run(both(run))
        assert "BREACHED" not in str(second[0]) and second[0] != 1.0
    host = socket.socket(socket.AF_UNIX)
    with pytest.raises(OSError):
        host.connect(name)
    host.close()


LEAVE = (
    "import ctypes, os, socket, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "for path in ('/tmp/leak', '/dev/shm/leak', os.path.expanduser('~/leak')):\n"
    "    try:\n        open(path, 'w').write('left')\n    except OSError:\n        pass\n"
    "shm = libc.shmget(0x5EED, 4096, 0o1666)\n"
    "if shm >= 0:\n    libc.shmat.restype = ctypes.c_void_p\n"
    "    ctypes.memmove(libc.shmat(shm, None, 0), b'left', 4)\n"
    "libc.syscall(248, b'user', b'asyncrl-leak', b'left', 4, ctypes.c_long(-4))\n"
    "RESULT, DETAIL = 'contained', ''\n"
)
FIND = PRELUDE + (
    "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "for path in ('/tmp/leak', '/dev/shm/leak', os.path.expanduser('~/leak')):\n"
    "    if os.path.exists(path):\n        breach(path)\n"
    "if libc.shmget(0x5EED, 0, 0) >= 0:\n    breach('sysv shm')\n"
    "if libc.syscall(250, 10, ctypes.c_long(-4), b'user', b'asyncrl-leak', 0) >= 0:\n"
    "    breach('keyring')\n"
)


def test_nothing_is_left_for_the_next_run_on_the_same_slot(one_slot):
    for run in (via_tool, via_reward):
        run(one_slot, LEAVE)
        text_or_score = run(one_slot, FIND)[0]
        assert "BREACHED" not in str(text_or_score) and text_or_score != 1.0


def test_after_all_this_the_sandbox_still_serves_honest_code(shared):
    text, metrics = via_tool(shared, PRELUDE)
    assert text.startswith("status: ok") and "contained" in text
    candidate = "```python\ndef add(a, b):\n    return a + b\n```"

    async def go():
        rc = RewardComputer(30.0, num_workers=1, sandbox=shared)
        try:
            cases = {"test_cases": {"asserts": ["assert add(2, 3) == 5"]}}
            return await rc.score("code", candidate, "", cases)
        finally:
            rc.close()

    assert asyncio.run(go())[0] == 1.0
    time.sleep(0.1)
    assert not leftovers(shared)
