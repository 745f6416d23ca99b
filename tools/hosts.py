"""Simulated hosts on one machine: network namespaces with their own address, hostname and
/dev/shm, joined by veth links to a Linux bridge, for testing asyncrl across hosts (issue 42).

    python tools/hosts.py up N [--run ID] [--owner PID | --hold] [--shm-size 2g] [--private-tmp]
    python tools/hosts.py exec [--run ID] HOST -- CMD...
    python tools/hosts.py cut|restore [--run ID] HOST
    python tools/hosts.py down [--run ID]
    python tools/hosts.py sweep | list

HOST is an index (`0`) or `h0`. --run defaults to a new random id for `up`, and to the only run
for the others. `list` shows every run, its hosts and their eth0 counters (rx/tx bytes). Root
only; needs iproute2 (`ip`), util-linux (`unshare`, `nsenter`, `mount`) and `hostname`: without
them every command refuses, naming what is missing (exit status 2).

What one run of N hosts is (names are per run, so that runs never meet):
1. a "switch" namespace `asyncrl-RUN-sw` holding a bridge `br0`; the root namespace is never
   touched (every link is created inside the run's namespaces);
2. per host i, a namespace `asyncrl-RUN-hI` with `lo` and `eth0` (address 10.231.S.(i+1)/24,
   S = --subnet, default 0), the other end of the veth pair being port `pI` of the bridge;
3. per host, a holder process (`sleep infinity`) in the host's namespace and in a UTS, mount and
   IPC namespace of its own (`unshare --uts --mount --ipc --propagation private`): hostname
   `sim-RUN-hI`, a tmpfs on /dev/shm, with --private-tmp a tmpfs on /tmp (else /tmp is the
   machine's), and an /etc/hosts naming every host. A command "on" the host joins the holder's
   namespaces (`nsenter`): commands on one host share its /dev/shm, hosts do not;
4. a state file /run/asyncrl-hosts/RUN.json (written before anything is made; RUN.hosts next
   to it) with the owner's pid and start time: `sweep` (run by every `up`) tears down each run
   whose owner is dead, and every `asyncrl-*` namespace that no state file claims.

Tear-down SIGKILLs every process in the run's namespaces (`ip netns pids`), then deletes the
namespaces (their veth links go with them) and the run's files. Shared by every host: the
kernel, the boot id, the PID namespace, the file system (but /dev/shm, and /tmp with
--private-tmp), the CPUs and GPUs. `cut` detaches the host's port from the bridge: its link
stays up and its packets are dropped silently (a partition, so connections time out rather than
fail at once); `restore` attaches it again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from subprocess import DEVNULL, PIPE, Popen
from typing import Any, NamedTuple

PREFIX = "asyncrl-"
STATE_DIR = Path("/run/asyncrl-hosts")
RUN_ID = re.compile(r"^[a-z0-9]{1,8}$")
NAMESPACE = re.compile(r"^asyncrl-([a-z0-9]{1,8})-(sw|h\d+)$")
REQUIRED_COMMANDS = dict(ip="iproute2", unshare="util-linux", nsenter="util-linux")
REQUIRED_COMMANDS.update(mount="util-linux", hostname="hostname")
"""The commands a run needs, each with the package that provides it."""
KILL_WAIT_S = 10.0

# The holder of a host's UTS, mount and IPC namespaces: names the host, mounts its /dev/shm (and
# /tmp) and the run's /etc/hosts, prints its pid (the shell's: `exec` keeps it), sleeps forever.
HOLDER_SCRIPT = (
    'hostname "$1" && mount -t tmpfs -o "size=$2,mode=1777" tmpfs /dev/shm && '
    '{ [ "$3" = 0 ] || mount -t tmpfs -o mode=1777 tmpfs /tmp; } && '
    'mount --bind "$4" /etc/hosts && echo $$ && exec sleep infinity >/dev/null 2>&1 </dev/null'
)


class HostsUnavailable(RuntimeError):
    """Simulated hosts cannot be made here; the message names what is missing."""


class Counters(NamedTuple):
    """Bytes through a host's `eth0` since the run came up (the kernel's interface counters)."""

    rx_bytes: int
    tx_bytes: int


def missing_requirements() -> list[str]:
    """What this machine lacks for simulated hosts, one reason each; empty when nothing."""
    reasons = []
    if os.geteuid() != 0:
        reasons.append(f"root is needed (namespaces, links, mounts); running as uid {os.geteuid()}")
    for command, package in REQUIRED_COMMANDS.items():
        if shutil.which(command) is None:
            reasons.append(f"`{command}` ({package}) is not installed")
    if not Path("/proc/self/ns/net").exists():
        reasons.append("the kernel has no network namespaces (/proc/self/ns/net)")
    return reasons


def require_hosts() -> None:
    """Raises HostsUnavailable naming every missing requirement."""
    reasons = missing_requirements()
    if reasons:
        raise HostsUnavailable("simulated hosts are unavailable: " + "; ".join(reasons))


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`ip ARGS...`, its output captured; a failure raises with ip's own message."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def process_start(pid: int) -> int | None:
    """The start time of a live process (clock ticks since boot), None when it is gone or a
    zombie: a pid with another start time is another process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


@dataclass
class RunState:
    """What a run made and who owns it: the contents of its state file."""

    run: str
    n: int
    owner_pid: int
    owner_start: int | None
    subnet: int = 0
    shm_size: str = "2g"
    private_tmp: bool = False
    holders: list[int] = field(default_factory=list)

    def owner_alive(self) -> bool:
        start = process_start(self.owner_pid)
        return start is not None and start == self.owner_start


class SimulatedHosts:
    """N simulated hosts of one run; `up` makes them, `down` removes exactly what it made.

    Also a context manager (up on enter, down on exit). The owner is this process unless given:
    once it is dead, `sweep` removes the run."""

    def __init__(
        self,
        n: int,
        run: str | None = None,
        owner: int | None = None,
        subnet: int = 0,
        shm_size: str = "2g",
        private_tmp: bool = False,
        state_dir: Path = STATE_DIR,
    ) -> None:
        run = run or secrets.token_hex(3)
        if not RUN_ID.match(run):
            raise ValueError(f"run id {run!r}: 1 to 8 of a-z and 0-9")
        if not 1 <= n <= 250 or not 0 <= subnet <= 255:
            raise ValueError(f"{n} hosts on subnet {subnet}: 1 to 250 hosts, subnet 0 to 255")
        owner = os.getpid() if owner is None else owner
        self.state = RunState(run, n, owner, process_start(owner), subnet, shm_size, private_tmp)
        self.state_dir = state_dir
        self._holders: list[subprocess.Popen] = []  # reaped by down (a dead holder is a zombie)

    @classmethod
    def attach(cls, run: str, state_dir: Path = STATE_DIR) -> SimulatedHosts:
        """The run made earlier (by this or another process), from its state file."""
        path = state_dir / f"{run}.json"
        if not path.exists():
            raise HostsUnavailable(f"no run {run!r} (no {path})")
        hosts = cls.__new__(cls)
        hosts.state = RunState(**json.loads(path.read_text()))
        hosts.state_dir, hosts._holders = state_dir, []
        return hosts

    # ---- names ---------------------------------------------------------------------------

    run = property(lambda self: self.state.run)
    n = property(lambda self: self.state.n)

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.run}-sw"

    def namespace(self, i: int) -> str:
        return f"{PREFIX}{self.run}-h{self._index(i)}"

    def hostname(self, i: int) -> str:
        return f"sim-{self.run}-h{self._index(i)}"

    def address(self, i: int) -> str:
        """Host i's address on the run's link."""
        return f"10.231.{self.state.subnet}.{self._index(i) + 1}"

    def namespaces(self) -> list[str]:
        return [self.namespace(i) for i in range(self.n)] + [self.switch]

    def _index(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"host {i} of a run of {self.n} hosts")
        return i

    def _file(self, suffix: str) -> Path:
        """The run's state file (`json`) or its /etc/hosts (`hosts`)."""
        return self.state_dir / f"{self.run}.{suffix}"

    # ---- up and down ---------------------------------------------------------------------

    def up(self) -> SimulatedHosts:
        """Makes the run's namespaces, links and holders (sweeping stale runs first); on any
        failure, removes what it made and raises."""
        require_hosts()
        sweep(self.state_dir)
        if self._file("json").exists():
            raise HostsUnavailable(f"run {self.run!r} exists ({self._file('json')})")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._write_state()  # before anything is made: sweep must see every namespace's owner
        try:
            self._make_links()
            names = "".join(f"{self.address(i)} {self.hostname(i)}\n" for i in range(self.n))
            self._file("hosts").write_text(Path("/etc/hosts").read_text() + names)
            self.state.holders = [self._start_holder(i) for i in range(self.n)]
            self._write_state()
        except BaseException:
            self.down()
            raise
        return self

    def _make_links(self) -> None:
        try:
            ip("netns", "add", self.switch)
        except RuntimeError as e:  # the first namespace: a container may forbid them
            raise HostsUnavailable(f"simulated hosts are unavailable: {e}") from e
        # addrgenmode none: no IPv6 link-local address, so no chatter on the counters
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "addrgenmode", "none")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.n):
            ns = self.namespace(i)
            ip("netns", "add", ns)
            ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}")
            ip("-n", ns, "link", "set", f"p{i}", "netns", self.switch)
            ip("-n", ns, "link", "set", "eth0", "addrgenmode", "none")
            ip("-n", self.switch, "link", "set", f"p{i}", "addrgenmode", "none")
            ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", "eth0", "up")

    def _start_holder(self, i: int) -> int:
        private_tmp = "1" if self.state.private_tmp else "0"
        argv = ["ip", "netns", "exec", self.namespace(i)]
        argv += ["unshare", "--uts", "--mount", "--ipc", "--propagation", "private"]
        argv += ["sh", "-c", HOLDER_SCRIPT, "_", self.hostname(i), self.state.shm_size]
        argv += [private_tmp, str(self._file("hosts"))]
        # a daemon (a session of its own): it outlives the tool, and sweep or down removes it
        holder = Popen(argv, stdin=DEVNULL, stdout=PIPE, stderr=PIPE, start_new_session=True)
        assert holder.stdout is not None and holder.stderr is not None
        line = holder.stdout.readline().strip()
        holder.stdout.close()
        if not line.isdigit():
            holder.wait()
            raise RuntimeError(f"host {i}'s holder failed: {holder.stderr.read().decode()}")
        holder.stderr.close()
        self._holders.append(holder)
        return int(line)

    def down(self) -> None:
        """Kills every process in the run's namespaces, deletes the namespaces (and so their
        links) and the state file. Removes only what exists; safe to call twice."""
        existing = set(list_namespaces())
        mine = [ns for ns in self.namespaces() if ns in existing]
        kill_processes_in(mine)
        for ns in mine:
            ip("netns", "del", ns, check=False)
        for holder in self._holders:
            holder.wait()
        left = set(mine) & set(list_namespaces())
        if left:
            raise RuntimeError(f"namespaces of run {self.run} left behind: {sorted(left)}")
        self._file("hosts").unlink(missing_ok=True)
        self._file("json").unlink(missing_ok=True)

    def _write_state(self) -> None:
        self._file("json").write_text(json.dumps(asdict(self.state)))

    def __enter__(self) -> SimulatedHosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---- commands on a host --------------------------------------------------------------

    def command(self, i: int, argv: list[str], cwd: str | Path | None = None) -> list[str]:
        """The argv that runs ARGV on host i: in its network, UTS, mount and IPC namespaces,
        in CWD (this process's working directory unless given)."""
        holder = self.state.holders[self._index(i)]
        enter = ["nsenter", f"--target={holder}", "--net", "--uts", "--mount", "--ipc"]
        return [*enter, f"--wd={cwd or os.getcwd()}", "--", *argv]

    def exec(self, i: int, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """subprocess.run of ARGV on host i (keyword arguments as subprocess.run takes them)."""
        return subprocess.run(self.command(i, argv, kwargs.pop("cwd", None)), **kwargs)

    def popen(self, i: int, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """subprocess.Popen of ARGV on host i; `down` kills it if it still runs."""
        return subprocess.Popen(self.command(i, argv, kwargs.pop("cwd", None)), **kwargs)

    # ---- the link ------------------------------------------------------------------------

    def cut(self, i: int) -> None:
        """Partitions host i: its bridge port leaves the bridge, so its packets go nowhere."""
        ip("-n", self.switch, "link", "set", f"p{self._index(i)}", "nomaster")

    def restore(self, i: int) -> None:
        """Joins host i to the bridge again."""
        ip("-n", self.switch, "link", "set", f"p{self._index(i)}", "master", "br0")

    def is_cut(self, i: int) -> bool:
        port = json.loads(ip("-j", "-n", self.switch, "link", "show", f"p{i}").stdout)
        return "master" not in port[0]

    def counters(self, i: int) -> Counters:
        """Bytes received and sent by host i's eth0."""
        link = json.loads(ip("-j", "-s", "-n", self.namespace(i), "link", "show", "eth0").stdout)
        stats = link[0]["stats64"]
        return Counters(stats["rx"]["bytes"], stats["tx"]["bytes"])


def list_namespaces() -> list[str]:
    """The names of this machine's named network namespaces."""
    done = ip("-j", "netns", "list", check=False)
    if done.returncode != 0 or not done.stdout.strip():
        return []
    return [entry["name"] for entry in json.loads(done.stdout)]


def kill_processes_in(namespaces: list[str]) -> None:
    """SIGKILLs every process in NAMESPACES (never this one) until none is left."""
    deadline = time.monotonic() + KILL_WAIT_S
    while True:
        pids = set()
        for ns in namespaces:
            pids |= {int(p) for p in ip("netns", "pids", ns, check=False).stdout.split()}
        pids.discard(os.getpid())
        if not pids:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes in {namespaces} survive SIGKILL: {sorted(pids)}")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def live_runs(state_dir: Path = STATE_DIR) -> list[RunState]:
    """Every run with a state file, its owner alive or not."""
    paths = sorted(state_dir.glob("*.json")) if state_dir.is_dir() else []
    return [RunState(**json.loads(p.read_text())) for p in paths]


def sweep(state_dir: Path = STATE_DIR) -> list[str]:
    """Tears down every run whose owner is dead, and every `asyncrl-*` namespace no state file
    claims (made outside this tool's bookkeeping); returns the runs removed.

    The namespaces are listed before the state files are read: a run's state file is written
    before its first namespace, so a run coming up in another process is never taken for an
    orphan."""
    namespaces = list_namespaces()
    runs = live_runs(state_dir)
    removed = []
    for state in runs:
        if not state.owner_alive():
            SimulatedHosts.attach(state.run, state_dir).down()
            removed.append(state.run)
    claimed = {state.run for state in runs}
    orphans = {ns: m[1] for ns in namespaces if (m := NAMESPACE.match(ns)) and m[1] not in claimed}
    if orphans:
        kill_processes_in(list(orphans))
        for ns in orphans:
            ip("netns", "del", ns, check=False)
        removed += sorted(set(orphans.values()))
    return removed


# ---- the command line --------------------------------------------------------------------------


def pick_run(run: str | None) -> SimulatedHosts:
    """The run named, or the only run with a state file."""
    if run is not None:
        return SimulatedHosts.attach(run)
    runs = [state.run for state in live_runs()]
    if len(runs) != 1:
        raise HostsUnavailable(f"{len(runs)} runs ({', '.join(runs) or 'none'}): pass --run ID")
    return SimulatedHosts.attach(runs[0])


def host_index(text: str) -> int:
    """`1` or `h1` -> 1."""
    return int(text.removeprefix("h"))


def describe(hosts: SimulatedHosts) -> list[str]:
    """One line per host: namespace, hostname, address, holder pid, counters and link state."""
    state = hosts.state
    alive = "alive" if state.owner_alive() else "dead"
    lines = [f"run {state.run}: {state.n} hosts, owner pid {state.owner_pid} ({alive})"]
    for i in range(hosts.n):
        rx, tx = hosts.counters(i)
        link = "cut" if hosts.is_cut(i) else "up"
        lines.append(
            f"  h{i}  {hosts.namespace(i)}  {hosts.hostname(i)}  {hosts.address(i)}  "
            f"holder {state.holders[i]}  link {link}  rx {rx} B  tx {tx} B"
        )
    return lines


def hold_until_signalled(hosts: SimulatedHosts) -> None:
    """Keeps the run up until SIGINT or SIGTERM, then tears it down (`up --hold`)."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            signal.pause()
    except KeyboardInterrupt:
        hosts.down()
        print(f"run {hosts.run} down", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="make N hosts")
    up.add_argument("n", type=int)
    up.add_argument("--run", help="run id (1 to 8 of a-z0-9); a random one when not given")
    owner = up.add_mutually_exclusive_group()
    owner.add_argument("--owner", type=int, help="owner pid (default: the caller, e.g. a shell)")
    owner.add_argument("--hold", action="store_true", help="own the run until SIGINT/SIGTERM")
    up.add_argument("--subnet", type=int, default=0, help="addresses 10.231.SUBNET.(i+1)")
    up.add_argument("--shm-size", default="2g", help="each host's /dev/shm tmpfs size")
    up.add_argument("--private-tmp", action="store_true", help="a tmpfs /tmp for each host")
    for name in ("down", "exec", "cut", "restore"):
        command = commands.add_parser(name)
        command.add_argument("--run", help="run id; the only run when not given")
        if name in ("exec", "cut", "restore"):
            command.add_argument("host", type=host_index, help="index (0) or h0")
        if name == "exec":
            command.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD...")
    commands.add_parser("sweep", help="remove the runs whose owner is dead")
    commands.add_parser("list", help="every run and its hosts")
    return parser.parse_args(argv)


def run_command(args: argparse.Namespace) -> int:
    if args.command == "up":
        owner = os.getpid() if args.hold else (args.owner or os.getppid())
        hosts = SimulatedHosts(
            args.n, args.run, owner, args.subnet, args.shm_size, args.private_tmp
        ).up()
        print("\n".join(describe(hosts)), flush=True)
        if args.hold:
            hold_until_signalled(hosts)
    elif args.command == "sweep":
        print(f"removed runs: {' '.join(sweep()) or 'none'}")
    elif args.command == "list":
        for state in live_runs():
            print("\n".join(describe(SimulatedHosts.attach(state.run))))
    elif args.command == "down":
        pick_run(args.run).down()
    elif args.command == "exec":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            raise HostsUnavailable("exec HOST -- CMD...: no command")
        argv = pick_run(args.run).command(args.host, cmd)
        os.execvp(argv[0], argv)
    elif args.command in ("cut", "restore"):
        getattr(pick_run(args.run), args.command)(args.host)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        require_hosts()
        return run_command(args)
    except HostsUnavailable as e:
        print(f"hosts.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
