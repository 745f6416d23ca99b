"""/dev/shm as the weight sync uses it, without torch: where it is, what is free, the names of
asyncrl's segments, and the sweep that removes what dead processes left there
(`asyncrl.weights.transports` makes and maps the segments; the launchers sweep at the end of a
run and must not pay for a torch import to do it).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
from collections.abc import Collection
from pathlib import Path

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "asyncrl-ws-"
"""Every segment is `asyncrl-ws-<learner pid>-<its pid namespace>-<tag>`: pid and namespace let a
later learner of the same namespace tell whether its maker is gone (`sweep_dead_segments`)."""
SEGMENT_NAME = re.compile(r"asyncrl-ws-(\d{1,10})-(\d{1,20})-[A-Za-z0-9_-]{1,64}")
_CUDA_IPC_FILE = re.compile(r"cuda\.shm\.\d{1,10}\.([0-9a-f]{1,8})\.\d{1,10}")
"""The file CUDA's driver leaves in /dev/shm for a process that exported an IPC handle
(`cuda.shm.<n>.<pid in hex>.<n>`, seen on an H200): it outlives the process."""
_TORCH_FILE = re.compile(r"torch_(\d{1,10})_\d{1,20}_\d{1,10}")
"""A file torch makes in /dev/shm for a process's shared tensors and its CUDA IPC reference
counters (`torch_<pid>_<n>_<n>`, seen on an H200): left behind when that process is killed."""


def host_id() -> str:
    """This machine as a weight sync compares it: boot id (one kernel) and hostname."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{boot}/{socket.gethostname()}"


def shm_free_bytes() -> int | None:
    """Bytes free in /dev/shm, None when this machine has none."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def identity(path: str) -> str:
    """ "device:inode" of `path` ("" when it cannot be read): the same file seen from two
    processes, or not."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def segment_name(tag: str) -> str:
    """A new segment's name: this process's pid and pid namespace, `tag`, a random suffix."""
    return f"{SEGMENT_PREFIX}{os.getpid()}-{_pid_ns()}-{tag}-{secrets.token_hex(4)}"


def unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def sweep_dead_segments(started: Collection[int] = ()) -> list[str]:
    """Unlink what dead processes left in /dev/shm; returns the names. Only files this user
    owns: asyncrl's segments made in this pid namespace by a process that is gone, and the files
    CUDA's driver and torch leave for a process (`cuda.shm.*`, `torch_<pid>_*`) when that process
    is one of `started` (the launcher's own, now ended): a pid means nothing across namespaces,
    and a /dev/shm may be shared with other jobs."""
    swept, ns, uid = [], _pid_ns(), os.geteuid()
    with contextlib.suppress(OSError):
        for path in SHM_DIR.iterdir():
            pid = _dead_owner(path.name, ns, set(started))
            if pid is None:
                continue
            with contextlib.suppress(OSError):
                if path.lstat().st_uid != uid:
                    continue
                path.unlink()
                swept.append(path.name)
    return swept


def _dead_owner(name: str, ns: str, started: set[int]) -> int | None:
    """The pid that made a file `sweep_dead_segments` may remove, if that process is gone."""
    ours = SEGMENT_NAME.fullmatch(name)
    if ours is not None:
        pid = int(ours.group(1))
        return pid if ours.group(2) == ns and not _alive(pid) else None
    for pattern, base in ((_TORCH_FILE, 10), (_CUDA_IPC_FILE, 16)):
        m = pattern.fullmatch(name)
        if m is not None:
            pid = int(m.group(1), base)
            return pid if pid in started and not _alive(pid) else None
    return None


def _pid_ns() -> str:
    """This process's pid namespace, by inode ("0" when it cannot be read)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's, or no pid at all: not ours to judge
    return True
