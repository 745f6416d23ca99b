"""The limits and backend of the sandbox that runs all model-written code (`rollout.sandbox`).

One typed section serves the config tree and the sandbox itself (`rollout_servers.sandbox`), so
the limits a user sets are the limits every run gets. Limits bind the whole run (every process
it starts together) where the machine offers cgroups; docs/sandbox.md says what each backend
isolates and what binds where it does not.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Backend = Literal["bwrap", "unshare", "process"]


class SandboxConfig(BaseModel):
    """Limits of one sandboxed run and how the sandbox isolates it (docs/sandbox.md)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_assignment=True, use_attribute_docstrings=True
    )

    backend: Backend = "bwrap"
    """Isolation: bwrap (bubblewrap, the default and the only one that is a security boundary
    here), or, only when named, unshare or process (weaker: logged loudly at start-up). A
    missing backend fails at start-up with its install command; there is no fallback."""
    wall_timeout_s: float = Field(5.0, gt=0)
    """Wall-clock seconds from spawn until the whole run is SIGKILLed."""
    cpu_seconds: float = Field(5.0, gt=0)
    """CPU seconds of the whole run (every process together, where a cgroup counts them; each
    process's RLIMIT_CPU always)."""
    memory_mb: int = Field(512, gt=0)
    """Memory of the whole run in MiB: resident memory of all its processes and its tmpfs
    files (a cgroup), else a watchdog on the run's resident memory; each process also gets
    RLIMIT_AS at this size, so an allocation past it raises MemoryError."""
    max_processes: int = Field(32, gt=0)
    """Tasks (processes and threads) the run may have alive at once, its own process included."""
    file_size_mb: int = Field(16, gt=0)
    """RLIMIT_FSIZE in MiB: writing a file past it fails with OSError (EFBIG)."""
    tmp_size_mb: int = Field(64, gt=0)
    """Size in MiB of each private tmpfs (/tmp, the working directory, and /dev/shm)."""
    open_files: int = Field(64, gt=0)
    """RLIMIT_NOFILE: descriptors each process may hold open (the run holds at most
    max_processes x this)."""
    output_limit_bytes: int = Field(64 * 1024, gt=0)
    """Bytes kept of each of stdout and stderr; the rest is counted in a truncation marker.
    A trusted caller may keep more of one run's stdout (`Sandbox.run`'s `stdout_limit_bytes`:
    the code reward's claims, `reward.kwargs.max_run_output_bytes`)."""
    output_kill_bytes: int = Field(8 << 20, gt=0)
    """Bytes written to stdout and stderr together after which the run is killed (killed)."""
    max_concurrent: int = Field(4, gt=0)
    """Runs at once; further runs wait for a free slot."""
    site_packages: bool = True
    """Put the interpreter's site-packages on the code's sys.path (numpy, sympy...) without
    running `site` (its .pth files can cost tens of ms per start)."""
    sandbox_uid_base: int = Field(1_900_000_000, gt=0)
    """When the server is root, the code runs as uids claimed from [base, base + 65536).
    No account may use them: every process of a claimed uid is killed after each run."""

    @model_validator(mode="after")
    def _check(self) -> SandboxConfig:
        if self.output_kill_bytes < self.output_limit_bytes:
            raise ValueError("output_kill_bytes must be >= output_limit_bytes")
        return self
