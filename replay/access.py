"""Who may ask the replay for what, and where it may write.

Every message reaches the replay preceded by an authentication frame (`asyncrl.wire.auth`): the
kind of role whose key signed it decides which message types it may send (`PERMISSIONS`), and
a server (`server_<i>`) speaks only for itself: the server_id of its leases and samples must be
i, and a sample only fills a group leased to it (`replay.buffer`). A heartbeat speaks only
for the epoch whose key signed it (`asyncrl.wire.auth`: the launcher hands each restart its epoch's
key), so no server can forge a later epoch and lock its slot out. A checkpoint is written
only inside the run directory, at a path given relative to it. `AccessRules` holds these rules
for one run (its keyring and run directory; it is the replay's `asyncrl.wire.router.Access`),
which the endpoint applies to every message. Per-peer quotas (leases, evaluation jobs) live
with the state they bound: `LeaseDesk.wanted` and `EvalJobs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.wire.auth import Keyring, RoleKey, role_epoch, role_kind, server_index
from asyncrl.wire.protocol import (
    CheckpointRequest,
    DeclareDead,
    EvalPoll,
    EvalSubmit,
    GroupFailed,
    Heartbeat,
    LeaseRequest,
    StatsRequest,
    VersionUpdate,
)
from asyncrl.wire.router import Peer
from asyncrl.wire.samples import BatchRequest, Trajectories, Trajectory

PERMISSIONS: dict[str, frozenset[type]] = {
    "learner": frozenset(
        {
            BatchRequest,
            VersionUpdate,
            CheckpointRequest,
            DeclareDead,
            EvalSubmit,
            EvalPoll,
            StatsRequest,
        }
    ),
    "server": frozenset(
        {LeaseRequest, Trajectory, Trajectories, Heartbeat, GroupFailed, StatsRequest}
    ),
    "client": frozenset({EvalSubmit, EvalPoll, StatsRequest}),
}
"""Message types each role may send; anything else is answered `Error` and counted as
`rejected_forbidden`."""


__all__ = ["PERMISSIONS", "AccessRules", "Peer"]  # Peer: the endpoint's, named here for the replay


class AccessRules:
    """The access rules of one run: which role signed a message (its keyring), whether that
    role may send it, and where checkpoints may be written (inside `run_dir`; None: nowhere)."""

    def __init__(self, secret: bytes, num_servers: int, run_dir: Path | None) -> None:
        self.keyring = Keyring(secret, num_servers)
        self.run_dir = run_dir

    def authenticate(self, auth_frame: bytes, frames: Sequence[bytes | memoryview]) -> str:
        """The role whose key signed `frames`; AuthError if none did."""
        return self.keyring.verify(auth_frame, frames)

    def key(self, role: str) -> RoleKey:
        """The key a reply to `role` is signed with."""
        return self.keyring.key(role)

    def forbidden(self, role: str, msg: Any) -> str:
        """Why `role` may not send `msg` ("" when it may): its role kind may not send that
        type (`PERMISSIONS`), or a server speaks for another server."""
        kind = role_kind(role)
        if type(msg) not in PERMISSIONS[kind]:
            return f"a {kind} may not send {type(msg).TYPE!r}"
        index = server_index(role)
        if index is not None and getattr(msg, "server_id", index) != index:
            return f"{role} may not speak for server {msg.server_id}"
        if isinstance(msg, Heartbeat) and msg.epoch != role_epoch(role):
            return f"{role} may not speak for epoch {msg.epoch}: each epoch has its own key"
        return ""

    def checkpoint_path(self, path: str) -> Path:
        """Where a checkpoint asked for as `path` is written: `path` relative to the run
        directory (as the learner sends it: `checkpoints/step_<v>.partial/replay.msgpack`,
        `learner.checkpoint`), resolved (symlinks followed), if it lies inside the run
        directory; ValueError if not. An absolute `path` is taken as it is, and must lie inside
        too. Relative to the run directory, not to the working directory: with a relative
        `trainer.run_dir` (the default `runs/{time}`), a path the learner wrote under the run
        directory and joined on again landed in run_dir/run_dir/... (issue 40)."""
        if self.run_dir is None:
            raise ValueError("this replay has no run directory: it writes no checkpoints")
        root = self.run_dir.resolve()
        target = (root / path).resolve()
        if target == root or not target.is_relative_to(root):
            raise ValueError(f"checkpoint path {path[:200]!r} is outside the run directory {root}")
        return target
