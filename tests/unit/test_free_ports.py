"""`free_ports`: ports another process binds later are drawn where the kernel never hands
ports out by itself, so a connection made in between cannot take them."""

import socket

import pytest

from asyncrl import transport
from asyncrl.transport import PORT_FLOOR, ephemeral_low, free_port, free_ports


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low = ephemeral_low()
    if low - PORT_FLOOR < 1000:
        pytest.skip(f"this machine's ephemeral range starts at {low}: the OS picks")
    ports = free_ports("127.0.0.1", 20)
    assert len(set(ports)) == 20
    assert all(PORT_FLOOR <= p < low for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_drawn():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        if not transport._bindable("127.0.0.1", taken + 1):
            pytest.skip(f"port {taken + 1} is in use on this machine")
        # two ports to draw from, one of them taken: only the other can come back
        for _ in range(20):
            assert transport._draw_ports("127.0.0.1", 1, taken, taken + 2) == [taken + 1]
        with pytest.raises(OSError, match="found only 1 of 2 free ports"):
            transport._draw_ports("127.0.0.1", 2, taken, taken + 2)


def test_free_port_is_one_of_them():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
