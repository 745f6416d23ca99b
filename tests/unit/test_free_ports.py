"""`free_ports`: ports another process binds later are drawn where the kernel never hands
ports out by itself, so a connection made in between cannot take them."""

import socket

import pytest

from asyncrl.wire import sockets as transport
from asyncrl.wire.sockets import PORT_FLOOR, free_port, free_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range(monkeypatch):
    monkeypatch.setattr(transport, "ephemeral_low", lambda: 32768)  # Linux's default
    ports = free_ports("127.0.0.1", 20)
    assert len(set(ports)) == 20
    assert all(PORT_FLOOR <= p < 32768 for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_without_room_below_the_range_the_os_picks_distinct_ports(monkeypatch):
    monkeypatch.setattr(transport, "ephemeral_low", lambda: PORT_FLOOR + 10)
    ports = free_ports("127.0.0.1", 5)
    assert len(set(ports)) == 5 and all(p >= PORT_FLOOR + 10 for p in ports)


def _held_with_a_free_neighbour() -> socket.socket:
    """A listening socket whose port + 1 is free now."""
    for _ in range(50):
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        if transport._bindable("127.0.0.1", held.getsockname()[1] + 1):
            held.listen()
            return held
        held.close()
    raise AssertionError("no free port next to 50 ports the OS picked")


def test_a_port_in_use_is_never_drawn():
    with _held_with_a_free_neighbour() as held:
        taken = held.getsockname()[1]
        # two ports to draw from, one of them taken: only the other can come back
        for _ in range(20):
            assert transport._draw_ports("127.0.0.1", 1, taken, taken + 2) == [taken + 1]
        with pytest.raises(OSError, match="found only 1 of 2 free ports"):
            transport._draw_ports("127.0.0.1", 2, taken, taken + 2)


def test_free_port_is_one_of_them():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
