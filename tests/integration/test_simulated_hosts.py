"""Simulated hosts (tools/hosts.py): each host has its own hostname, /dev/shm and address; TCP
between hosts crosses the veth link and shows on its counters; `cut` partitions a host and
`restore` joins it again; tear-down leaves nothing, also after the owner was SIGKILLed."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
pytest_plugins = ["simulated_hosts"]

KINDS = ("net", "uts", "mnt", "ipc")
PORT = 7100
SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    conn, _ = server.accept()
    with conn:
        n = 0
        while data := conn.recv(65536):
            n += len(data)
        conn.sendall(str(n).encode())
"""
CLIENT = """
import socket, sys
address, port, size, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
try:
    with socket.create_connection((address, port), timeout=timeout) as conn:
        conn.sendall(b"x" * size)
        conn.shutdown(socket.SHUT_WR)
        print(conn.recv(64).decode())
except OSError as e:
    print(f"failed: {e!r}")
"""


def output(hosts, i: int, argv: list[str]) -> str:
    return hosts.exec(i, argv, capture_output=True, text=True, check=True).stdout.strip()


def namespace_ids(hosts, i: int) -> list[str]:
    """The net, UTS, mount and IPC namespaces a command on host i runs in."""
    return output(hosts, i, ["readlink", *(f"/proc/self/ns/{kind}" for kind in KINDS)]).split()


def test_each_host_has_its_own_hostname_dev_shm_and_namespaces(simulated_hosts, tmp_path):
    hosts = simulated_hosts(2)
    names = [output(hosts, i, ["hostname"]) for i in range(2)]
    assert names == [hosts.hostname(0), hosts.hostname(1)]
    assert socket.gethostname() not in names
    resolve = "import socket, sys; print(socket.gethostbyname(sys.argv[1]))"
    for name, address in ((hosts.hostname(0), hosts.address(0)), (names[1], hosts.address(1))):
        assert output(hosts, 0, [sys.executable, "-c", resolve, name]) == address  # /etc/hosts

    ids = [namespace_ids(hosts, i) for i in range(2)]
    assert namespace_ids(hosts, 0) == ids[0]  # two commands on one host share its namespaces
    root = [os.readlink(f"/proc/self/ns/{kind}") for kind in KINDS]
    for kind, h0, h1, here in zip(KINDS, *ids, root, strict=True):
        assert len({h0, h1, here}) == 3, f"{kind}: {h0} {h1} {here}"

    probe = f"/dev/shm/asyncrl-probe-{hosts.run}"
    hosts.exec(0, ["sh", "-c", f"echo written on h0 > {probe}"], check=True)
    assert output(hosts, 0, ["cat", probe]) == "written on h0"  # another process of host 0
    assert hosts.exec(1, ["test", "-e", probe]).returncode == 1
    assert not Path(probe).exists()

    shared = tmp_path / "written-here"  # /tmp and the rest of the file system are the machine's
    shared.write_text("here")
    assert output(hosts, 1, ["cat", str(shared)]) == "here"
    assert output(hosts, 1, ["pwd"]) == os.getcwd()  # commands run where the caller is


def test_private_tmp_gives_each_host_its_own_tmp(simulated_hosts):
    hosts = simulated_hosts(2, private_tmp=True)
    probe = f"/tmp/asyncrl-probe-{hosts.run}"
    hosts.exec(0, ["touch", probe], check=True)
    assert hosts.exec(0, ["test", "-e", probe]).returncode == 0
    assert hosts.exec(1, ["test", "-e", probe]).returncode == 1
    assert not Path(probe).exists()


def test_the_root_namespace_is_untouched_and_a_hosts_only_route_is_its_link(
    simulated_hosts, hosts_tool
):
    """No link is made in the machine's namespace, and a host has no default route: nothing a
    host sends can leave the run's link."""
    links = [link["ifname"] for link in json.loads(hosts_tool.ip("-j", "link", "show").stdout)]
    hosts = simulated_hosts(2)
    after = [link["ifname"] for link in json.loads(hosts_tool.ip("-j", "link", "show").stdout)]
    assert after == links
    for i in range(2):
        routes = hosts_tool.ip("-j", "-n", hosts.namespace(i), "route", "show").stdout
        assert [(r["dst"], r["dev"]) for r in json.loads(routes)] == [("10.231.0.0/24", "eth0")]


def send(hosts, i: int, to: int, size: int, timeout: float = 5.0) -> str:
    """SIZE bytes over TCP from host I to the server on host TO: its reply or `failed: ...`."""
    argv = [sys.executable, "-c", CLIENT, hosts.address(to), str(PORT), str(size), str(timeout)]
    return output(hosts, i, argv)


def test_tcp_between_hosts_crosses_the_veth_and_cut_restore(simulated_hosts):
    hosts = simulated_hosts(2)
    server = hosts.popen(
        1,
        [sys.executable, "-c", SERVER, hosts.address(1), str(PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout.readline().strip() == "ready"

    size = 200_000
    before = [hosts.counters(i) for i in range(2)]
    assert send(hosts, 0, 1, size) == str(size)
    after = [hosts.counters(i) for i in range(2)]
    assert after[0].tx_bytes - before[0].tx_bytes >= size
    assert after[1].rx_bytes - before[1].rx_bytes >= size

    hosts.cut(1)
    assert hosts.is_cut(1)
    reply = send(hosts, 0, 1, size, timeout=1.0)
    assert reply.startswith("failed: TimeoutError"), reply
    assert hosts.counters(1).rx_bytes == after[1].rx_bytes  # nothing reached host 1

    hosts.restore(1)
    assert not hosts.is_cut(1)
    assert send(hosts, 0, 1, size) == str(size)
    assert hosts.counters(1).rx_bytes - after[1].rx_bytes >= size


def test_down_kills_the_hosts_processes_and_removes_every_namespace(simulated_hosts, hosts_tool):
    tool = hosts_tool
    hosts = simulated_hosts(2)
    sleeper = hosts.popen(1, ["sleep", "600"])
    assert set(hosts.namespaces()) <= set(tool.list_namespaces())

    hosts.down()
    assert sleeper.wait(timeout=10) == -9
    assert all(tool.process_start(pid) is None for pid in hosts.state.holders)
    assert not [ns for ns in tool.list_namespaces() if ns.startswith(f"asyncrl-{hosts.run}-")]
    assert not (tool.STATE_DIR / f"{hosts.run}.json").exists()
    hosts.down()  # a second tear-down (the fixture's) finds nothing to do


def test_sweep_removes_the_run_of_a_sigkilled_owner_and_only_it(simulated_hosts, hosts_tool):
    tool = hosts_tool
    alive = simulated_hosts(1)  # owned by this process: the sweep must leave it
    run = secrets.token_hex(3)
    argv = [sys.executable, tool.__file__, "up", "2", "--run", run, "--hold"]
    owner = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        lines = [owner.stdout.readline() for _ in range(3)]  # the run, then one line a host
        assert lines[0].startswith(f"run {run}: 2 hosts, owner pid {owner.pid}"), lines
        orphaned = tool.SimulatedHosts.attach(run)
        sleeper = orphaned.popen(1, ["sleep", "600"])
    finally:
        owner.kill()
        owner.wait()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"asyncrl-{run}-h1" in namespaces  # a SIGKILL tears nothing down

    swept = subprocess.run([sys.executable, tool.__file__, "sweep"], capture_output=True, text=True)
    assert swept.returncode == 0 and run in swept.stdout, swept
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"asyncrl-{run}-" not in namespaces
    assert sleeper.wait(timeout=10) == -9
    assert all(tool.process_start(pid) is None for pid in orphaned.state.holders)
    assert output(alive, 0, ["hostname"]) == alive.hostname(0)


def test_sweep_removes_namespaces_no_run_claims(simulated_hosts, hosts_tool):
    simulated_hosts(1)  # the fixture's sweep has run
    stray = f"asyncrl-{secrets.token_hex(3)}-h0"
    hosts_tool.ip("netns", "add", stray)
    try:
        assert stray.split("-")[1] in hosts_tool.sweep()
    finally:
        hosts_tool.ip("netns", "del", stray, check=False)
    assert stray not in hosts_tool.list_namespaces()


def test_up_hold_tears_down_on_sigterm(hosts_tool):
    run = secrets.token_hex(3)
    argv = [sys.executable, hosts_tool.__file__, "up", "1", "--run", run, "--hold"]
    owner = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().startswith(f"run {run}: 1 hosts")
        assert f"asyncrl-{run}-h0" in hosts_tool.list_namespaces()
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(timeout=30) == 0
    finally:
        owner.kill()
    assert not [ns for ns in hosts_tool.list_namespaces() if ns.startswith(f"asyncrl-{run}-")]
    assert not (hosts_tool.STATE_DIR / f"{run}.json").exists()
