"""Per-run cgroups: the limits that bind a sandboxed run as a whole, not each of its processes.

Every run gets a fresh cgroup (one per controller on cgroup v1, one directory on v2) under this
server's own, created before the run and removed after it:

- memory: `memory.limit_in_bytes` / `memory.max` = the run's memory limit, counting the resident
  memory of all its processes and the tmpfs files they write; past it the kernel's OOM killer
  acts inside the run only (an `oom_kill` event, reported as status "oom");
- pids: `pids.max` = the run's task limit, whatever uid the tasks run as (a fork bomb stops
  there);
- cpu accounting: the run's total CPU time, which the sandbox polls and enforces.

The prelude moves the run's first process into the cgroups (writing "0" to `cgroup.procs`
through descriptors the host opened) before anything else runs, so every process of the run is
inside from its start. After the run, whatever is left in the cgroup is SIGKILLed and the cgroup
removed: nothing of a run is counted against, or visible to, the next.

`CgroupRoot.detect()` returns None where this process cannot create cgroups (not root, no
writable memory controller); the sandbox then falls back to per-process rlimits and a polling
watchdog on the run's resident memory (docs/sandbox.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

_V1_CONTROLLERS = ("memory", "pids", "cpuacct")


@dataclass(frozen=True)
class CgroupRoot:
    """Where this server's per-run cgroups go: one base directory per controller."""

    version: int  # 1 or 2
    bases: dict[str, str]  # controller -> directory (v2: every controller -> the same one)

    @staticmethod
    def detect() -> CgroupRoot | None:
        """The writable cgroup hierarchies below this process's own cgroups, or None."""
        if os.geteuid() != 0:
            return None
        mounts = _mounts()
        own = _own_cgroups()
        v1 = {}
        for controller in _V1_CONTROLLERS:
            for mountpoint, options in mounts.get("cgroup", []):
                if controller in options.split(","):
                    v1[controller] = mountpoint + own.get(controller, "/")
                    break
        if "memory" in v1 and all(_writable(base) for base in v1.values()):
            return CgroupRoot(1, v1)
        for mountpoint, _ in mounts.get("cgroup2", []):
            base = mountpoint + own.get("", "/")
            enabled = _read(os.path.join(base, "cgroup.subtree_control")).split()
            if {"memory", "pids"} <= set(enabled) and _writable(base):
                return CgroupRoot(2, dict.fromkeys(("memory", "pids", "cpu"), base))
        return None

    def create(self, name: str, memory_bytes: int, max_tasks: int) -> RunCgroup:
        """A fresh cgroup for one run, limits set; `RunCgroup.remove` deletes it."""
        dirs = {c: os.path.join(base, name) for c, base in self.bases.items()}
        made: list[str] = []
        try:
            for path in dict.fromkeys(dirs.values()):
                os.mkdir(path, 0o700)
                made.append(path)
            if self.version == 1:
                _write(dirs["memory"], "memory.limit_in_bytes", memory_bytes)
                with contextlib.suppress(OSError):  # swap accounting may be off
                    _write(dirs["memory"], "memory.memsw.limit_in_bytes", memory_bytes)
                if "pids" in dirs:
                    _write(dirs["pids"], "pids.max", max_tasks)
            else:
                _write(dirs["memory"], "memory.max", memory_bytes)
                _write(dirs["memory"], "memory.swap.max", 0)
                _write(dirs["pids"], "pids.max", max_tasks)
            fds = [
                os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
                for path in dict.fromkeys(dirs.values())
            ]
        except BaseException:
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise
        return RunCgroup(self.version, dirs, fds)


class RunCgroup:
    """One run's cgroups: descriptors for the prelude to join, and what the run used."""

    def __init__(self, version: int, dirs: dict[str, str], procs_fds: list[int]) -> None:
        self.version, self.dirs, self.procs_fds = version, dirs, procs_fds

    def oom_kills(self) -> int:
        """Processes of the run the kernel's OOM killer ended."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in _read(os.path.join(self.dirs["memory"], name)).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def cpu_seconds(self) -> float:
        """CPU time of the run's processes so far (0.0 without CPU accounting)."""
        if self.version == 1:
            path = self.dirs.get("cpuacct")
            return int(_read(os.path.join(path, "cpuacct.usage")) or 0) / 1e9 if path else 0.0
        for line in _read(os.path.join(self.dirs["cpu"], "cpu.stat")).splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
        return 0.0

    def peak_memory_bytes(self) -> int:
        """Most memory the run held at once."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return int(_read(os.path.join(self.dirs["memory"], name)) or 0)

    def pids(self) -> list[int]:
        """Processes still in the run's cgroups."""
        found: set[int] = set()
        for path in dict.fromkeys(self.dirs.values()):
            found.update(int(p) for p in _read(os.path.join(path, "cgroup.procs")).split())
        return sorted(found)

    def kill(self) -> None:
        """SIGKILL every process of the run until none is left (a fork racing the kill is
        caught by the next pass)."""
        for _ in range(500):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.002)
        raise RuntimeError(f"sandbox processes survive SIGKILL in {self.dirs['memory']}")

    def remove(self) -> None:
        """Kill what is left and delete the cgroups (their charges go to the parent)."""
        for fd in self.procs_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.procs_fds = []
        self.kill()
        for path in dict.fromkeys(self.dirs.values()):
            for _ in range(200):  # an exiting task may hold the cgroup for a moment
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)


def _mounts() -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for line in _read("/proc/self/mounts").splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2"):
            out.setdefault(fields[2], []).append((fields[1], fields[3]))
    return out


def _own_cgroups() -> dict[str, str]:
    """controller -> this process's cgroup path ("" for the v2 unified hierarchy)."""
    own: dict[str, str] = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _writable(base: str) -> bool:
    probe = os.path.join(base, f"asyncrl-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError:
        return False
    return True


def _write(directory: str, name: str, value: int) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(str(value))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
