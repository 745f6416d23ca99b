"""The replay's config section (`replay`): staleness, capacity, leases, message limits, and
dynamic sampling (`replay.filter_groups`, see `replay.group_filter`).

Part of the tree `asyncrl.config` assembles (and re-exports); kept apart so each file reads
as one thing.
"""

from __future__ import annotations

from pydantic import Field

from asyncrl.config.base import Section


class FilterGroupsConfig(Section):
    """DAPO's dynamic sampling (the `filter_groups` option of verl's algorithm section), done
    in the replay: a group whose `metric` is the same for all its samples carries no GRPO
    signal, so it is dropped when it completes, before it can enter a batch; its slot is freed
    at once and leasing goes on until the batch is full (`replay.group_filter`)."""

    enable: bool = False
    """Drop groups whose metric has zero variance over their samples."""
    metric: str = "seq_reward"
    """What must vary within a group: `seq_reward` (each sample's reward, overlong penalty
    included), or the name of a per-sample metric the trajectories carry (`acc`, `task_reward`,
    or any number a reward function returns beside `score`). A group whose samples lack the
    metric is kept and counted (`filter_metric_missing`)."""
    max_filtered_per_step: int = Field(160, ge=0)
    """Groups dropped for one learner step (since the previous batch was served) before the
    filter gives up on that step: the batch then takes the next ready groups unfiltered, with a
    warning and `filter_bound_hit` in the step record. 0: no bound. 160 is the DAPO recipe's
    bound (max_num_gen_batches 10) at the default batch of 16 groups."""


class ReplayConfig(Section):
    max_staleness: int = Field(2, ge=0)
    """A sample of policy version v is trained at learner version w only if w - v <= this. 2:
    the staleness study's best trade (docs/off_policy.md); 4 and 8 degraded learning there."""
    capacity_groups: int = Field(256, ge=1)
    """Most groups held (in flight plus ready); beyond it leases wait (back-pressure)."""
    lease_timeout_s: float = Field(600.0, gt=0)
    """A lease whose group is not complete by then is dropped, counted and re-issued."""
    max_group_failures: int = Field(3, ge=1)
    """A row whose group a server could not sample this many times is given up (logged)."""
    max_message_mb: float = Field(64.0, gt=0)
    """A learner's or server's message larger than this is rejected (raw size, before decoding)."""
    max_client_message_mb: float = Field(0.125, gt=0)
    """The same for a `client` key (`asyncrl eval`): it sends a large job in parts under this."""
    eval_jobs_mb: float = Field(1024.0, gt=0)
    """Memory the replay lets evaluation jobs hold in all; a job that would pass it is refused."""
    wait_timeout_s: float = Field(1.0, gt=0)
    """A held lease or batch request is answered empty after this (clients poll again)."""
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    """Dynamic sampling: groups with nothing to learn from never take a slot in a batch."""
