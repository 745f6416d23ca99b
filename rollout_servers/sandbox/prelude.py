"""The trusted Python that starts every sandboxed run, inside the sandbox, before the code."""

# Runs inside the sandbox as `python -I -S -B -u -c _PRELUDE key=value...`, before the code:
# 0. into the run's cgroups (descriptors the host opened), before any other process exists;
# 1. (unshare as root) mounts: a tmpfs over each directory that hides the interpreter from other
#    users (e.g. /root, mode 0700) with the interpreter bound back, private tmpfs on /tmp,
#    /var/tmp, /dev/shm (an interpreter below them bound back read-only);
# 2. a supervisor fork: the code's parent and, under bwrap and unshare, PID 1; it reaps orphans
#    and reports a signal death as exit code 128+N;
# 3. the drop to the sandbox uid, no_new_privs, the seccomp filter (`seccomp.py`), rlimits;
# 4. the code as __main__, named ./main.py but never written to disk (tracebacks still show its
#    lines, and not the prelude's frame).
_PRELUDE = r"""
import os, sys
arg = dict(a.split("=", 1) for a in sys.argv[1:])
for cg in filter(None, arg.get("cgroup_fds", "").split(",")):
    os.write(int(cg), b"0")  # this process, and so every later one, into the run's cgroups
    os.close(int(cg))
def check(name, *args):
    import ctypes  # only backends that need libc pay for the import (not bwrap)
    libc = ctypes.CDLL(None, use_errno=True)
    args = [ctypes.c_ulong(a) if isinstance(a, int) else a for a in args]
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, name + ": " + os.strerror(err))
if "pdeath" in arg:
    check("prctl", 1, 9, 0, 0, 0)
    if os.getppid() != int(arg["pdeath"]):
        os._exit(70)
for line in filter(None, arg.get("expose", "").split("\n")):
    top, *paths = line.split("\t")
    fds = [os.open(p, os.O_PATH) for p in paths]
    check("mount", b"tmpfs", top.encode(), b"tmpfs", 6, b"mode=755,size=1m")
    for p, fd in zip(paths, fds):
        os.makedirs(p, exist_ok=True)
        check("mount", b"/proc/self/fd/%d" % fd, p.encode(), None, 0x5000, None)
        os.close(fd)
if "tmp_bytes" in arg:
    keep = [p for p in arg.get("rebind", "").split("\n") if p]
    fds = [os.open(p, os.O_PATH) for p in keep]
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(d):
            opts = b"mode=1777,size=" + arg["tmp_bytes"].encode()
            check("mount", b"tmpfs", d.encode(), b"tmpfs", 6, opts)
    for p, fd in zip(keep, fds):  # an interpreter under /tmp (a CI virtualenv), read-only
        os.makedirs(p, mode=0o755, exist_ok=True)
        check("mount", b"/proc/self/fd/%d" % fd, p.encode(), None, 0x5000, None)
        check("mount", None, p.encode(), None, 0x1021, None)
        os.close(fd)
    os.chdir("/tmp")
fd = int(arg["code_fd"])
chunks = []
while chunk := os.read(fd, 1 << 20):
    chunks.append(chunk)
os.close(fd)
src = b"".join(chunks)
if "supervise" in arg:
    import gc
    gc.freeze()  # fewer copy-on-write faults in the child (~1 ms)
    child = os.fork()
    if child:
        status = 0
        while True:
            try:
                pid, st = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == child:
                status = st
                break
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    if "pdeath" in arg:
        check("prctl", 1, 9, 0, 0, 0)
if "uid" in arg:
    uid = int(arg["uid"])
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
if "seccomp" in arg:  # bwrap installs the filter itself (--seccomp)
    import ctypes
    check("prctl", 38, 1, 0, 0, 0)  # no_new_privs, which an unprivileged filter needs
    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    bpf = bytes.fromhex(arg["seccomp"])
    bpf_buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _Prog(len(bpf) // 8, ctypes.cast(bpf_buf, ctypes.c_void_p))
    check("prctl", 22, 2, ctypes.addressof(prog), 0, 0)  # PR_SET_SECCOMP, FILTER
import resource
cpu, mem, fsize, nofile, nproc = map(int, arg["limits"].split(","))
for what, soft, hard in (
    (resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
    (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NOFILE, nofile, nofile),
    (resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_CORE, 0, 0),
):
    cap = resource.getrlimit(what)[1]
    if soft < 0:
        continue
    if cap != resource.RLIM_INFINITY:
        soft, hard = min(soft, cap), min(hard, cap)
    resource.setrlimit(what, (soft, hard))
path = os.path.join(os.getcwd(), "main.py")
sys.argv = [path]
sys.path[:0] = [os.getcwd()]
sys.path += list(filter(None, arg.get("site", "").split("\n")))
import builtins, _sitebuiltins
builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
prelude_main = sys.modules["__main__"]
main = type(sys)("__main__")
main.__builtins__ = builtins
sys.modules["__main__"] = main
try:
    exec(compile(src, path, "exec"), main.__dict__)
except SystemExit:
    raise
except BaseException as exc:
    if isinstance(exc, MemoryError):
        main.__dict__.clear()
    import linecache, traceback
    lines = [line.rstrip("\n") + "\n" for line in src.decode("utf-8", "replace").splitlines()]
    linecache.cache[path] = (len(src), None, lines, path)
    traceback.print_exception(exc.with_traceback(exc.__traceback__.tb_next))
    sys.exit(1)
"""
