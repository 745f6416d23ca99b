"""asyncrl.wire.binds: which interface a host is on, the environment that binds gloo/NCCL there, and
the listening socket a TCPStore master is given (its store test, with real process groups, is
in tests/integration/test_binds.py)."""

import ipaddress
import os
import socket

import psutil
import pytest

from asyncrl.wire.binds import bind_collectives_to, host_interface, listening_socket

VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _interface_of(ip: str) -> str:
    """The interface psutil lists with `ip` (an independent reading of the same table)."""
    return next(
        name
        for name, addrs in psutil.net_if_addrs().items()
        for a in addrs
        if a.address.split("%")[0] == ip
    )


@pytest.fixture
def clean_env(monkeypatch):
    for var in VARS:  # monkeypatch restores whatever the test process had
        monkeypatch.delenv(var, raising=False)


def test_loopback_hosts_are_on_the_loopback_interface():
    lo = _interface_of("127.0.0.1")
    assert host_interface("127.0.0.1") == lo
    assert host_interface("localhost") == lo


def test_hosts_that_are_not_this_machine_have_no_interface():
    assert host_interface("0.0.0.0") is None  # a wildcard is no interface's address
    assert host_interface("198.51.100.7") is None  # TEST-NET-2: documentation only


def test_collectives_bind_to_the_interface_of_a_local_host(clean_env):
    lo = _interface_of("127.0.0.1")
    assert bind_collectives_to("127.0.0.1") == lo
    assert os.environ["GLOO_SOCKET_IFNAME"] == lo
    assert os.environ["NCCL_SOCKET_IFNAME"] == f"={lo}"  # '=': that exact name, not a prefix


def test_a_set_interface_is_replaced_for_a_local_host(clean_env, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    bind_collectives_to("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == _interface_of("127.0.0.1")


def test_a_host_of_another_machine_leaves_the_backends_their_choice(clean_env, monkeypatch):
    assert bind_collectives_to("0.0.0.0") is None
    assert not any(var in os.environ for var in VARS)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")  # the user's setting stands
    assert bind_collectives_to("198.51.100.7") is None
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth9"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_the_listening_socket_is_bound_to_the_host_and_listens(host):
    with listening_socket(host, 0) as sock:
        ip, port = sock.getsockname()[:2]
        assert ipaddress.ip_address(ip).is_loopback and port > 0
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1


def test_the_listening_socket_takes_the_given_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with listening_socket("127.0.0.1", port) as sock:
        assert sock.getsockname() == ("127.0.0.1", port)
