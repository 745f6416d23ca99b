"""ZeroMQ plumbing shared by every fleet: addresses, the loopback rule, framed send/receive.

Sockets bind to loopback (or ipc) unless the config explicitly allows a wider address. Every
message is sent as `codec.encode` frames, preceded on the replay's socket by an authentication
frame (`asyncrl.auth`); receivers check it, decode with a size limit and turn anything else
into an `AuthError` or `ProtocolError` that they count and answer.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import zmq

from asyncrl.auth import AuthError, RoleKey
from asyncrl.codec import ProtocolError, decode, encode
from asyncrl.protocol import Error

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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now (the OS picks it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def setup_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    allow_remote: bool = False,
    max_frame_bytes: int = -1,
) -> zmq.Socket:
    """A socket that never blocks process exit (LINGER 0), bound or connected. A peer that
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
    """Decode received frames (bytes or zmq.Frame) into a message; raises ProtocolError."""
    return decode([f.bytes if isinstance(f, zmq.Frame) else f for f in frames], max_bytes=max_bytes)


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
