"""The sandbox's limits (`SandboxConfig`), what a run returns (`SandboxResult`), and how a
backend starts the interpreter (`_Plan`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
