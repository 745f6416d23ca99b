"""The sandbox's backends: how each starts the interpreter (a `_Plan`), which one a `Sandbox`
uses, and what one run's command line is.

A plan is made once per `Sandbox` (`_choose_plan`): the configured backend, checked with a probe
run, with no fallback (a missing or broken backend stops the server at start-up, naming what to
install; a weaker one named in the config is logged loudly). Every run then starts from its plan
(`_launch`: argv, environment, working directory). Without a PID namespace (`process`) what a
run left behind is found by its uid or its token (`_kill_stragglers`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from asyncrl.config.sandbox import SandboxConfig
from rollout_servers.sandbox.cgroup import RunCgroup
from rollout_servers.sandbox.config import _MIB, _PRIVATE_TMP, _TOKEN_VAR, _Plan
from rollout_servers.sandbox.host import (
    _bwrap_prefix,
    _hidden_dirs,
    _host_workdir,
    _interpreter_dirs,
    _is_under,
    _limits,
    _memfd,
    _read,
    _sandbox_env,
    _site_dirs,
    _sweep,
    _sweep_uid,
)
from rollout_servers.sandbox.prelude import _PRELUDE

logger = logging.getLogger(__name__)


@dataclass
class _Run:
    """One run's identity: its slot (uid when root), its token, its cgroups (None without)."""

    slot: int
    token: str
    cgroup: RunCgroup | None
    seccomp_fd: int | None = None  # bwrap's filter (other backends: the prelude installs it)


@contextlib.contextmanager
def _launch(
    plan: _Plan, seccomp: bytes, code_fd: int, run: _Run
) -> Iterator[tuple[list[str], dict[str, str], str]]:
    """argv, environment and working directory of one run (the host directory, for backends
    that use one, is removed on exit); `seccomp`: the filter program the prelude installs."""
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(_host_workdir(plan, run.slot)) if plan.host_workdir else None
        interpreter = [sys.executable, "-I", "-S", "-B", "-u", "-c", _PRELUDE]
        argv = list(plan.prefix)
        if run.seccomp_fd is not None:
            argv += ["--seccomp", str(run.seccomp_fd)]
        argv += [*interpreter, *plan.prelude_args, f"code_fd={code_fd}"]
        if plan.backend != "bwrap":
            argv.append(f"seccomp={seccomp.hex()}")
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


def _kill_stragglers(plan: _Plan, slot: int, token: str) -> None:
    """Without a PID namespace (`process`), find what the code left behind (daemons that left
    the process group): every process of the slot's uid, or carrying the run's token in its
    environment (a process that clears its environment escapes this one)."""
    if plan.pid_namespace:
        return
    if plan.drops_uid:
        _sweep_uid(slot)
    marker = f"{_TOKEN_VAR}={token}".encode()
    _sweep(lambda pid: pid != os.getpid() and marker in _read(f"/proc/{pid}/environ"), token)


def _choose_plan(cfg: SandboxConfig, root: bool, seccomp: bytes, slot: int) -> _Plan:
    """The configured backend, checked with a probe run (as `slot`). There is no fallback: a
    missing or broken backend stops the sandbox here (at server start-up) with what to
    install."""
    backend = cfg.backend
    plan = _make_plan(cfg, root, backend)
    reason = plan if isinstance(plan, str) else _probe(plan, seccomp, slot)
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


def _make_plan(cfg: SandboxConfig, root: bool, backend: str) -> _Plan | str:
    """The plan for `backend`, or why it cannot work here (a missing binary)."""
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


def _probe(plan: _Plan, seccomp: bytes, slot: int) -> str | None:
    """Run a tiny program through `plan` (blocking); None when it printed what it should."""
    token = secrets.token_hex(8)
    with contextlib.ExitStack() as stack:
        code_fd = stack.enter_context(_memfd(b"print('sandbox-ok')"))
        argv, env, cwd = stack.enter_context(
            _launch(plan, seccomp, code_fd, _Run(slot, token, None))
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
            _kill_stragglers(plan, slot, token)
    if done.returncode == 0 and done.stdout == b"sandbox-ok\n":
        return None
    tail = done.stderr.decode(errors="replace").strip()[-300:]
    return f"probe run failed (exit {done.returncode}): {tail}"
