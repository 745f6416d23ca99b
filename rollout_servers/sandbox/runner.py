"""`Sandbox`: runs untrusted Python programs, each in a fresh sandbox (see the package docstring
for the backends and invariants).

A `Sandbox` holds its slots (one uid each when the server is root), the backend plan chosen at
construction (`backends`) and, per run, its cgroups, output captures and the watch that ends it
(exit, wall or CPU timeout, output flood, memory); whatever ends a run, nothing of it outlives
`run` (`_kill_running`, `_reap`, `backends._kill_stragglers`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time

from asyncrl.config.sandbox import SandboxConfig
from rollout_servers.sandbox.backends import _choose_plan, _kill_stragglers, _launch, _Run
from rollout_servers.sandbox.cgroup import CgroupRoot
from rollout_servers.sandbox.config import _MIB, _REAP_GRACE_S, SandboxResult
from rollout_servers.sandbox.host import (
    _children,
    _claim_uids,
    _descendants,
    _memfd,
    _pids_of_uid,
    _release_uid,
    _rss_bytes,
    _signal,
    _sweep_uid,
)
from rollout_servers.sandbox.output import _Capture, _classify, _read_into, _wait_closed
from rollout_servers.sandbox.seccomp import filter_program

logger = logging.getLogger(__name__)

_CGROUP_TICK_S = 0.05
"""How often a run's CPU time is read from its cgroup."""
_WATCHDOG_TICK_S = 0.1
"""How often, without a cgroup, the run's resident memory is summed from /proc."""


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
            self._slot_ids = [0] * self.config.max_concurrent
            if self._root:
                base, count = self.config.sandbox_uid_base, self.config.max_concurrent
                _claim_uids(self._uid_locks, base, count)
                self._slot_ids = list(self._uid_locks)
            self._plan = _choose_plan(self.config, self._root, self._seccomp, self._slot_ids[0])
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
        self,
        code: str,
        stdin: str = "",
        wall_timeout_s: float | None = None,
        stdout_limit_bytes: int | None = None,
    ) -> SandboxResult:
        """Run `code` as __main__ with `stdin`, after waiting for a free slot; `wall_timeout_s`
        overrides the configured wall timeout for this run, `stdout_limit_bytes` the stdout
        kept (a trusted caller whose program reports a lot, the code reward's harness; the
        kill budget grows with it)."""
        if self._root and not self._uid_locks:
            raise RuntimeError("this Sandbox is closed (its uids are released)")
        slots = self._slot_pool()
        slot = await slots.get()
        self._running += 1
        self.runs_started += 1
        try:
            return await self._execute(
                code, stdin, slot, wall_timeout_s or self.config.wall_timeout_s, stdout_limit_bytes
            )
        finally:
            self._running -= 1
            slots.put_nowait(slot)

    def run_sync(
        self,
        code: str,
        stdin: str = "",
        wall_timeout_s: float | None = None,
        stdout_limit_bytes: int | None = None,
    ) -> SandboxResult:
        """`run` for synchronous callers (tools, tests); not from inside a running event loop."""
        return asyncio.run(self.run(code, stdin, wall_timeout_s, stdout_limit_bytes))

    def close(self) -> None:
        """Kill what still runs as the claimed uids and release them. Idempotent."""
        for uid, fd in self._uid_locks.items():
            _sweep_uid(uid)
            _release_uid(uid, fd)
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

    async def _execute(
        self, code: str, stdin: str, slot: int, wall_s: float, stdout_limit: int | None
    ) -> SandboxResult:
        cfg = self.config
        flood = asyncio.Event()
        stdout_limit = stdout_limit or cfg.output_limit_bytes
        kill_bytes = max(cfg.output_kill_bytes, stdout_limit + cfg.output_limit_bytes)
        budget = [kill_bytes]
        out = _Capture(stdout_limit, budget, flood)
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
            argv, env, cwd = stack.enter_context(_launch(self._plan, self._seccomp, code_fd, run))
            start = time.monotonic()
            proc = await self._spawn(stack, argv, env, cwd, stdin_fd, code_fd, run, (out, err))
            finished = False
            try:
                ending = await self._wait(proc, flood, wall_s, run)
                if ending != "exited":
                    await asyncio.to_thread(self._kill_running, proc, run)
                await self._reap(proc)
                if not self._plan.pid_namespace:
                    await asyncio.to_thread(_kill_stragglers, self._plan, slot, token)
                finished = True
            finally:
                if not finished:  # cancelled or failed: nothing may outlive the call
                    self._kill_running(proc, run)
                    if proc.returncode is None:
                        _signal(proc.pid, signal.SIGKILL)
                    _kill_stragglers(self._plan, slot, token)
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
            stderr += f"\n[sandbox: killed after more than {kill_bytes} output bytes]"
        return SandboxResult(status, out.text(), stderr, exit_code, wall_s, peak_mb, out.dropped)

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
