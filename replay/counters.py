"""The replay's counters: every name it reports (present as 0 from the start), and the one-line
summary it logs when it stops."""

from __future__ import annotations

from asyncrl.wire.router import OUTCOMES

__all__ = ["COUNTERS", "OUTCOMES", "summarize"]  # OUTCOMES: the endpoint's (`asyncrl.wire.router`)

COUNTERS = (
    "received",
    *OUTCOMES,
    "lease_requests",
    "leases_granted",
    "leases_reissued",
    "empty_grants",
    "eval_jobs",
    "eval_leases_granted",
    "eval_samples",
    "eval_jobs_freed",
    "servers_forgotten",
    "expired",
    "groups_failed",
    "rows_given_up",
    "eval_groups_given_up",
    "accepted",
    "duplicates",
    "late",
    "untrainable",
    "stale_dropped",
    "groups_filtered",
    "samples_filtered",
    "filter_bound_hits",
    "filter_groups_passed",
    "filter_metric_missing",
    "batch_requests",
    "batches_served",
    "groups_served",
    "samples_served",
    "empty_batches",
    "version_updates",
)
"""Every counter the replay reports, present (as 0) from the start."""


def summarize(counters: dict[str, float]) -> str:
    """One line for logs: what came in, what went out, what was dropped or rejected."""
    c = {k: int(v) for k, v in counters.items()}
    rejected = sum(v for k, v in c.items() if k.startswith("rejected_"))
    return (
        f"{c.get('accepted', 0)} trajectories accepted ({c.get('duplicates', 0)} duplicate, "
        f"{c.get('late', 0)} late, {rejected} rejected messages, "
        f"{c.get('handler_errors', 0)} handler errors); "
        f"{c.get('leases_granted', 0)} leases granted, {c.get('expired', 0)} expired, "
        f"{c.get('groups_failed', 0)} failed ({c.get('rows_given_up', 0)} rows given up); "
        f"{c.get('batches_served', 0)} batches / {c.get('samples_served', 0)} samples served; "
        f"{c.get('stale_dropped', 0)} groups dropped as stale, "
        f"{c.get('groups_filtered', 0)} filtered (zero variance); "
        f"learner version {c.get('learner_version', 0)}"
    )
