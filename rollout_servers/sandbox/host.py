"""The host side of the sandbox: command lines, directories, uids, and sweeping leftovers."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import pwd
import shutil
import signal
import site
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

from asyncrl.config.sandbox import SandboxConfig
from rollout_servers.sandbox.config import (
    _ETC_FILES,
    _MIB,
    _TOP_DIRS,
    _UID_LOCK_DIR,
    _UID_RANGE,
    _Plan,
)

logger = logging.getLogger(__name__)


def _limits(cfg: SandboxConfig, nproc: int) -> str:
    """The prelude's rlimits argument (a negative value leaves that limit as inherited)."""
    cpu = math.ceil(cfg.cpu_seconds)
    values = (cpu, cfg.memory_mb * _MIB, cfg.file_size_mb * _MIB, cfg.open_files)
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


def _pids_of_uid(uid: int) -> list[int]:
    """Live processes whose real or effective uid is `uid`."""
    wanted, found = str(uid).encode(), []
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError):
            if name.isdigit():
                status = _read(f"/proc/{name}/status")
                uids = status.split(b"\nUid:\t", 1)[1].split(b"\n", 1)[0].split()
                if b"\nState:\tZ" not in status and wanted in uids[:2]:
                    found.append(int(name))
    return found


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(_children(current))
    return found


def _rss_bytes(pids: list[int]) -> int:
    """Resident memory of `pids` together (processes that are gone count 0)."""
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(_read(f"/proc/{pid}/statm").split()[1]) * page
    return total


def _sweep_uid(uid: int) -> None:
    wanted = str(uid).encode()

    def runs_as_uid(pid: int) -> bool:
        status = _read(f"/proc/{pid}/status")
        uids = status.split(b"\nUid:\t", 1)[1].split(b"\n", 1)[0].split()
        return b"\nState:\tZ" not in status and wanted in uids[:2]

    _sweep(runs_as_uid, f"uid {uid}")


def _claim_uids(locks: dict[int, int], base: int, count: int) -> None:
    """Claim `count` uids from `base` on that no account and no other Sandbox on this host
    holds (an flock per uid, held until released or exit) into `locks` (uid -> locked fd: the
    caller releases those claimed even when this raises); kill leftovers of a crashed owner."""
    os.makedirs(_UID_LOCK_DIR, mode=0o700, exist_ok=True)
    info = os.stat(_UID_LOCK_DIR)
    if info.st_uid != 0 or info.st_mode & 0o022:
        raise RuntimeError(f"{_UID_LOCK_DIR} must be root's and not group/world-writable")
    for uid in range(base, base + _UID_RANGE):
        if len(locks) == count:
            break
        if _has_account(uid):
            continue
        fd = _lock_uid(uid)
        if fd is None:
            continue
        locks[uid] = fd
        _sweep_uid(uid)
    if len(locks) < count:
        raise RuntimeError(f"fewer than {count} free sandbox uids")


def _lock_path(uid: int) -> str:
    return f"{_UID_LOCK_DIR}/{uid}.lock"


def _lock_uid(uid: int) -> int | None:
    """The locked fd of `uid`'s lock file, or None when another Sandbox holds it. An owner
    removes its file when it releases the uid (`_release_uid`), so a lock taken on a file that
    is no longer the one at the path is worthless: then try again on the new file."""
    while True:
        fd = os.open(_lock_path(uid), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(_lock_path(uid)))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _release_uid(uid: int, fd: int) -> None:
    """Remove `uid`'s lock file while still holding its lock, then drop the lock: nothing of
    the run stays behind in the lock directory (issue 30), and a claimer that opened the old
    file sees it is gone (`_lock_uid`)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_lock_path(uid))
    os.close(fd)
