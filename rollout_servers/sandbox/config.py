"""What a run returns (`SandboxResult`), how a backend starts the interpreter (`_Plan`), and the
sandbox's constants. The limits (`SandboxConfig`) are the config tree's `rollout.sandbox`
section (`asyncrl.config.sandbox`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncrl.config.sandbox import Backend, SandboxConfig

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


@dataclass
class SandboxResult:
    """How one execution ended, and what it printed (each stream truncated to the limit)."""

    status: Status  # ok | error (non-zero exit) | timeout (wall or CPU) | oom | killed (signal)
    stdout: str  # decoded leniently; ends with "... [truncated N bytes]" when cut
    stderr: str  # idem; tracebacks land here
    exit_code: int | None  # None when the code died by a signal (ours or another)
    wall_s: float  # spawn to reaped, sandbox setup included
    peak_memory_mb: float | None = None  # most memory the whole run held (cgroup), else None
    stdout_dropped: int = 0  # stdout bytes past the limit, counted and not kept


@dataclass(frozen=True)
class _Plan:
    """How a backend starts the interpreter; computed once per Sandbox."""

    backend: str
    prefix: tuple[str, ...]  # argv before the interpreter (bwrap ..., setpriv ... unshare ...)
    prelude_args: tuple[str, ...]  # key=value arguments of the prelude shared by every run
    host_workdir: bool  # run in a fresh host temp dir (no private tmpfs in this backend)
    drops_uid: bool  # the code runs as the slot's uid (server is root)
    pid_namespace: bool  # the tree dies with the namespace's first process


__all__ = ["Backend", "SandboxConfig", "SandboxResult", "Status"]
