"""Red-team tests of the code sandbox: each attack is contained, nothing of it outlives `run`.

Every test runs on each backend where the property it checks is one the backend claims
(docs/sandbox.md): the normal cases and the resource limits on all three, isolation (network,
other processes, fork bombs) on bwrap and unshare only. Every backend must be installed: a missing
one fails with its install command, as a server configured for it would at start-up.
The pure logic (status classification, output capture, config bounds) is tested at the end.
"""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from rollout_servers.sandbox import Backend, Sandbox, SandboxConfig
from rollout_servers.sandbox.output import _Capture, _classify

pytestmark = pytest.mark.integration

ALL: tuple[Backend, ...] = ("bwrap", "unshare", "process")
ISOLATING: tuple[Backend, ...] = ("bwrap", "unshare")
FAST = SandboxConfig(wall_timeout_s=3.0, cpu_seconds=2, memory_mb=256, max_processes=8)
PRELUDE_MARK = b"_sitebuiltins.Quitter"  # in the command line of every sandbox interpreter


def open_sandbox(backend: Backend | str, **overrides: Any) -> Sandbox:
    """A sandbox on `backend`; a missing backend binary fails the test with its install command
    (the README's test command installs bubblewrap; util-linux is on every Debian machine)."""
    return Sandbox(FAST.model_copy(update={"backend": backend, **overrides}))


@pytest.fixture(scope="module", params=ALL)
def sandbox(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    with open_sandbox(request.param) as sb:
        yield sb


@pytest.fixture(scope="module", params=ISOLATING)
def isolating(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    with open_sandbox(request.param) as sb:
        yield sb


def leftovers(sandbox: Sandbox, marker: str = "") -> list[str]:
    """Live processes of the sandbox's finished runs: those of its uids, interpreters of runs
    whose private directory is gone (`process` as root keeps no uid of its own), and any process
    with `marker` in its command line."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            proc = psutil.Process(int(name))
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.cmdline()).encode()
            ours = proc.uids().real in sandbox.uids or (marker and marker.encode() in cmdline)
            if not ours and PRELUDE_MARK in cmdline and sandbox.backend == "process":
                home = proc.environ().get("TMPDIR", "/")
                ours = home.startswith("/tmp/asyncrl-sandbox-") and not os.path.isdir(home)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if ours:
            found.append(f"{name}: {cmdline[:100]!r}")
    return found


def test_a_namespace_backend_runs_here():
    with Sandbox(FAST) as sb:
        assert sb.backend in ISOLATING
        assert sb.limits_processes
        assert sb.run_sync("print(6 * 7)").stdout == "42\n"


async def test_prints_and_exits_ok(sandbox):
    result = await sandbox.run("import sys\nprint('hello')\nprint('warn', file=sys.stderr)")
    assert (result.status, result.exit_code) == ("ok", 0)
    assert (result.stdout, result.stderr) == ("hello\n", "warn\n")
    assert 0 < result.wall_s < FAST.wall_timeout_s
    assert not leftovers(sandbox)


async def test_exception_is_an_error_with_its_traceback(sandbox):
    result = await sandbox.run("def f():\n    return 1 / 0\n\nf()\n")
    assert (result.status, result.exit_code) == ("error", 1)
    assert "line 2, in f\n    return 1 / 0" in result.stderr
    assert result.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in result.stderr  # the prelude's frame is not shown
    assert not leftovers(sandbox)


async def test_stdin_reaches_the_code_and_exit_codes_come_back(sandbox):
    result = await sandbox.run("a, b = map(int, input().split())\nprint(a + b)\nexit(3)", "2 40\n")
    assert (result.status, result.exit_code, result.stdout) == ("error", 3, "42\n")
    assert not leftovers(sandbox)


async def test_os_exit_zero_is_ok(sandbox):
    result = await sandbox.run("import os\nprint('bye', flush=True)\nos._exit(0)")
    assert (result.status, result.exit_code, result.stdout) == ("ok", 0, "bye\n")
    assert not leftovers(sandbox)


async def test_environment_is_empty_of_the_servers(sandbox, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("ASYNCRL_SB_SECRET", secret)
    result = await sandbox.run("import os\nprint(sorted(os.environ))\nprint(dict(os.environ))")
    assert result.status == "ok"
    assert secret not in result.stdout and "ASYNCRL_SB_SECRET" not in result.stdout
    assert not leftovers(sandbox)


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(bytearray(1 << 20))"],
    ids=["one-huge", "growing"],
)
async def test_memory_balloon_is_oom(sandbox, code):
    result = await sandbox.run(code)
    assert (result.status, result.exit_code) == ("oom", 1), result
    assert result.stderr.rstrip().endswith("MemoryError")
    assert not leftovers(sandbox)


async def test_busy_loop_and_sleeper_are_stopped_by_time_limits(sandbox):
    busy, sleeper = (
        "while True:\n    pass",
        "print('start', flush=True)\nimport time\ntime.sleep(60)",
    )
    with open_sandbox(sandbox.backend, cpu_seconds=1, wall_timeout_s=1.0) as sb:
        spun, slept = await asyncio.gather(sb.run(busy), sb.run(sleeper))
        assert (spun.status, spun.exit_code) == ("timeout", None)  # SIGXCPU, or the wall clock
        assert (slept.status, slept.exit_code, slept.stdout) == ("timeout", None, "start\n")
        assert 1.0 <= slept.wall_s < 2.5
        assert not leftovers(sb)


async def test_ten_gigabyte_file_stops_at_the_size_limit(sandbox):
    code = (
        "import os\n"
        "chunk = b'x' * (1 << 20)\n"
        "try:\n"
        "    with open('big', 'wb') as f:\n"
        "        for _ in range(10 * 1024):\n"
        "            f.write(chunk)\n"
        "finally:\n"
        "    print(os.path.getsize('big'))\n"
    )
    result = await sandbox.run(code)
    assert result.status == "error"
    assert "File too large" in result.stderr
    assert result.stdout == f"{sandbox.config.file_size_mb << 20}\n"  # stopped at the limit
    assert not leftovers(sandbox)


async def test_killing_the_parent_leaves_the_server_alive(sandbox):
    result = await sandbox.run("import os\nos.kill(os.getppid(), 9)\nimport time\ntime.sleep(60)")
    assert result.status in ("error", "killed")  # EPERM, or a supervisor died in our place
    assert result.wall_s < FAST.wall_timeout_s
    assert psutil.Process().is_running()
    assert not leftovers(sandbox)


async def test_double_forked_daemon_dies_with_the_run(sandbox, tmp_path):
    """One run exits at once, one times out; each leaves a daemon (fork, setsid, fork, exec)
    that would write a file a second later."""
    marker = f"asyncrl-daemon-{uuid.uuid4().hex}"
    tmp_path.chmod(0o777)

    def program(proof: Path, main_waits: bool) -> str:
        return f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c",
            "import time; time.sleep(1); open({str(proof)!r}, 'w').write('x')", {marker!r}])
    os._exit(0)
time.sleep(0.2)
print("daemon started", flush=True)
if {main_waits}:
    time.sleep(60)
"""

    proofs = [tmp_path / "after-exit", tmp_path / "after-timeout"]
    start = time.monotonic()
    with open_sandbox(sandbox.backend, wall_timeout_s=0.6) as sb:
        exited, timed_out = await asyncio.gather(
            sb.run(program(proofs[0], False)), sb.run(program(proofs[1], True))
        )
        assert (exited.status, exited.stdout) == ("ok", "daemon started\n")
        assert (timed_out.status, timed_out.stdout) == ("timeout", "daemon started\n")
        assert not leftovers(sb, marker)
        await asyncio.sleep(max(0.0, start + 1.5 - time.monotonic()))
        assert not any(proof.exists() for proof in proofs)
        assert not leftovers(sb, marker)


async def test_hundred_megabytes_of_output_is_cut_and_killed(sandbox):
    rss_before = psutil.Process().memory_info().rss
    result = await sandbox.run("import sys\nsys.stdout.write('x' * 100_000_000)\nprint('end')")
    assert result.status == "killed"
    head, marker = result.stdout.rsplit("\n", 1)
    assert head == "x" * sandbox.config.output_limit_bytes
    assert marker.startswith("... [truncated ") and marker.endswith(" bytes]")
    assert "killed after more than" in result.stderr
    assert result.wall_s < 2.5
    assert psutil.Process().memory_info().rss - rss_before < 32 << 20
    assert not leftovers(sandbox)


async def test_output_over_the_limit_is_truncated_when_the_code_finishes(sandbox):
    result = await sandbox.run("print('y' * 1_000_000)")
    assert (result.status, result.exit_code) == ("ok", 0)
    dropped = 1_000_001 - sandbox.config.output_limit_bytes
    assert result.stdout.endswith(f"\n... [truncated {dropped} bytes]")
    assert not leftovers(sandbox)


async def test_no_network_not_even_loopback(isolating):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = f"""
import socket
for address in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
    try:
        socket.create_connection(address, timeout=1).close()
        print("connected", address)
    except OSError as exc:
        print("blocked", address, exc)
"""
        result = await isolating.run(code)
        assert result.status == "ok"
        lines = result.stdout.splitlines()
        assert len(lines) == 2 and all(line.startswith("blocked") for line in lines), lines
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert not leftovers(isolating)


async def test_host_processes_and_their_environment_are_invisible(isolating, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("ASYNCRL_SB_SECRET", secret)
    code = f"""
import os
pids = [p for p in os.listdir("/proc") if p.isdigit()]
needle = ("ASYNCRL_SB_" + "SECRET").encode()
for pid in pids + ["{os.getpid()}", "{os.getppid()}", "1"]:
    try:
        with open(f"/proc/{{pid}}/environ", "rb") as f:
            data = f.read()
    except OSError as exc:
        print(pid, "unreadable", exc.errno)
        continue
    print(pid, "readable", data if needle in data else b"")
print("pids", sorted(pids))
"""
    result = await isolating.run(code)
    assert result.status == "ok"
    assert secret not in result.stdout + result.stderr
    visible = eval(result.stdout.rsplit("pids ", 1)[1])  # noqa: S307 - our own program's output
    assert visible == ["1", "2"]  # the supervisor and the code, nothing of the host
    assert not leftovers(isolating)


async def test_process_limit_binds_per_run(isolating):
    code = """
import os, time
n = 0
try:
    for _ in range(100):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as exc:
    print("refused", exc.errno)
print(n)
"""
    results = await asyncio.gather(isolating.run(code), isolating.run(code))  # one count each
    for result in results:
        assert result.status == "ok"
        assert result.stdout.split() == ["refused", "11", str(FAST.max_processes - 1)]
    assert not leftovers(isolating)


async def test_fork_bomb_is_contained(isolating):
    sb = open_sandbox(isolating.backend, wall_timeout_s=1.0)
    with sb:
        result = await sb.run(
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
        )
        assert (result.status, result.exit_code) == ("timeout", None)
        assert not leftovers(sb)
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


async def test_cancelled_run_leaves_nothing_running(sandbox):
    marker = f"asyncrl-cancel-{uuid.uuid4().hex}"
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])"
    task = asyncio.ensure_future(sandbox.run(code))
    deadline = time.monotonic() + 5
    while not leftovers(sandbox, marker):
        assert time.monotonic() < deadline, "the program never started"
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 2
    while leftovers(sandbox, marker):
        assert time.monotonic() < deadline, leftovers(sandbox, marker)
        await asyncio.sleep(0.02)


async def test_concurrency_never_exceeds_the_pool():
    code = "import time\nstart = time.time()\ntime.sleep(0.3)\nprint(start, time.time())"
    with Sandbox(FAST.model_copy(update={"max_concurrent": 2})) as sb:
        results = await asyncio.gather(*(sb.run(code) for _ in range(8)))
        assert all(r.status == "ok" for r in results)
        spans = [tuple(map(float, r.stdout.split())) for r in results]
        overlap = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
        assert overlap == 2
        assert not leftovers(sb)


def test_the_private_directory_is_removed(tmp_path: Path):
    with open_sandbox("process") as sb:
        result = sb.run_sync("import os\nprint(os.getcwd())\nopen('f', 'w').write('x')")
        assert result.status == "ok"
        assert not os.path.exists(result.stdout.strip())


def test_bwrap_shows_the_system_read_only_and_nothing_else():
    code = f"""
import os, sys
print(os.path.exists({__file__!r}), os.path.exists("/root/.bashrc"), os.path.exists("/etc/passwd"))
for target in [sys.prefix + "/x", "/usr/x", "/x"]:
    try:
        open(target, "w")
        print("wrote", target)
    except OSError as exc:
        print("refused", exc.errno)
open("/tmp/scratch", "w").write("ok")
print(sorted(os.listdir("/")))
"""
    with open_sandbox("bwrap") as sb:
        result = sb.run_sync(code)
        assert result.status == "ok", result
        lines = result.stdout.splitlines()
        assert lines[0] == "False False False"
        assert all(line.startswith("refused") for line in lines[1:4]), lines
        # only the system and the directories the interpreter lives in (a virtualenv under
        # /work or /home puts that top directory there, holding nothing but the interpreter)
        interpreter_tops = {Path(p).parts[1] for p in (sys.prefix, sys.base_prefix, *_sites())}
        system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp"}
        assert set(ast.literal_eval(lines[4])) <= system | {"usr"} | interpreter_tops, lines[4]


def _sites() -> list[str]:
    import site

    return [d for d in site.getsitepackages() if os.path.isdir(d)]


# ---- pure logic ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ending", "returncode", "tail", "expected"),
    [
        ("exited", 0, b"", ("ok", 0)),
        ("exited", 1, b"Traceback...\nZeroDivisionError: division by zero\n", ("error", 1)),
        ("exited", 1, b"  x = bytearray(10**10)\nMemoryError\n", ("oom", 1)),
        ("exited", 1, b"MemoryError: cannot allocate\n", ("oom", 1)),
        ("exited", 2, b"MemoryError\n", ("error", 2)),
        ("exited", 128 + signal.SIGKILL, b"", ("killed", None)),  # bwrap / supervisor style
        ("exited", -signal.SIGSEGV, b"", ("killed", None)),  # a plain child's style
        ("exited", 128 + signal.SIGXCPU, b"", ("timeout", None)),  # RLIMIT_CPU
        ("exited", 200, b"", ("error", 200)),  # above the signal range
        ("timeout", -signal.SIGKILL, b"", ("timeout", None)),
        ("flood", 0, b"", ("killed", None)),
    ],
)
def test_classify(ending, returncode, tail, expected):
    assert _classify(ending, returncode, tail) == expected


async def test_capture_keeps_the_head_counts_the_rest_and_floods_once_over_budget():
    flood = asyncio.Event()
    budget = [25]
    out, err = _Capture(8, budget, flood), _Capture(8, budget, flood)
    out.data_received(b"0123456789")
    err.data_received(b"abc")
    assert (out.text(), err.text()) == ("01234567\n... [truncated 2 bytes]", "abc")
    assert not flood.is_set()
    out.data_received(b"x" * 13)  # 26 bytes in all: one over the shared budget
    assert flood.is_set()
    assert out.text() == "01234567\n... [truncated 15 bytes]"
    assert len(out.head) == 8 and out.tail.endswith(b"x" * 13)


def test_capture_decodes_a_cut_character_leniently():
    capture = _Capture(2, [100], asyncio.Event())
    capture.data_received("é!".encode())
    capture.data_received(b"")
    assert capture.text() == "é\n... [truncated 1 bytes]"


@pytest.mark.parametrize(
    "bad",
    [
        {"wall_timeout_s": 0},
        {"memory_mb": -1},
        {"max_concurrent": 0},
        {"output_limit_bytes": 10, "output_kill_bytes": 5},
        {"backend": "docker"},
    ],
)
def test_config_rejects_out_of_bounds(bad):
    with pytest.raises(ValueError):
        SandboxConfig(**bad)
