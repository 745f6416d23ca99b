"""Who may ask a reward-model server for scores: the rollout servers (any index of the run, any
epoch: a restarted server keeps scoring) and clients (benchmarks, `asyncrl eval`). The learner
may not: it has no use for scores, and a role that needs nothing is refused everything. The
only message type is `ScoreRequest` (`reward_models.server` accepts no other), so these rules
are the run's keyring and a rule on the kind of role; `asyncrl.wire.router` applies them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from asyncrl.wire.auth import Keyring, RoleKey, role_kind

ASKERS = frozenset({"server", "client"})
"""The kinds of role that may send a `ScoreRequest`."""


class RewardModelAccess:
    """The reward-model server's `asyncrl.wire.router.Access`: one run's keyring (every rollout
    server index below `num_servers`, each epoch of one) and the rule above."""

    def __init__(self, secret: bytes, num_servers: int) -> None:
        self.keyring = Keyring(secret, num_servers)

    def authenticate(self, auth_frame: bytes, frames: Sequence[bytes | memoryview]) -> str:
        """The role whose key signed `frames`; AuthError if none did."""
        return self.keyring.verify(auth_frame, frames)

    def key(self, role: str) -> RoleKey:
        """The key a reply to `role` is signed with."""
        return self.keyring.key(role)

    def forbidden(self, role: str, msg: Any) -> str:
        """Why `role` may not send `msg` ("" when it may)."""
        kind = role_kind(role)
        if kind not in ASKERS:
            return f"a {kind} may not ask a reward-model server for scores"
        return ""
