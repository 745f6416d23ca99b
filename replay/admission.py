"""Admission control: how many prompt leases a rollout server may start now.

The rule (AReaL-style), in units of groups, with B = groups per learner batch and
S = `replay.max_staleness`: a server holding policy version s may be granted a new lease only
while

    issued < (s + S + 1) * B

where `issued` counts every group ever leased minus the groups that will never be trained
(dropped as stale, expired leases,
filtered as zero-variance by `replay.group_filter`).

Why: the learner consumes groups roughly in issue order, batch k at version k, so the i-th
issued group (0-based, counting only groups that will be trained) is trained at a version
w >= floor(i / B). Work started at version s has tokens of version >= s, so it can only be
trained within the bound if floor(i / B) - s <= S, i.e. i < (s + S + 1) * B. Leasing beyond that
would start work that could only end stale. With S = 0 this is exactly synchronous on-policy RL:
one batch of leases per version. The rule is a prediction, not a guarantee (groups complete out
of order, servers lag); the buffer's consume-time check is what makes the bound hold.

In-flight weight updates (`rollout.weight_update_mode=inflight`): a trajectory may then span
versions, and the buffer judges it by its OLDEST sampled token's version. Versions only move
forward on a server, and a server asks with the version its engine holds when it asks, so
every token of work leased at s is sampled at a version >= s: the oldest is >= s, and the rule
above holds unchanged (a group leased at s but sampled entirely after an update to s + 1 is
only fresher than admission assumed). Engines tag tokens so (versions only go up within a
sample: `tests/unit/test_inflight.py`), and the buffer's oldest-token rule is tested with
samples that span versions (`tests/unit/test_admission_spread.py`).

Capacity: leased-but-incomplete plus ready groups never exceed `capacity_groups`; a server
asking beyond it waits (back-pressure) instead of the replay growing without bound.

Spread: at most `window = min((S + 1) * B, capacity_groups)` groups can be in play at once, and
a server granted all of them leaves the others idle (a server's own limit,
`rollout.max_concurrent_groups`, is often a whole batch or more). So while `asking` servers
want work (the requester plus every server whose request is held and that has free slots),
a server may hold at most its fair share in flight:

    in_flight(server) + granted <= ceil(window / asking)

1. Its in-flight leases (granted, not yet complete) count against its share; ready groups do
   not (they wait for the learner, not for the server). A lease frees its place in the share
   when its group completes or the lease expires.
2. A server asking alone has no share cap: a single-server run, or a server whose peers are busy
   at their own limit or have stopped asking, may use the whole budget. A share that a server
   does not ask for is released to those that do; a server over its share (it took the window
   while alone) is granted nothing until its in-flight work drops below the share.
3. "Asking", not "alive", is what counts: a live server at its concurrency limit cannot take
   work, and reserving a share for it would idle the window; a dead server's held request is
   answered empty after `replay.wait_timeout_s` and stops counting.
4. A server held because its version is too old still counts: it is about to apply the
   weights that opened the window for the requester (when a new version opens the window, the
   first server to apply it asks first). Not counting it would hand the first server to update
   the whole window, the very imbalance the share prevents. The wait is bounded: every server
   receives every version (the broadcast is collective) and applies it in flight, or once
   its running requests drain.
5. Staleness and capacity are never loosened by the share, only split. And the share never
   idles the window on its own: if every asking server held its share in flight, their groups
   alone would fill the window, leaving no staleness budget or capacity for any server no newer
   than the learner (issued = trained + held and trained >= s * B give a budget of at most
   (S + 1) * B - held). A share waits unused only for an asking server too old to use it,
   until its engine moves on (item 4).

Counting asking servers is the caller's (`replay.held.HeldLeases.asking`); this class only
applies the share.

Invariant kept by the caller: `issued == groups trained (consumed) + groups held` (in flight
plus ready), because every lease is either consumed, or reported with `on_never_trained`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import Config


class AdmissionController:
    def __init__(self, max_staleness: int, groups_per_batch: int, capacity_groups: int) -> None:
        if max_staleness < 0 or groups_per_batch < 1 or capacity_groups < 1:
            raise ValueError(
                f"need max_staleness >= 0, groups_per_batch >= 1, capacity_groups >= 1; got "
                f"{max_staleness}, {groups_per_batch}, {capacity_groups}"
            )
        self.max_staleness = max_staleness
        self.groups_per_batch = groups_per_batch
        self.capacity_groups = capacity_groups
        self.window = min((max_staleness + 1) * groups_per_batch, capacity_groups)
        """The most groups the staleness rule and capacity let be in play at once."""
        self.issued = 0
        """Groups ever leased minus groups that will never be trained."""

    @classmethod
    def from_config(cls, cfg: Config) -> AdmissionController:
        """The run's admission: `replay.max_staleness`, `data.train_batch_size` groups a
        batch, `replay.capacity_groups` (the replay's setup, `replay.components`, and the
        pipeline model, `asyncrl.analysis.pipeline_model`, build it so)."""
        rc = cfg.replay
        return cls(rc.max_staleness, cfg.data.train_batch_size, rc.capacity_groups)

    def staleness_budget(self, server_version: int) -> int:
        """Groups a server at `server_version` may still start under the staleness rule."""
        limit = (server_version + self.max_staleness + 1) * self.groups_per_batch
        return max(0, limit - self.issued)

    def fair_share(self, asking: int) -> int:
        """Groups one of `asking` servers may hold in flight (no cap for a server alone)."""
        return self.window if asking <= 1 else math.ceil(self.window / asking)

    def grantable(
        self, server_version: int, wanted: int, held: int, in_flight: int = 0, asking: int = 1
    ) -> int:
        """Leases to grant now: at most `wanted`, within the staleness rule, the capacity left
        when `held` groups (in flight plus ready) are in the buffer, and, while `asking` > 1
        servers want work, the server's fair share less its own `in_flight` groups."""
        room = self.capacity_groups - held
        k = min(wanted, self.staleness_budget(server_version), room)
        if asking > 1:
            k = min(k, self.fair_share(asking) - in_flight)
        return max(0, k)

    def on_issued(self, k: int) -> None:
        """`k` leases were granted."""
        self.issued += k

    def on_resumed(self, version: int, held: int) -> None:
        """A resumed run at learner `version` holding `held` groups: the `version` x B groups
        trained before plus the held ones count as issued, so the invariant holds again."""
        self.issued = version * self.groups_per_batch + held

    def on_never_trained(self, k: int) -> None:
        """`k` leased groups will never be trained (stale, expired, filtered): their slots are
        free."""
        if k > self.issued:
            raise ValueError(f"{k} groups reported never trained, only {self.issued} issued")
        self.issued -= k
