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
    _has_account,
    _hidden_dirs,
    _host_workdir,
    _interpreter_dirs,
    _is_under,
    _limits,
    _memfd,
    _read,
    _sandbox_env,
    _signal,
    _site_dirs,
    _sweep,
    _sweep_uid,
)
from rollout_servers.sandbox.output import _Capture, _classify, _read_into, _wait_closed
from rollout_servers.sandbox.prelude import _PRELUDE

logger = logging.getLogger(__name__)


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
