"""Admission control: how many prompt leases a rollout server may start now.

The rule (AReaL-style), in units of groups, with B = groups per learner batch and
S = `replay.max_staleness`: a server holding policy version s may be granted a new lease only
while

    issued < (s + S + 1) * B

where `issued` counts every group ever leased minus the groups that will never be trained
(dropped as stale, expired leases).

Why: the learner consumes groups roughly in issue order, batch k at version k, so the i-th
issued group (0-based, counting only groups that will be trained) is trained at a version
w >= floor(i / B). Work started at version s has tokens of version >= s, so it can only be
trained within the bound if floor(i / B) - s <= S, i.e. i < (s + S + 1) * B. Leasing beyond that
would start work that could only end stale. With S = 0 this is exactly synchronous on-policy RL:
one batch of leases per version. The rule is a prediction, not a guarantee (groups complete out
of order, servers lag); the buffer's consume-time check is what makes the bound hold.

Capacity: leased-but-incomplete plus ready groups never exceed `capacity_groups`; a server
asking beyond it waits (back-pressure) instead of the replay growing without bound.

Invariant kept by the caller: `issued == groups trained (consumed) + groups held` (in flight
plus ready), because every lease is either consumed, or reported with `on_never_trained`.
"""

from __future__ import annotations


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
        self.issued = 0
        """Groups ever leased minus groups that will never be trained."""

    def staleness_budget(self, server_version: int) -> int:
        """Groups a server at `server_version` may still start under the staleness rule."""
        limit = (server_version + self.max_staleness + 1) * self.groups_per_batch
        return max(0, limit - self.issued)

    def grantable(self, server_version: int, wanted: int, held: int) -> int:
        """Leases to grant now: at most `wanted`, within the staleness rule and the capacity
        left when `held` groups (in flight plus ready) are in the buffer."""
        room = self.capacity_groups - held
        return max(0, min(wanted, self.staleness_budget(server_version), room))

    def on_issued(self, k: int) -> None:
        """`k` leases were granted."""
        self.issued += k

    def on_never_trained(self, k: int) -> None:
        """`k` leased groups will never be trained (stale, expired): their slots are free."""
        if k > self.issued:
            raise ValueError(f"{k} groups reported never trained, only {self.issued} issued")
        self.issued -= k
