"""Talking to a live ReplayService from tests: a service in a thread on a loopback port, and
DEALER peers that sign what they send with a role's key of the test run secret (or do not)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import zmq

from asyncrl.config import Config
from asyncrl.wire.auth import Keyring, role_key
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.protocol import LeaseRequest
from asyncrl.wire.samples import Trajectories, Trajectory
from asyncrl.wire.sockets import decode_signed, free_port, tcp_address
from replay.service import setup_replay_service

SECRET = bytes(range(32))  # the test run's secret
KEYRING = Keyring(SECRET, num_servers=4)
_SERVER_TYPES = (LeaseRequest, Trajectory, Trajectories)


@contextmanager
def running_replay(cfg: Config, run_dir: Path | None = None) -> Iterator[str]:
    """A ReplayService looping in a thread on a free loopback port; yields its address."""
    address = tcp_address("127.0.0.1", free_port())
    service = setup_replay_service(cfg, address, run_dir, secret=SECRET)
    stop = threading.Event()
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield address
    finally:
        stop.set()
        thread.join(timeout=5)
        assert not thread.is_alive(), "the replay loop did not stop"
        service.close()


@contextmanager
def dealer(address: str) -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()


def trajectory(group_id: str, index: int, version: int = 0, r: int = 3, **kw) -> Trajectory:
    """A well-formed sample `index` of `group_id`: `r` response tokens sampled at `version`."""
    fields = dict(
        traj_id=f"{group_id}/{index}",
        attempt=0,
        group_id=group_id,
        sample_index=index,
        server_id=0,
        prompt_ids=np.array([1, 2, 3], np.int32),
        response_ids=np.arange(r, dtype=np.int32),
        loss_mask=np.ones(r, np.uint8),
        behaviour_logprobs=np.full(r, -0.5, np.float32),
        versions=np.full(r, version, np.int32),
        reward=1.0,
        finish_reason="stop",
        baseline_reward=float("nan"),
        metrics={},
    )
    fields.update(kw)
    return Trajectory(**fields)


def role_of(msg: object) -> str:
    """The role that sends `msg` in a run: the server it names, else the learner."""
    return f"server_{msg.server_id}" if isinstance(msg, _SERVER_TYPES) else "learner"


def signed(frames: list[bytes], role: str | None) -> list[bytes]:
    """`frames` behind an authentication frame of `role` (None: an empty one)."""
    return [b"" if role is None else role_key(SECRET, role).sign(frames), *frames]


def send(sock: zmq.Socket, msg: object, role: str | None = "") -> None:
    """Send a message (or raw frames) signed as `role` ("": the role that sends it in a run)."""
    frames = [bytes(f) for f in encode(msg)] if not isinstance(msg, list) else msg
    sock.send_multipart(signed(frames, role_of(msg) if role == "" else role))


def recv(sock: zmq.Socket, timeout_s: float = 3.0) -> object:
    """The next reply, checked: signed with some role's key, or an unsigned Error."""
    assert sock.poll(int(timeout_s * 1000)), "the replay did not answer"
    frames = sock.recv_multipart()
    if frames[0] == b"":  # the replay could not authenticate us: an unsigned Error
        return decode(frames[1:])
    role = KEYRING.verify(frames[0], frames[1:])
    return decode_signed(frames, KEYRING.key(role))


def ask(sock: zmq.Socket, msg: object, role: str | None = "") -> object:
    send(sock, msg, role)
    return recv(sock)
