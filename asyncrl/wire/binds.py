"""Where torch.distributed listens: on the run's host, not on every interface.

DESIGN.md promises that every listening socket of a run binds to loopback unless
`launch.allow_remote=true` (ZeroMQ binds are checked in `asyncrl.wire.sockets`). torch does not
keep that promise by itself, for either process group of a run (the learner's FSDP group and
the weight-sync group):

- a TCPStore master listens on every interface, IPv4 and IPv6 (`[::]`), whatever host it is
  given. `setup_store` binds the listening socket itself, to `host`, and hands torch the
  descriptor (`master_listen_fd`): the store then listens there and nowhere else.
- gloo's pair sockets listen on the address the machine's hostname resolves to (any interface),
  NCCL's bootstrap on the first non-loopback interface. `bind_collectives_to(host)` points both
  at the interface that holds `host` (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: read when a
  process group is created, so this is called before). When `host` is not an address of this
  machine (a wildcard such as 0.0.0.0, or another node's address under Ray with
  `launch.allow_remote=true`), the backends' own choice stands: only a config that allows remote
  binds gets there. The NCCL half has not run here (no GPU).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket

import psutil
import torch.distributed as dist

log = logging.getLogger("asyncrl.wire.binds")


def _addresses(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """Every IP address `host` (a name or a literal address) resolves to."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}


def host_interface(host: str) -> str | None:
    """The name of this machine's network interface that holds `host` (`lo` for 127.0.0.1 on
    Linux), or None when no interface does (a wildcard address, another machine's address)."""
    wanted = _addresses(host)
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if ipaddress.ip_address(addr.address.split("%")[0]) in wanted:
                return name
    return None


def bind_collectives_to(host: str) -> str | None:
    """Make gloo and NCCL process groups created from now on in this process listen on the
    interface of `host` (see the module docstring); returns that interface, or None when
    `host` is not an address of this machine (the backends then choose, as without this)."""
    interface = host_interface(host)
    if interface is None:
        log.info("%s is not an address of this machine: gloo/NCCL choose their interface", host)
        return None
    for var, value in (("GLOO_SOCKET_IFNAME", interface), ("NCCL_SOCKET_IFNAME", f"={interface}")):
        if os.environ.get(var, value) != value:
            log.warning(
                "%s=%s replaced by %s (the interface of %s)", var, os.environ[var], value, host
            )
        os.environ[var] = value
    return interface


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (port 0: any free one) and listening."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own listener
        sock.bind(address)
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def setup_store(
    host: str, port: int, world_size: int | None, is_master: bool, timeout: datetime.timedelta
) -> dist.TCPStore:
    """A TCPStore at `host`:`port` (`world_size` None: a master that waits for no client). The
    master listens on `host` only: torch gets a duplicate of a socket bound there, which it
    owns from then on (it closes the descriptor with the store, so the Python socket must not
    own the same one)."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    with listening_socket(host, port) as sock:
        return dist.TCPStore(
            host, port, world_size, True, timeout, master_listen_fd=os.dup(sock.fileno())
        )
