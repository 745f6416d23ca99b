"""`Sandbox`: runs untrusted Python programs, each in a fresh sandbox (see the package docstring
for the backends and invariants)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from rollout_servers.sandbox.cgroup import CgroupRoot, RunCgroup
from rollout_servers.sandbox.config import (
    _MIB,
    _PRIVATE_TMP,
    _REAP_GRACE_S,
    _TOKEN_VAR,
    _UID_LOCK_DIR,
    _UID_RANGE,
    SandboxConfig,
    SandboxResult,
    _Plan,
)
from rollout_servers.sandbox.host import (
    _bwrap_prefix,
    _children,
    _descendants,
    _has_account,
    _hidden_dirs,
    _host_workdir,
    _interpreter_dirs,
    _is_under,
    _limits,
    _memfd,
    _pids_of_uid,
    _read,
    _rss_bytes,
    _sandbox_env,
    _signal,
    _site_dirs,
    _sweep,
    _sweep_uid,
)
from rollout_servers.sandbox.output import _Capture, _classify, _read_into, _wait_closed
from rollout_servers.sandbox.prelude import _PRELUDE
from rollout_servers.sandbox.seccomp import filter_program

logger = logging.getLogger(__name__)

_CGROUP_TICK_S = 0.05
"""How often a run's CPU time is read from its cgroup."""
_WATCHDOG_TICK_S = 0.1
"""How often, without a cgroup, the run's resident memory is summed from /proc."""


@dataclass
class _Run:
    """One run's identity: its slot (uid when root), its token, its cgroups (None without)."""

    slot: int
    token: str
    cgroup: RunCgroup | None
    seccomp_fd: int | None = None  # bwrap's filter (other backends: the prelude installs it)


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
        self.runs_started = 0
        """Runs started so far (each is one sandboxed process tree)."""
        self._cgroups = CgroupRoot.detect()
        self._seccomp = filter_program()
        try:
            self._slot_ids = self._claim_uids() if self._root else [0] * self.config.max_concurrent
            self._plan = self._choose_plan()
        except BaseException:
            self.close()
            raise
        logger.info(
            "sandbox: backend %s, whole-run limits by %s",
            self._plan.backend,
            self.whole_run_limits,
        )

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
    def whole_run_limits(self) -> str:
        """What bounds a run as a whole: "cgroup v1"/"cgroup v2" (the kernel counts memory,
        tasks and CPU of all its processes), else "watchdog" (a poll of the run's resident
        memory, per-process rlimits; docs/sandbox.md)."""
        return f"cgroup v{self._cgroups.version}" if self._cgroups else "watchdog"

    @property
    def limits_processes(self) -> bool:
        """Whether `max_processes` binds per execution, so a fork bomb stops there (else only
        the wall timeout ends it)."""
        return (
            self._cgroups is not None
            or self._plan.drops_uid
            or (not self._root and self._plan.pid_namespace)
        )

    async def run(
        self, code: str, stdin: str = "", wall_timeout_s: float | None = None
    ) -> SandboxResult:
        """Run `code` as __main__ with `stdin`, after waiting for a free slot; `wall_timeout_s`
        overrides the configured wall timeout for this run."""
        if self._root and not self._uid_locks:
            raise RuntimeError("this Sandbox is closed (its uids are released)")
        slots = self._slot_pool()
        slot = await slots.get()
        self._running += 1
        self.runs_started += 1
        try:
            return await self._execute(
                code, stdin, slot, wall_timeout_s or self.config.wall_timeout_s
            )
        finally:
            self._running -= 1
            slots.put_nowait(slot)

    def run_sync(
        self, code: str, stdin: str = "", wall_timeout_s: float | None = None
    ) -> SandboxResult:
        """`run` for synchronous callers (tools, tests); not from inside a running event loop."""
        return asyncio.run(self.run(code, stdin, wall_timeout_s))

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

    async def _execute(self, code: str, stdin: str, slot: int, wall_s: float) -> SandboxResult:
        cfg = self.config
        flood = asyncio.Event()
        budget = [cfg.output_kill_bytes]
        out = _Capture(cfg.output_limit_bytes, budget, flood)
        err = _Capture(cfg.output_limit_bytes, budget, flood)
        token = secrets.token_hex(8)
        run = _Run(slot, token, None)
        with contextlib.ExitStack() as stack:
            if self._cgroups is not None:
                run.cgroup = self._cgroups.create(
                    f"asyncrl-sandbox-{os.getpid()}-{slot}-{token}",
                    cfg.memory_mb * _MIB,
                    cfg.max_processes + 1,  # + the prelude's supervisor
                )
                stack.callback(run.cgroup.remove)
            code_fd = stack.enter_context(_memfd(code.encode()))
            stdin_fd = stack.enter_context(_memfd(stdin.encode()))
            if self._plan.backend == "bwrap":  # bwrap reads the filter from a descriptor
                run.seccomp_fd = stack.enter_context(_memfd(self._seccomp))
            argv, env, cwd = stack.enter_context(self._launch(code_fd, run))
            start = time.monotonic()
            proc = await self._spawn(stack, argv, env, cwd, stdin_fd, code_fd, run, (out, err))
            finished = False
            try:
                ending = await self._wait(proc, flood, wall_s, run)
                if ending != "exited":
                    await asyncio.to_thread(self._kill_running, proc, run)
                await self._reap(proc)
                if not self._plan.pid_namespace:
                    await asyncio.to_thread(self._kill_stragglers, slot, token)
                finished = True
            finally:
                if not finished:  # cancelled or failed: nothing may outlive the call
                    self._kill_running(proc, run)
                    if proc.returncode is None:
                        _signal(proc.pid, signal.SIGKILL)
                    self._kill_stragglers(slot, token)
            await _wait_closed(out, err)
            wall_s = time.monotonic() - start
            peak_mb = None
            if run.cgroup is not None:
                peak_mb = run.cgroup.peak_memory_bytes() / _MIB
                if run.cgroup.oom_kills():
                    ending = "oom"  # the kernel killed one of the run's processes at the limit
        status, exit_code = _classify(ending, proc.returncode, err.tail)
        stderr = err.text()
        if ending == "flood":
            stderr += f"\n[sandbox: killed after more than {cfg.output_kill_bytes} output bytes]"
        return SandboxResult(status, out.text(), stderr, exit_code, wall_s, peak_mb)

    async def _spawn(self, stack, argv, env, cwd, stdin_fd, code_fd, run: _Run, captures):
        """Start the run's first process with its output pipes read into `captures`."""
        write_fds = []
        for capture in captures:
            read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
            write_fds.append(write_fd)
            stack.callback((await _read_into(capture, read_fd)).close)
        cgroup_fds = tuple(run.cgroup.procs_fds) if run.cgroup is not None else ()
        if run.seccomp_fd is not None:
            cgroup_fds += (run.seccomp_fd,)
        try:
            return await asyncio.create_subprocess_exec(
                *argv,
                stdin=stdin_fd,
                stdout=write_fds[0],
                stderr=write_fds[1],
                pass_fds=(code_fd, *cgroup_fds),  # and bwrap's seccomp filter
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            for write_fd in write_fds:  # the child holds its copies; EOF once all are gone
                os.close(write_fd)

    @contextlib.contextmanager
    def _launch(
        self, code_fd: int, run: _Run, plan: _Plan | None = None
    ) -> Iterator[tuple[list[str], dict[str, str], str]]:
        """argv, environment and working directory of one run (the host directory, for
        backends that use one, is removed on exit)."""
        plan = plan or self._plan
        with contextlib.ExitStack() as stack:
            workdir = (
                stack.enter_context(_host_workdir(plan, run.slot)) if plan.host_workdir else None
            )
            interpreter = [sys.executable, "-I", "-S", "-B", "-u", "-c", _PRELUDE]
            argv = list(plan.prefix)
            if run.seccomp_fd is not None:
                argv += ["--seccomp", str(run.seccomp_fd)]
            argv += [*interpreter, *plan.prelude_args, f"code_fd={code_fd}"]
            if plan.backend != "bwrap":
                argv.append(f"seccomp={self._seccomp.hex()}")
            if run.cgroup is not None:
                argv.append("cgroup_fds=" + ",".join(str(fd) for fd in run.cgroup.procs_fds))
            if plan.drops_uid:
                argv.append(f"uid={run.slot}")
            env = _sandbox_env(workdir or "/tmp")
            if plan.backend == "process":
                argv.append(f"pdeath={os.getpid()}")
                env[_TOKEN_VAR] = run.token
            if plan.backend == "bwrap":  # bwrap sets the code's environment itself
                env = {"PATH": "/usr/bin:/bin"}
            yield argv, env, workdir or "/"

    async def _wait(
        self, proc: asyncio.subprocess.Process, flood: asyncio.Event, wall_s: float, run: _Run
    ) -> str:
        """How the run ended: "exited", "timeout", "flood" (output past the kill budget), "cpu"
        (the run's CPU time past cpu_seconds) or "oom" (the watchdog saw the run's resident
        memory past memory_mb; only without a cgroup, where the kernel enforces it)."""
        exited = asyncio.ensure_future(proc.wait())
        flooded = asyncio.ensure_future(flood.wait())
        deadline = time.monotonic() + wall_s
        tick = _CGROUP_TICK_S if run.cgroup is not None else _WATCHDOG_TICK_S
        try:
            while (left := deadline - time.monotonic()) > 0:
                done, _ = await asyncio.wait(
                    {exited, flooded}, timeout=min(tick, left), return_when=asyncio.FIRST_COMPLETED
                )
                if exited in done:
                    return "exited"
                if flooded in done:
                    return "flood"
                if run.cgroup is not None:
                    if run.cgroup.cpu_seconds() > self.config.cpu_seconds:
                        return "cpu"
                elif (
                    await asyncio.to_thread(self._run_rss, proc, run) > self.config.memory_mb * _MIB
                ):
                    return "oom"
            return "timeout"
        finally:
            flooded.cancel()
            exited.cancel()

    def _run_rss(self, proc: asyncio.subprocess.Process, run: _Run) -> int:
        """Resident bytes of the run's processes (the watchdog's view, without a cgroup)."""
        if self._plan.drops_uid:
            return _rss_bytes(_pids_of_uid(run.slot))
        return _rss_bytes(_descendants(proc.pid))

    async def _reap(self, proc: asyncio.subprocess.Process) -> None:
        """Wait for the spawned process. With a PID namespace it exits only after the
        namespace's first process, which the kernel reaps only once every other process of the
        namespace is gone: so then nothing of the run is alive."""
        try:
            await asyncio.wait_for(proc.wait(), _REAP_GRACE_S)
        except asyncio.TimeoutError:  # e.g. stuck in the prelude: --die-with-parent/--kill-child
            _signal(proc.pid, signal.SIGKILL)
            await proc.wait()

    def _kill_running(self, proc: asyncio.subprocess.Process, run: _Run) -> None:
        """SIGKILL the code of a run that has not ended: every process of its cgroup, else the
        processes of the slot's uid when there is one (the supervisor then exits on its own,
        reporting the signal), else the namespace's first process (the namespace dies with it)
        or the process group."""
        plan = self._plan
        if run.cgroup is not None:
            run.cgroup.kill()
        if plan.drops_uid:
            _sweep_uid(run.slot)
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
        """The configured backend, checked with a probe run. There is no fallback: a missing or
        broken backend stops the sandbox here (at server start-up) with what to install."""
        backend = self.config.backend
        plan = self._make_plan(backend)
        reason = plan if isinstance(plan, str) else self._probe(plan)
        if reason is not None:
            raise RuntimeError(
                f"sandbox backend {backend!r} does not work here: {reason}. Install it, or name "
                "a weaker backend explicitly in rollout.sandbox.backend (docs/sandbox.md)"
            )
        assert isinstance(plan, _Plan)
        if backend != "bwrap":
            logger.warning(
                "SANDBOX BACKEND %r (named in the config): weaker than bubblewrap; "
                "see docs/sandbox.md for what it does not isolate",
                backend,
            )
        if backend == "process":
            logger.warning(
                "SANDBOX IS NOT A SECURITY BOUNDARY: the 'process' backend gives model code the "
                "network and a view of the host's files and processes%s",
                "" if plan.drops_uid else ", as the server's own user (it can kill the server)",
            )
        return plan

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
                return f"{' and '.join(missing)} not found on PATH (apt-get install -y util-linux)"
            runner = [str(tools["setpriv"]), "--pdeathsig", "KILL", "--", str(tools["unshare"])]
            args = [*shared, "supervise=1"]
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
        return _Plan("process", (), (limits, *shared, "supervise=1"), True, drops, False)

    def _probe(self, plan: _Plan) -> str | None:
        """Run a tiny program through `plan` (blocking); None when it printed what it should."""
        slot, token = self._slot_ids[0], secrets.token_hex(8)
        with contextlib.ExitStack() as stack:
            code_fd = stack.enter_context(_memfd(b"print('sandbox-ok')"))
            argv, env, cwd = stack.enter_context(
                self._launch(code_fd, _Run(slot, token, None), plan)
            )
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
