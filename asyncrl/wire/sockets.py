"""ZeroMQ plumbing shared by every fleet: addresses, the loopback rule, framed send/receive.

Sockets bind to loopback (or ipc) unless the config explicitly allows a wider address. Every
message is sent as `codec.encode` frames, preceded on the replay's socket by an authentication
frame (`asyncrl.wire.auth`); receivers check it, decode with a size limit and turn anything else
into an `AuthError` or `ProtocolError` that they count and answer.
"""

from __future__ import annotations

import contextlib
import ipaddress
import random
import socket
from pathlib import Path
from typing import Any, TypeVar

import zmq

from asyncrl.wire.auth import AuthError, RoleKey
from asyncrl.wire.codec import BYTES_PER_NODE, decode, encode
from asyncrl.wire.protocol import Error
from asyncrl.wire.validation import ProtocolError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def tcp_address(host: str, port: int) -> str:
    """`tcp://host:port` (IPv6 hosts bracketed)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def check_bind_address(address: str, allow_remote: bool) -> None:
    """Refuse a bind beyond loopback/ipc unless `allow_remote` says so."""
    if address.startswith(("ipc://", "inproc://")) or allow_remote:
        return
    if not address.startswith("tcp://"):
        raise ValueError(f"unsupported address {address!r}: use tcp://127.0.0.1:PORT or ipc://PATH")
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    try:
        is_loop = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_loop = False
    if not is_loop:
        raise ValueError(
            f"refusing to bind {address!r}: not a loopback address (set launch.allow_remote=true)"
        )


PORT_FLOOR = 10000  # lowest port `free_ports` draws from
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (Linux's setting; 32768 where unknown,
    Linux's default: macOS and Windows start higher)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    """Whether `host`:`port` can be bound now (no SO_REUSEADDR: a port in TIME_WAIT is not)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(host: str = "127.0.0.1", count: int = 1) -> list[int]:
    """`count` distinct TCP ports free on `host` now, for another process to bind later.

    They are drawn at random below the kernel's ephemeral range (from `PORT_FLOOR`), which the
    kernel never hands out by itself: not to a bind to port 0, not as the local port of an
    outgoing connection. A port the OS picked would be in that range, and any connection made
    between the pick and the bind could take it (a CI run failed so: a learner's weight-sync
    store found its port in use). What is left is a process that binds the same port
    explicitly, which a random draw from ~20,000 makes rare. Where the range leaves no room
    below it, the OS picks (the ports held together, so distinct)."""
    low = ephemeral_low()
    if low - PORT_FLOOR >= 1000:
        return _draw_ports(host, count, PORT_FLOOR, low)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket(family)) for _ in range(count)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def _draw_ports(host: str, count: int, floor: int, ceiling: int) -> list[int]:
    """`count` distinct ports from [`floor`, `ceiling`) that `host` can bind now, drawn at
    random (OSError when 100 draws a port do not find them)."""
    rng = random.SystemRandom()
    picked: list[int] = []
    for _ in range(100 * count):
        port = rng.randrange(floor, ceiling)
        if port not in picked and _bindable(host, port):
            picked.append(port)
            if len(picked) == count:
                return picked
    raise OSError(
        f"found only {len(picked)} of {count} free ports on {host} in [{floor}, {ceiling})"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """One port from `free_ports`."""
    return free_ports(host, 1)[0]


_S = TypeVar("_S", bound="zmq.Socket[Any]")


def setup_socket(
    ctx: zmq.Context[_S],
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    allow_remote: bool = False,
    max_frame_bytes: int = -1,
) -> _S:
    """A socket (of the context's kind: an asyncio context gives an asyncio socket) that never
    blocks process exit (LINGER 0), bound or connected. A peer that
    sends a frame over `max_frame_bytes` (-1: no limit) is disconnected by ZeroMQ before the
    frame is buffered (MAXMSGSIZE: set before bind, as a listener copies its options)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    if bind is not None:
        check_bind_address(bind, allow_remote)
        sock.bind(bind)
    if connect is not None:
        sock.connect(connect)
    return sock


def send_msg(
    sock: zmq.Socket, msg: Any, identity: bytes | None = None, *, auth: RoleKey | None
) -> Any:
    """Send one message (prefixed by a ROUTER identity when given), signed with `auth` (None:
    unsigned, for sockets that carry no authentication frame). Returns what zmq returns (an
    awaitable on an asyncio socket)."""
    frames = encode(msg)
    if auth is not None:
        frames = [auth.sign(frames), *frames]
    if identity is not None:
        frames = [identity, *frames]
    return sock.send_multipart(frames, copy=False)


def decode_frames(frames: list[bytes], max_bytes: int | None = None) -> Any:
    """Decode received frames (bytes or zmq.Frame) into a message; raises ProtocolError. With
    `max_bytes`, the header may hold at most `max_bytes // BYTES_PER_NODE` values too."""
    nodes = None if max_bytes is None else max_bytes // BYTES_PER_NODE
    raw = [f.bytes if isinstance(f, zmq.Frame) else f for f in frames]
    return decode(raw, max_bytes=max_bytes, max_nodes=nodes)


def decode_signed(frames: list[Any], auth: RoleKey, max_bytes: int | None = None) -> Any:
    """Decode a reply from the replay, checked against this process's key. Raises AuthError
    when it is unsigned or signed wrongly, quoting the replay's reason when it is the replay's
    unsigned `Error` (it could not authenticate us: a wrong or missing run secret)."""
    raw = [f.bytes if isinstance(f, zmq.Frame) else f for f in frames]
    if not raw:
        raise ProtocolError("empty message")
    size = sum(len(f) for f in raw)
    if max_bytes is not None and size > max_bytes:
        raise ProtocolError(f"oversized message: {size} bytes > limit {max_bytes}")
    if raw[0] == b"":
        msg = decode(raw[1:], max_bytes=max_bytes)
        if isinstance(msg, Error) and msg.reason.startswith("oversized message"):
            # refused before its signature was read: about that message, not about our key
            raise ProtocolError(f"the replay refused a message: {msg.reason}")
        if isinstance(msg, Error):
            raise AuthError(f"the replay refused this process's {auth.role} key: {msg.reason}")
        raise AuthError(f"unsigned {type(msg).TYPE!r} reply")
    auth.check(raw[0], raw[1:])
    return decode(raw[1:], max_bytes=max_bytes)
