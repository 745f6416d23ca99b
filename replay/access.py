"""Who may ask the replay for what, and where it may write.

Every message reaches the replay preceded by an authentication frame (`asyncrl.auth`): the
kind of role whose key signed it decides which message types it may send (`PERMISSIONS`), and
a server (`server_<i>`) speaks only for itself: the server_id of its leases and samples must be
i, and a sample only fills a group leased to it (`replay.buffer`). A checkpoint
is written only inside the run directory. Per-peer quotas (leases, evaluation jobs) live with
the state they bound: `ReplayService._lease_quota` and `EvalJobs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asyncrl.protocol import (
    BatchRequest,
    CheckpointRequest,
    DeclareDead,
    EvalPoll,
    EvalSubmit,
    GroupFailed,
    Heartbeat,
    LeaseRequest,
    StatsRequest,
    Trajectories,
    Trajectory,
    VersionUpdate,
)

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


@dataclass(frozen=True)
class Peer:
    """The sender of one message: its ROUTER identity and the role that signed it (None: it
    could not be authenticated, so replies to it are unsigned errors)."""

    identity: bytes
    role: str | None


def confine(path: str, run_dir: Path | None) -> Path:
    """`path` resolved (symlinks followed), if it lies inside `run_dir`; ValueError if not."""
    if run_dir is None:
        raise ValueError("this replay has no run directory: it writes no checkpoints")
    root = run_dir.resolve()
    target = (root / path).resolve()
    if target == root or not target.is_relative_to(root):
        raise ValueError(f"checkpoint path {path[:200]!r} is outside the run directory {root}")
    return target
