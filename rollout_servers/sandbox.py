"""Sandbox for model-written Python: run untrusted code, report how it ended apart from its output.

Components:
- `SandboxConfig`: the limits and which isolation backend to use.
- `Sandbox`: picks the backend at construction (probing the strongest first, warning loudly on
  a fallback) and runs programs with `run` on the caller's event loop, at most `max_concurrent`
  at once, each in a fresh sandbox.
- backends, strongest first (docs/sandbox.md says what each isolates): `bwrap` (bubblewrap: own
  PID/network/IPC/UTS/mount namespaces, a read-only view of the system and the interpreter, a
  private size-bounded tmpfs), `unshare` (util-linux: own PID/network/IPC/UTS/mount namespaces,
  but the host filesystem stays readable), `process` (rlimits and a private directory: NOT a
  security boundary).
- `_PRELUDE`: trusted Python that runs inside the sandbox first (mounts for `unshare`, a
  supervisor, the drop to the sandbox uid, rlimits), then runs the code in the same interpreter.

Invariants:
1. Nothing the code started is alive when `run` returns or is cancelled. Under bwrap/unshare the
   process we spawn exits only after the namespace's first process, which the kernel reaps only
   once the namespace is empty (`_reap`); code still running at the end is SIGKILLed first, by
   sweeping its uid (root) or through the namespace's first process (`_kill_running`). Under
   `process` the group, the slot's uid and the run's token are swept (`_kill_stragglers`).
2. The server holds at most `output_limit_bytes` of each stream: pipes are read as they fill and
   the excess is only counted; past `output_kill_bytes` in all the code is killed.
3. The code gets an empty environment (none of the server's secrets) and, under `bwrap` and
   `unshare`, sees no process and no network interface of the host.
4. RLIMIT_NPROC binds only for a uid other than 0, so as root the code never runs as uid 0 under
   `bwrap`/`unshare`: each slot owns a uid claimed with a lock file, so the limit counts exactly
   one sandbox. That, not cgroups, is what stops a fork bomb (the wall timeout is the backstop).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import pwd
import secrets
import shutil
import signal
import site
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

logger = logging.getLogger(__name__)

Backend = Literal["auto", "bwrap", "unshare", "process"]
Status = Literal["ok", "error", "timeout", "oom", "killed"]

_MIB = 1 << 20
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
_TOP_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_UID_LOCK_DIR = "/run/asyncrl-sandbox"
_UID_RANGE = 65536
_TAIL_BYTES = 256
_REAP_GRACE_S = 2.0
_TOKEN_VAR = "ASYNCRL_SANDBOX_TOKEN"
_PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm")  # each a fresh tmpfs inside the sandbox

# Runs inside the sandbox as `python -I -S -B -u -c _PRELUDE key=value...`, before the code:
# 1. (unshare as root) mounts: a tmpfs over each directory that hides the interpreter from other
#    users (e.g. /root, mode 0700) with the interpreter bound back, private tmpfs on /tmp,
#    /var/tmp, /dev/shm (an interpreter below them bound back read-only); 2. a supervisor fork: the code's parent and, under bwrap and unshare,
#    PID 1; it reaps orphans and reports a signal death as exit code 128+N; 3. the drop to
#    the sandbox uid, no_new_privs, rlimits; 4. the code as __main__, named ./main.py but never
#    written to disk (tracebacks still show its lines, and not the prelude's frame).
_PRELUDE = r"""
import os, sys
arg = dict(a.split("=", 1) for a in sys.argv[1:])
if "nnp" in arg:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def check(name, *args):
        args = [ctypes.c_ulong(a) if isinstance(a, int) else a for a in args]
        if getattr(libc, name)(*args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, name + ": " + os.strerror(err))
    if "pdeath" in arg:
        check("prctl", 1, 9, 0, 0, 0)
        if os.getppid() != int(arg["pdeath"]):
            os._exit(70)
for line in filter(None, arg.get("expose", "").split("\n")):
    top, *paths = line.split("\t")
    fds = [os.open(p, os.O_PATH) for p in paths]
    check("mount", b"tmpfs", top.encode(), b"tmpfs", 6, b"mode=755,size=1m")
    for p, fd in zip(paths, fds):
        os.makedirs(p, exist_ok=True)
        check("mount", b"/proc/self/fd/%d" % fd, p.encode(), None, 0x5000, None)
        os.close(fd)
if "tmp_bytes" in arg:
    keep = [p for p in arg.get("rebind", "").split("\n") if p]
    fds = [os.open(p, os.O_PATH) for p in keep]
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(d):
            opts = b"mode=1777,size=" + arg["tmp_bytes"].encode()
            check("mount", b"tmpfs", d.encode(), b"tmpfs", 6, opts)
    for p, fd in zip(keep, fds):  # an interpreter under /tmp (a CI virtualenv), read-only
        os.makedirs(p, mode=0o755, exist_ok=True)
        check("mount", b"/proc/self/fd/%d" % fd, p.encode(), None, 0x5000, None)
        check("mount", None, p.encode(), None, 0x1021, None)
        os.close(fd)
    os.chdir("/tmp")
fd = int(arg["code_fd"])
chunks = []
while chunk := os.read(fd, 1 << 20):
    chunks.append(chunk)
os.close(fd)
src = b"".join(chunks)
if "supervise" in arg:
    import gc
    gc.freeze()  # fewer copy-on-write faults in the child (~1 ms)
    child = os.fork()
    if child:
        status = 0
        while True:
            try:
                pid, st = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == child:
                status = st
                break
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    if "pdeath" in arg:
        check("prctl", 1, 9, 0, 0, 0)
if "uid" in arg:
    uid = int(arg["uid"])
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
if "nnp" in arg:
    check("prctl", 38, 1, 0, 0, 0)
import resource
cpu, mem, fsize, nofile, nproc = map(int, arg["limits"].split(","))
for what, soft, hard in (
    (resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
    (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NOFILE, nofile, nofile),
    (resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_CORE, 0, 0),
):
    cap = resource.getrlimit(what)[1]
    if soft < 0:
        continue
    if cap != resource.RLIM_INFINITY:
        soft, hard = min(soft, cap), min(hard, cap)
    resource.setrlimit(what, (soft, hard))
path = os.path.join(os.getcwd(), "main.py")
sys.argv = [path]
sys.path[:0] = [os.getcwd()]
sys.path += list(filter(None, arg.get("site", "").split("\n")))
import builtins, _sitebuiltins
builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
prelude_main = sys.modules["__main__"]
main = type(sys)("__main__")
main.__builtins__ = builtins
sys.modules["__main__"] = main
try:
    exec(compile(src, path, "exec"), main.__dict__)
except SystemExit:
    raise
except BaseException as exc:
    if isinstance(exc, MemoryError):
        main.__dict__.clear()
    import linecache, traceback
    lines = [line.rstrip("\n") + "\n" for line in src.decode("utf-8", "replace").splitlines()]
    linecache.cache[path] = (len(src), None, lines, path)
    traceback.print_exception(exc.with_traceback(exc.__traceback__.tb_next))
    sys.exit(1)
"""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one execution and how the sandbox isolates it (docs/sandbox.md)."""

    wall_timeout_s: float = 5.0
    """Wall-clock seconds from spawn until the whole process tree is SIGKILLed (> 0)."""
    cpu_seconds: int = 5
    """RLIMIT_CPU of each process: SIGXCPU after this many CPU seconds (status timeout)."""
    memory_mb: int = 512
    """RLIMIT_AS of each process in MiB: allocations past it raise MemoryError (status oom)."""
    max_processes: int = 32
    """RLIMIT_NPROC: tasks (processes and threads) the code may have alive at once, its own
    process included. Binds per execution except for the `process` backend (module invariant 4)."""
    file_size_mb: int = 16
    """RLIMIT_FSIZE in MiB: writing past it fails with OSError (EFBIG)."""
    tmp_size_mb: int = 64
    """Size in MiB of each private tmpfs (/tmp, the working directory, and /dev/shm)."""
    open_files: int = 64
    """RLIMIT_NOFILE: descriptors each process may hold open."""
    output_limit_bytes: int = 64 * 1024
    """Bytes kept of each of stdout and stderr; the rest is counted in a truncation marker."""
    output_kill_bytes: int = 8 * _MIB
    """Bytes written to stdout and stderr together after which the code is killed (killed)."""
    max_concurrent: int = 4
    """Executions running at once; further `run` calls wait for a free slot."""
    backend: Backend = "auto"
    """Isolation: "auto" takes the strongest that works here: bwrap, then unshare, then process."""
    site_packages: bool = True
    """Put the interpreter's site-packages on the code's sys.path (numpy, sympy...) without
    running `site` (its .pth files can cost tens of ms per start)."""
    sandbox_uid_base: int = 1_900_000_000
    """When the server is root, the code runs as uids claimed from [base, base + 65536).
    No account may use them: every process of a claimed uid is killed after each run."""

    def __post_init__(self) -> None:
        for name in (
            "wall_timeout_s",
            "cpu_seconds",
            "memory_mb",
            "max_processes",
            "file_size_mb",
            "tmp_size_mb",
            "open_files",
            "output_limit_bytes",
            "max_concurrent",
            "sandbox_uid_base",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.output_kill_bytes < self.output_limit_bytes:
            raise ValueError("SandboxConfig.output_kill_bytes must be >= output_limit_bytes")
        if self.backend not in ("auto", "bwrap", "unshare", "process"):
            raise ValueError(f"unknown sandbox backend {self.backend!r}")


@dataclass
class SandboxResult:
    """How one execution ended, and what it printed (each stream truncated to the limit)."""

    status: Status  # ok | error (non-zero exit) | timeout (wall or CPU) | oom | killed (signal)
    stdout: str  # decoded leniently; ends with "... [truncated N bytes]" when cut
    stderr: str  # idem; tracebacks land here
    exit_code: int | None  # None when the code died by a signal (ours or another)
    wall_s: float  # spawn to reaped, sandbox setup included


@dataclass(frozen=True)
class _Plan:
    """How a backend starts the interpreter; computed once per Sandbox."""

    backend: str
    prefix: tuple[str, ...]  # argv before the interpreter (bwrap ..., setpriv ... unshare ...)
    prelude_args: tuple[str, ...]  # key=value arguments of the prelude shared by every run
    host_workdir: bool  # run in a fresh host temp dir (no private tmpfs in this backend)
    drops_uid: bool  # the code runs as the slot's uid (server is root)
    pid_namespace: bool  # the tree dies with the namespace's first process


@dataclass
class _Capture(asyncio.Protocol):
    """One output pipe: keeps the first `keep` bytes, counts the rest, and sets `flood` once the
    pipes sharing `budget` wrote more than it. Never buffers more than `keep` bytes."""

    keep: int
    budget: list[int]  # bytes the pipes of one run may still write before `flood` (shared)
    flood: asyncio.Event
    head: bytearray = field(default_factory=bytearray)
    dropped: int = 0
    tail: bytes = b""  # last bytes seen, for the MemoryError check
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    def data_received(self, data: bytes) -> None:
        room = max(self.keep - len(self.head), 0)
        self.head += data[:room]
        self.dropped += max(len(data) - room, 0)
        self.tail = (self.tail + data[-_TAIL_BYTES:])[-_TAIL_BYTES:]
        self.budget[0] -= len(data)
        if self.budget[0] < 0:
            self.flood.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set()

    def text(self) -> str:
        text = self.head.decode("utf-8", errors="replace")
        return f"{text}\n... [truncated {self.dropped} bytes]" if self.dropped else text


class Sandbox:
    """Runs untrusted Python programs, each in a fresh sandbox, `max_concurrent` at once.

    Construction probes the backends (tens of ms, blocking) and, when the server is root,
    claims one uid per slot; `close` releases them. `run` never raises for anything the code
    does: crashes, limits and timeouts are all in the `SandboxResult`."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._root = os.geteuid() == 0
        self._uid_locks: dict[int, int] = {}  # uid -> flock'ed fd
        self._slots: asyncio.Queue[int] | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self._running = 0
        try:
            self._slot_ids = self._claim_uids() if self._root else [0] * self.config.max_concurrent
            self._plan = self._choose_plan()
        except BaseException:
            self.close()
            raise

    @property
    def backend(self) -> str:
        """The backend in use: "bwrap", "unshare" or "process"."""
        return self._plan.backend

    @property
    def uids(self) -> tuple[int, ...]:
        """The uids the code runs as, one per slot (empty unless the server is root and the
        backend drops privileges): every process of these uids belongs to this sandbox."""
        return tuple(self._slot_ids) if self._plan.drops_uid else ()

    @property
    def limits_processes(self) -> bool:
        """Whether `max_processes` binds per execution, so a fork bomb stops there (else only
        the wall timeout ends it)."""
        return self._plan.drops_uid or (not self._root and self._plan.pid_namespace)

    async def run(self, code: str, stdin: str = "") -> SandboxResult:
        """Run `code` as __main__ with `stdin`, after waiting for a free slot."""
        if self._root and not self._uid_locks:
            raise RuntimeError("this Sandbox is closed (its uids are released)")
        slots = self._slot_pool()
        slot = await slots.get()
        self._running += 1
        try:
            return await self._execute(code, stdin, slot)
        finally:
            self._running -= 1
            slots.put_nowait(slot)

    def run_sync(self, code: str, stdin: str = "") -> SandboxResult:
        """`run` for synchronous callers (tools, tests); not from inside a running event loop."""
        return asyncio.run(self.run(code, stdin))

    def close(self) -> None:
        """Kill what still runs as the claimed uids and release them. Idempotent."""
        for uid, fd in self._uid_locks.items():
            _sweep_uid(uid)
            os.close(fd)
        self._uid_locks = {}

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _slot_pool(self) -> asyncio.Queue[int]:
        """The slot queue of the running loop (asyncio queues must not cross event loops)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            if self._running:
                raise RuntimeError("this Sandbox is running code on another event loop")
            self._slots, self._slots_loop = asyncio.Queue(), loop
            for slot in self._slot_ids:
                self._slots.put_nowait(slot)
        return self._slots

    async def _execute(self, code: str, stdin: str, slot: int) -> SandboxResult:
        cfg = self.config
        flood = asyncio.Event()
        budget = [cfg.output_kill_bytes]
        out = _Capture(cfg.output_limit_bytes, budget, flood)
        err = _Capture(cfg.output_limit_bytes, budget, flood)
        token = secrets.token_hex(8)
        with contextlib.ExitStack() as stack:
            code_fd = stack.enter_context(_memfd(code.encode()))
            stdin_fd = stack.enter_context(_memfd(stdin.encode()))
            argv, env, cwd = stack.enter_context(self._launch(code_fd, slot, token))
            write_fds = []
            for capture in (out, err):
                read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
                write_fds.append(write_fd)
                stack.callback((await _read_into(capture, read_fd)).close)
            start = time.monotonic()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=stdin_fd,
                    stdout=write_fds[0],
                    stderr=write_fds[1],
                    pass_fds=(code_fd,),
                    env=env,
                    cwd=cwd,
                    start_new_session=True,
                )
            finally:
                for write_fd in write_fds:  # the child holds its copies; EOF once all are gone
                    os.close(write_fd)
            finished = False
            try:
                ending = await self._wait(proc, flood)
                if ending != "exited":
                    await asyncio.to_thread(self._kill_running, proc, slot, token)
                await self._reap(proc)
                if not self._plan.pid_namespace:
                    await asyncio.to_thread(self._kill_stragglers, slot, token)
                finished = True
            finally:
                if not finished:  # cancelled or failed: nothing may outlive the call
                    self._kill_running(proc, slot, token)
                    if proc.returncode is None:
                        _signal(proc.pid, signal.SIGKILL)
                    self._kill_stragglers(slot, token)
            await _wait_closed(out, err)
            wall_s = time.monotonic() - start
        status, exit_code = _classify(ending, proc.returncode, err.tail)
        stderr = err.text()
        if ending == "flood":
            stderr += f"\n[sandbox: killed after more than {cfg.output_kill_bytes} output bytes]"
        return SandboxResult(status, out.text(), stderr, exit_code, wall_s)

    @contextlib.contextmanager
    def _launch(
        self, code_fd: int, slot: int, token: str, plan: _Plan | None = None
    ) -> Iterator[tuple[list[str], dict[str, str], str]]:
        """argv, environment and working directory of one run (the host directory, for
        backends that use one, is removed on exit)."""
        plan = plan or self._plan
        with contextlib.ExitStack() as stack:
            workdir = stack.enter_context(_host_workdir(plan, slot)) if plan.host_workdir else None
            interpreter = [sys.executable, "-I", "-S", "-B", "-u", "-c", _PRELUDE]
            argv = [*plan.prefix, *interpreter, *plan.prelude_args, f"code_fd={code_fd}"]
            if plan.drops_uid:
                argv.append(f"uid={slot}")
            env = _sandbox_env(workdir or "/tmp")
            if plan.backend == "process":
                argv.append(f"pdeath={os.getpid()}")
                env[_TOKEN_VAR] = token
            if plan.backend == "bwrap":  # bwrap sets the code's environment itself
                env = {"PATH": "/usr/bin:/bin"}
            yield argv, env, workdir or "/"

    async def _wait(self, proc: asyncio.subprocess.Process, flood: asyncio.Event) -> str:
        """How the run ended: "exited", "timeout" or "flood" (output past the kill budget)."""
        exited = asyncio.ensure_future(proc.wait())
        flooded = asyncio.ensure_future(flood.wait())
        try:
            done, _ = await asyncio.wait(
                {exited, flooded},
                timeout=self.config.wall_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            flooded.cancel()
            exited.cancel()
        if exited in done:
            return "exited"
        return "flood" if flooded in done else "timeout"

    async def _reap(self, proc: asyncio.subprocess.Process) -> None:
        """Wait for the spawned process. With a PID namespace it exits only after the
        namespace's first process, which the kernel reaps only once every other process of the
        namespace is gone: so then nothing of the run is alive."""
        try:
            await asyncio.wait_for(proc.wait(), _REAP_GRACE_S)
        except asyncio.TimeoutError:  # e.g. stuck in the prelude: --die-with-parent/--kill-child
            _signal(proc.pid, signal.SIGKILL)
            await proc.wait()

    def _kill_running(self, proc: asyncio.subprocess.Process, slot: int, token: str) -> None:
        """SIGKILL the code of a run that has not ended: the processes of the slot's uid when
        there is one (the supervisor then exits on its own, reporting the signal), else the
        namespace's first process (the namespace dies with it) or the process group."""
        plan = self._plan
        if plan.drops_uid:
            _sweep_uid(slot)
        pid = proc.pid if proc.returncode is None else None  # once reaped, the pid may be reused
        if pid is not None and not plan.drops_uid and plan.pid_namespace:
            for child in _children(pid):
                _signal(child, signal.SIGKILL)
        if pid is not None and not plan.pid_namespace:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def _kill_stragglers(self, slot: int, token: str, plan: _Plan | None = None) -> None:
        """Without a PID namespace (`process`), find what the code left behind (daemons that
        left the process group): every process of the slot's uid, or carrying the run's token
        in its environment (a process that clears its environment escapes this one)."""
        plan = plan or self._plan
        if plan.pid_namespace:
            return
        if plan.drops_uid:
            _sweep_uid(slot)
        marker = f"{_TOKEN_VAR}={token}".encode()
        _sweep(lambda pid: pid != os.getpid() and marker in _read(f"/proc/{pid}/environ"), token)

    def _claim_uids(self) -> list[int]:
        """Claim `max_concurrent` uids that no account and no other Sandbox on this host holds
        (an flock per uid, held until `close` or exit); kill leftovers of a crashed owner."""
        os.makedirs(_UID_LOCK_DIR, mode=0o700, exist_ok=True)
        info = os.stat(_UID_LOCK_DIR)
        if info.st_uid != 0 or info.st_mode & 0o022:
            raise RuntimeError(f"{_UID_LOCK_DIR} must be root's and not group/world-writable")
        base = self.config.sandbox_uid_base
        for uid in range(base, base + _UID_RANGE):
            if len(self._uid_locks) == self.config.max_concurrent:
                break
            if _has_account(uid):
                continue
            fd = os.open(f"{_UID_LOCK_DIR}/{uid}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._uid_locks[uid] = fd
            _sweep_uid(uid)
        if len(self._uid_locks) < self.config.max_concurrent:
            raise RuntimeError(f"fewer than {self.config.max_concurrent} free sandbox uids")
        return list(self._uid_locks)

    def _choose_plan(self) -> _Plan:
        """The first backend (in order of strength, for "auto") whose probe run works."""
        wanted = self.config.backend
        reasons: list[str] = []
        for backend in ["bwrap", "unshare", "process"] if wanted == "auto" else [wanted]:
            plan_or_reason = self._make_plan(backend)
            reason = plan_or_reason if isinstance(plan_or_reason, str) else None
            if isinstance(plan_or_reason, _Plan):
                reason = self._probe(plan_or_reason)
                if reason is None:
                    self._warn_if_weak(plan_or_reason, reasons)
                    return plan_or_reason
            reasons.append(f"{backend}: {reason}")
        raise RuntimeError("no sandbox backend works here: " + "; ".join(reasons))

    def _warn_if_weak(self, plan: _Plan, reasons: list[str]) -> None:
        if reasons:
            logger.warning(
                "SANDBOX FALLBACK: model code runs under %r, weaker than bubblewrap (%s); "
                "see docs/sandbox.md",
                plan.backend,
                "; ".join(reasons),
            )
        if plan.backend == "process":
            logger.warning(
                "SANDBOX IS NOT A SECURITY BOUNDARY: the 'process' backend gives model code the "
                "network and a view of the host's files and processes%s",
                "" if plan.drops_uid else ", as the server's own user (it can kill the server)",
            )

    def _make_plan(self, backend: str) -> _Plan | str:
        """The plan for `backend`, or why it cannot work here (a missing binary)."""
        cfg, root = self.config, self._root
        dirs = _interpreter_dirs(cfg.site_packages)
        shared = [f"site={chr(10).join(_site_dirs())}"] if cfg.site_packages else []
        if backend == "bwrap":
            bwrap = shutil.which("bwrap")
            if bwrap is None:
                return "bwrap not found on PATH (apt-get install -y bubblewrap)"
            # Not root: the supervisor shares the user namespace's process count.
            limits = _limits(cfg, cfg.max_processes + (0 if root else 1))
            prefix = _bwrap_prefix(bwrap, cfg, root, dirs)
            return _Plan("bwrap", prefix, (limits, *shared, "supervise=1"), False, root, True)
        if backend == "unshare":
            tools = {name: shutil.which(name) for name in ("unshare", "setpriv")}
            missing = [name for name, path in tools.items() if path is None]
            if missing:
                return f"{' and '.join(missing)} not found on PATH (util-linux)"
            runner = [str(tools["setpriv"]), "--pdeathsig", "KILL", "--", str(tools["unshare"])]
            args = [*shared, "supervise=1", "nnp=1"]
            if root:
                hidden = _hidden_dirs(dirs)
                args += [_limits(cfg, cfg.max_processes), f"tmp_bytes={cfg.tmp_size_mb * _MIB}"]
                under_tmp = [d for d in dirs if any(_is_under(d, t) for t in _PRIVATE_TMP)]
                if under_tmp:
                    args.append("rebind=" + "\n".join(under_tmp))
                if hidden:
                    args.append("expose=" + "\n".join("\t".join([t, *ps]) for t, ps in hidden))
            else:  # unshare and the supervisor share the user namespace's process count
                runner += ["--user", "--map-current-user"]
                args.append(_limits(cfg, cfg.max_processes + 2))
            runner += ["--pid", "--net", "--ipc", "--uts", "--mount", "--fork", "--kill-child"]
            runner += ["--mount-proc", "--"]
            return _Plan("unshare", tuple(runner), tuple(args), not root, root, True)
        # process: RLIMIT_NPROC would count every process of the server's user: left unset then.
        drops = root and not _hidden_dirs(dirs)
        limits = _limits(cfg, cfg.max_processes if drops else -1)
        return _Plan("process", (), (limits, *shared, "supervise=1", "nnp=1"), True, drops, False)

    def _probe(self, plan: _Plan) -> str | None:
        """Run a tiny program through `plan` (blocking); None when it printed what it should."""
        slot, token = self._slot_ids[0], secrets.token_hex(8)
        with contextlib.ExitStack() as stack:
            code_fd = stack.enter_context(_memfd(b"print('sandbox-ok')"))
            argv, env, cwd = stack.enter_context(self._launch(code_fd, slot, token, plan))
            try:
                done = subprocess.run(
                    argv,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    env=env,
                    cwd=cwd,
                    pass_fds=(code_fd,),
                    start_new_session=True,
                    timeout=30,
                )
            except subprocess.TimeoutExpired:
                return "probe run timed out"
            finally:
                self._kill_stragglers(slot, token, plan)
        if done.returncode == 0 and done.stdout == b"sandbox-ok\n":
            return None
        tail = done.stderr.decode(errors="replace").strip()[-300:]
        return f"probe run failed (exit {done.returncode}): {tail}"


def _limits(cfg: SandboxConfig, nproc: int) -> str:
    """The prelude's rlimits argument (a negative value leaves that limit as inherited)."""
    values = (cfg.cpu_seconds, cfg.memory_mb * _MIB, cfg.file_size_mb * _MIB, cfg.open_files)
    return "limits=" + ",".join(str(v) for v in (*values, nproc))


def _bwrap_prefix(bwrap: str, cfg: SandboxConfig, root: bool, dirs: list[str]) -> tuple[str, ...]:
    """bubblewrap with its own PID/net/IPC/UTS/mount namespaces and a read-only system.

    As root, no user namespace (its uid 0 would be the host's, which RLIMIT_NPROC exempts): the
    sandbox keeps only CAP_SETUID/SETGID, which the prelude spends on dropping to the slot's
    uid. Otherwise a user namespace that cannot nest (--disable-userns)."""
    argv = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    argv += ["--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session"]
    argv += ["--as-pid-1"]  # the prelude's supervisor: bwrap then exits only once it is reaped
    if root:
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for name in _TOP_DIRS:
        path = "/" + name
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in _ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for mount in ("/tmp", "/dev/shm"):
        argv += ["--perms", "1777", "--size", str(cfg.tmp_size_mb * _MIB), "--tmpfs", mount]
    # the interpreter after the private mounts: a virtualenv under /tmp (CI makes one) must be
    # bound on top of the fresh tmpfs, not hidden by it
    made = {"/tmp", "/dev", "/dev/shm", "/proc"}
    for path in dirs:
        if _is_under(path, "/usr"):
            continue
        parts = path.strip("/").split("/")
        for depth in range(1, len(parts)):  # bwrap would create them mode 0700 (root's only)
            parent = "/" + "/".join(parts[:depth])
            if parent not in made:
                made.add(parent)
                argv += ["--perms", "0755", "--dir", parent]
        argv += ["--ro-bind", path, path]
    argv += ["--chdir", "/tmp", "--clearenv"]
    for key, value in _sandbox_env("/tmp").items():
        argv += ["--setenv", key, value]
    return tuple(argv)


def _sandbox_env(home: str) -> dict[str, str]:
    """The code's whole environment: nothing of the server's, one BLAS/OpenMP thread."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _site_dirs() -> list[str]:
    return [d for d in site.getsitepackages() if os.path.isdir(d)]


def _interpreter_dirs(with_site: bool) -> list[str]:
    """The directories the interpreter needs (as spelled and resolved), none inside another."""
    paths = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(sys.executable),
        os.path.dirname(os.path.realpath(sys.executable)),
    }
    if with_site:
        paths.update(_site_dirs())
    spelled = {os.path.realpath(p) for p in paths} | {os.path.abspath(p) for p in paths}
    return sorted(p for p in spelled if not any(p != q and _is_under(p, q) for q in spelled))


def _is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _hidden_dirs(dirs: list[str]) -> list[tuple[str, list[str]]]:
    """For each top-most directory that other users cannot traverse (e.g. /root, mode 0700):
    the interpreter directories below it, which the unshare prelude re-exposes under a tmpfs."""
    hidden: dict[str, list[str]] = {}
    for path in dirs:
        parts = path.strip("/").split("/")
        for depth in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:depth])
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                hidden.setdefault(ancestor, []).append(path)
                break
    return sorted(hidden.items())


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


@contextlib.contextmanager
def _memfd(data: bytes) -> Iterator[int]:
    """An anonymous in-memory file holding `data`, at its start: no disk, no path."""
    fd = os.memfd_create("asyncrl-sandbox")
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _host_workdir(plan: _Plan, owner: int) -> Iterator[str]:
    """A fresh private host directory, owned by the sandbox uid, removed afterwards."""
    path = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
    try:
        if plan.drops_uid:
            os.chown(path, owner, owner)
        yield path
    finally:
        _remove_tree(path)


def _remove_tree(path: str) -> None:
    """rmtree that first gives back the permissions the code may have taken from its files."""
    for parent, subdirs, _ in os.walk(path):
        for name in subdirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(parent, name), 0o700, follow_symlinks=False)
    shutil.rmtree(path, ignore_errors=True)


async def _read_into(capture: _Capture, read_fd: int) -> asyncio.ReadTransport:
    """Feed the pipe `read_fd` to `capture` as data arrives; the transport owns the fd."""
    reader = os.fdopen(read_fd, "rb", buffering=0)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(lambda: capture, reader)
    return transport


async def _wait_closed(*captures: _Capture) -> None:
    """Wait for end-of-file on the pipes: everything that held them is dead by now."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(c.closed.wait() for c in captures)), _REAP_GRACE_S)


def _classify(ending: str, returncode: int | None, err_tail: bytes) -> tuple[Status, int | None]:
    """Status and exit code of a run. bwrap and the prelude's supervisor report a signal death
    as 128+N, so exit codes 129..192 of the code itself also read as signals."""
    if ending == "timeout":
        return "timeout", None
    if ending == "flood" or returncode is None:
        return "killed", None
    signum = -returncode if returncode < 0 else None
    if 128 < returncode <= 128 + 64:
        signum = returncode - 128
    if signum is not None:
        return ("timeout" if signum == signal.SIGXCPU else "killed"), None
    if returncode == 0:
        return "ok", 0
    if returncode == 1 and err_tail.rstrip().rsplit(b"\n", 1)[-1].startswith(b"MemoryError"):
        return "oom", 1
    return "error", returncode


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(p) for p in _read(f"/proc/{pid}/task/{pid}/children").split()]
    return []


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _sweep(match: Callable[[int], bool], what: str) -> None:
    """SIGKILL every live (non-zombie) process that `match` selects until none is left."""
    for _ in range(500):
        pids = []
        for name in os.listdir("/proc"):
            with contextlib.suppress(OSError, IndexError):
                if name.isdigit() and match(int(name)):
                    pids.append(int(name))
        if not pids:
            return
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        time.sleep(0.002)
    raise RuntimeError(f"sandbox processes ({what}) survive SIGKILL")


def _sweep_uid(uid: int) -> None:
    wanted = str(uid).encode()

    def runs_as_uid(pid: int) -> bool:
        status = _read(f"/proc/{pid}/status")
        uids = status.split(b"\nUid:\t", 1)[1].split(b"\n", 1)[0].split()
        return b"\nState:\tZ" not in status and wanted in uids[:2]

    _sweep(runs_as_uid, f"uid {uid}")
