"""The batch desk: what the learner gets when it asks for a batch.

A batch is exactly the `num_groups` whole groups asked for, ready in the buffer, oldest lease
first, none older than `replay.max_staleness` versions at the request's `learner_version`
(authoritative): no token older than the bound reaches the loss. Ready groups too stale for it
are dropped first: counted (`stale_dropped`), reported to admission as never trained (their
slots are free again) and told in the batch that answers the request. With each batch go the
fleet metrics of its step (`replay.fleet_stats`, `replay.leases.lease_spread`) and, with
`replay.filter_groups` on, what the filter dropped for it (`replay.group_filter`).

Wiring: built by `replay.components.setup_replay_components` over the buffer, the replay's
admission controller (the lease desk's too), the fleet stats and the counters;
`replay.held.HeldBatches` asks it for a batch whenever a batch request may be answered.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from asyncrl.wire.samples import Batch, BatchRequest
from replay.admission import AdmissionController
from replay.buffer import GroupBuffer, to_batch
from replay.fleet_stats import FleetStats
from replay.group_filter import GroupFilter
from replay.leases import lease_spread


class BatchDesk:
    """Batches out of the buffer (see the module docstring)."""

    def __init__(
        self,
        max_staleness: int,
        buffer: GroupBuffer,
        admission: AdmissionController,
        fleet: FleetStats,
        counters: Counter[str],
        group_filter: GroupFilter | None = None,
    ) -> None:
        self.max_staleness = max_staleness
        self.buffer = buffer
        self.admission = admission
        self.fleet = fleet
        self.counters = counters
        self.group_filter = group_filter

    def serve(self, request: BatchRequest, stale_before: int) -> tuple[Batch | None, int]:
        """A batch for `request`, or None while fewer groups are ready, and how many groups were
        dropped as stale now. `stale_before`: the groups dropped earlier while the request
        waited; the batch tells them all."""
        groups, stale = self.buffer.pop_batch(
            request.learner_version, request.num_groups, self.max_staleness
        )
        if stale:
            self.counters["stale_dropped"] += stale
            self.admission.on_never_trained(stale)
        if not groups:
            return None, stale
        fleet = self.fleet.for_batch(
            (x for g in groups for x in g.latencies),
            self.buffer.num_ready,
            self.buffer.num_in_flight,
        ) | lease_spread(g.server_id for g in groups)
        batch = to_batch(request.request_id, groups, stale_before + stale)
        if self.group_filter is not None:
            fleet |= self.group_filter.for_batch(len(groups), len(batch.traj_ids))
        batch = dataclasses.replace(batch, fleet=fleet)
        self.counters["batches_served"] += 1
        self.counters["groups_served"] += len(groups)
        self.counters["samples_served"] += len(batch.traj_ids)
        return batch, stale
