"""Every listening socket of a run binds to loopback unless launch.allow_remote says otherwise
(DESIGN.md, wire protocol): the replay's ZeroMQ socket, both torch TCPStores (the FSDP group's
and the weight-sync group's) and every gloo pair listener, in every process of a real run with
two rollout servers and two learner ranks; under `launch.backend=ray` also the local Ray
cluster's servers (GCS, raylet, agents, every worker's gRPC server). A wider host, allowed,
still works.

The listeners are read from /proc (not from `ss`): /proc/net/tcp and /proc/net/tcp6 give every
listening socket (state 0A) with its inode, and /proc/<pid>/fd maps inodes to the processes of
the run (the launcher and its descendants), sampled all through the run.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from socket import AF_INET, AF_INET6
from threading import Thread

import psutil
import pytest
import torch

from asyncrl.weights.group import SyncGroup
from asyncrl.wire.sockets import free_port

pytestmark = pytest.mark.integration

TCP_LISTEN = "0A"


def _parse_address(text: str) -> tuple[str, int]:
    """'0100007F:1F90' or a 32-hex-digit IPv6 address (four host-order words) -> (ip, port)."""
    hex_ip, hex_port = text.split(":")
    raw = bytes.fromhex(hex_ip)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each word is host-order
    return str(ipaddress.ip_address(raw)), int(hex_port, 16)


def listening_inodes() -> dict[int, tuple[str, int]]:
    """socket inode -> (ip, port) of every listening TCP socket (IPv4 and IPv6) of this host's
    network namespace."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)  # header
            for line in f:
                fields = line.split()
                if fields[3] == TCP_LISTEN:
                    found[int(fields[9])] = _parse_address(fields[1])
    return found


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds open ({} once it is gone)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def _label(p: psutil.Process) -> str | None:
    """The run's name for a process (ASYNCRL_PROCESS), else its title (gcs_server,
    ray::FleetProcess, ...); None once it is gone."""
    try:
        return p.environ().get("ASYNCRL_PROCESS") or Path(p.cmdline()[0]).name
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, IndexError):
        return None


def run_listeners(proc: subprocess.Popen, timeout_s: float) -> dict[str, set[tuple[str, int]]]:
    """Sample until `proc` ends: 'label (pid)' -> every (ip, port) that process (`proc` or a
    descendant) was seen listening on."""
    seen: dict[int, set[tuple[str, int]]] = {}
    labels: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the run did not finish in time"
        try:
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        listening = listening_inodes()
        for p in family:
            if (label := _label(p)) is not None:
                labels[p.pid] = label
            bound = {listening[i] for i in socket_inodes(p.pid) if i in listening}
            seen.setdefault(p.pid, set()).update(bound)
        time.sleep(0.2)
    return {f"{labels.get(pid, '?')} ({pid})": addrs for pid, addrs in seen.items()}


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _wide_interface() -> str | None:
    """A network interface of this machine that is up and not loopback (None if there is
    none: then nothing can listen beyond loopback but a wildcard, which the test sees)."""
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        ips = [a.address.split("%")[0] for a in addrs if a.family in (AF_INET, AF_INET6)]
        if name in stats and stats[name].isup and ips and not any(map(is_loopback, ips)):
            return name
    return None


def test_proc_net_addresses_decode():
    assert _parse_address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert _parse_address("00000000:0016") == ("0.0.0.0", 22)
    assert _parse_address("00000000000000000000000001000000:0050") == ("::1", 80)
    assert _parse_address("00000000000000000000000000000000:0050") == ("::", 80)
    ip, _ = _parse_address("0000000000000000FFFF00000100007F:0050")
    assert ipaddress.ip_address(ip) == ipaddress.ip_address("::ffff:127.0.0.1")
    assert is_loopback("::ffff:127.0.0.1") and not is_loopback("::") and is_loopback("::1")


@pytest.mark.long  # 40 s a run: its own CI step (the default tier stays under 15 min)
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_every_listening_socket_of_a_run_is_loopback(tmp_path, backend):
    """Two servers and a two-rank learner, a few steps. gloo is pointed at a non-loopback
    interface through the environment, as a machine whose hostname resolves to its network
    address would point it: the run must bind loopback all the same."""
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "asyncrl.launch.cli",
        "launch",
        f"launch.backend={backend}",
        f"trainer.run_dir={run_dir}",
        f"trainer.cache_dir={tmp_path / 'cache'}",
        "trainer.warmstart_steps=10",
        "trainer.total_steps=3",
        "learner.world_size=2",
        "learner.micro_batch_size=8",
        "rollout.num_servers=2",
        "rollout.n=4",
        "rollout.max_concurrent_groups=4",
        "data.train_batch_size=4",
        "launch.progress=none",
        "launch.startup_timeout_s=120",
    ]
    env = dict(os.environ)
    if (wide := _wide_interface()) is not None:
        env["GLOO_SOCKET_IFNAME"] = wide
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        seen = run_listeners(proc, timeout_s=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err

    # the sampling saw the run's listeners (so an empty result cannot pass for a confined one):
    # the replay's ZeroMQ socket, both stores, and every fleet process (gloo pair listeners)
    spec = json.loads((run_dir / "launch.json").read_text())
    ports = {port for addrs in seen.values() for _, port in addrs}
    replay_port = int(spec["replay_address"].rsplit(":", 1)[1])
    assert {replay_port, spec["sync_port"], spec["learner_master_port"]} <= ports, seen
    names = ["replay", "server_0", "server_1", "learner_0", "learner_1"]
    if backend == "ray":  # and the local cluster's own servers
        names += ["gcs_server", "raylet"]
    for name in names:
        assert any(label.startswith(name + " ") and a for label, a in seen.items()), seen
    wide_binds = {p: sorted(a for a in addrs if not is_loopback(a[0])) for p, addrs in seen.items()}
    wide_binds = {p: addrs for p, addrs in wide_binds.items() if addrs}
    assert not wide_binds, f"non-loopback listeners with launch.allow_remote=false: {wide_binds}"


def _own_listeners() -> set[tuple[str, int]]:
    listening = listening_inodes()
    return {listening[i] for i in socket_inodes(os.getpid()) if i in listening}


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_sync_group_listens_on_its_host(host, monkeypatch):
    """The weight-sync group (two ranks, on two threads here) broadcasts, its store listens on
    the host only (not [::]), and on loopback every gloo listener is loopback too; 0.0.0.0
    (a config with allow_remote) is where the store then listens."""
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # restored after the test
        monkeypatch.delenv(var, raising=False)
    before = _own_listeners()
    port = free_port()
    groups: list[SyncGroup | None] = [None, None]
    got = torch.zeros(3)

    def join(rank: int) -> None:
        groups[rank] = group = SyncGroup(host, port, rank, 2, torch.device("cpu"), 30.0)
        group.broadcast(torch.arange(3.0) if rank == 0 else got)

    threads = [Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert torch.equal(got, torch.arange(3.0))
    new = _own_listeners() - before
    assert (host, port) in new and ("::", port) not in new, new
    if host == "127.0.0.1":
        assert all(is_loopback(ip) for ip, _ in new), new
    groups.clear()
