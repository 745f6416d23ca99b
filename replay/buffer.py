"""The staleness-bounded group buffer: samples of one prompt kept together until trained.

A group is opened when its lease is granted and becomes ready when all `n` samples arrived. The
learner takes whole ready groups, oldest lease first, and only as many as it asked for.

Staleness: a sample's version is the OLDEST policy version among its sampled tokens (the minimum
of `versions` where `loss_mask == 1`); a group's version is the oldest of its samples. A sample
with no sampled token (every mask 0) counts as generated at the version the group was leased
at: no token of it reaches the loss, and the lease version is a lower bound on any policy that
could have produced it after the lease, so it never makes a group look fresher than it is.

Invariants (tested):
- No sample whose version v has `learner_version - v > max_staleness` is ever returned: every
  ready group is checked against the learner version of the request that takes it.
- Each trajectory is returned at most once: a traj_id is accepted once per group, a sample slot
  is filled once, and a group leaves the buffer when returned, dropped or expired, after which
  its trajectories are answered `late` (or `duplicate`, while their id is remembered).
- A batch is whole groups, exactly as many as asked for, or nothing.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from asyncrl.wire.protocol import PromptItem
from asyncrl.wire.samples import Batch, Trajectory
from replay.sample_checks import MalformedTrajectory, TokenLimits, check_trajectory

AddStatus = Literal["accepted", "duplicate", "late"]


def sample_version(traj: Trajectory, lease_version: int) -> int:
    """The oldest policy version of the sample's sampled tokens (the lease version if none)."""
    sampled = traj.versions[traj.loss_mask == 1]
    return int(sampled.min()) if sampled.size else lease_version


@dataclass
class Group:
    """The samples of one lease."""

    item: PromptItem
    lease_version: int  # the version admission judged the lease by
    opened_at: float  # monotonic time the lease was granted
    server_id: int  # the server it was leased to
    samples: list[Trajectory | None]  # by sample_index; None until it arrives
    traj_ids: set[str] = field(default_factory=set)
    filled: int = 0
    latencies: list[float] = field(default_factory=list)  # lease grant -> sample arrival, s
    version: int | None = None  # oldest sample version so far (None: no sample yet)

    @property
    def ready(self) -> bool:
        return self.filled == len(self.samples)

    def complete_samples(self) -> list[Trajectory]:
        """All n samples, by sample_index; ValueError if one has not arrived (not `ready`)."""
        out: list[Trajectory] = []
        for s in self.samples:
            if s is None:
                raise ValueError(f"group {self.item.group_id!r} is not complete")
            out.append(s)
        return out


@dataclass(frozen=True)
class SavedGroup:
    """A ready group as a checkpoint keeps it (`GroupBuffer.saved` and `restore`)."""

    item: PromptItem
    lease_version: int  # the version admission judged the lease by
    server_id: int  # the server it was leased to
    samples: list[Trajectory]  # by sample_index, all n of them
    latencies: list[float]  # lease grant -> sample arrival, s


class GroupBuffer:
    def __init__(self, seen_ids_limit: int = 1 << 16, limits: TokenLimits | None = None) -> None:
        """`seen_ids_limit`: how many trajectory ids to remember for `duplicate` answers. It
        only decides `duplicate` vs `late` for resends of retired groups; correctness (at most
        once) never depends on it. Size it well above capacity_groups x n. `limits`: the
        model's, checked on every sample (`replay.sample_checks.check_trajectory`)."""
        self.limits = limits
        self._groups: dict[str, Group] = {}  # in lease order (oldest first)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seen_limit = seen_ids_limit
        self._ready = 0
        self._in_flight: Counter[int] = Counter()  # server id -> incomplete groups leased to it

    def __len__(self) -> int:
        """Groups held: leased but incomplete, plus ready."""
        return len(self._groups)

    @property
    def num_ready(self) -> int:
        return self._ready

    @property
    def num_in_flight(self) -> int:
        return len(self._groups) - self._ready

    def saved(self) -> tuple[list[SavedGroup], list[PromptItem], list[str]]:
        """What a checkpoint keeps of the buffer, each oldest first: the ready groups with their
        samples, the prompts of the incomplete groups (their partial samples are not kept: on
        resume those prompts are leased again) and the trajectory ids remembered for
        `duplicate` answers."""
        ready = [
            SavedGroup(
                g.item, g.lease_version, g.server_id, g.complete_samples(), list(g.latencies)
            )
            for g in self._groups.values()
            if g.ready
        ]
        incomplete = [g.item for g in self._groups.values() if not g.ready]
        return ready, incomplete, list(self._seen)

    def restore(self, ready: list[SavedGroup], seen_ids: list[str]) -> None:
        """Put back what `saved` kept, into an empty buffer: the ready groups (their samples
        pass the checks of `add` again, and the groups' versions are recomputed from them) and
        the remembered ids, so a resend of a trajectory accepted before the checkpoint is
        answered `duplicate`. Raises MalformedTrajectory if a saved group is not whole."""
        if self._groups or self._seen:
            raise ValueError("restore needs an empty buffer")
        for saved in ready:
            self.open_group(saved.item, time.monotonic(), saved.lease_version, saved.server_id)
            group = self._groups[saved.item.group_id]
            statuses = [self.add(traj) for traj in saved.samples]
            if not group.ready or set(statuses) != {"accepted"}:
                raise MalformedTrajectory(
                    f"saved group {saved.item.group_id!r} is not whole: {group.filled} of "
                    f"{len(group.samples)} samples placed ({sorted(set(statuses))})"
                )
            group.latencies = list(saved.latencies)
        self._seen = OrderedDict.fromkeys([*seen_ids, *self._seen])
        while len(self._seen) > self._seen_limit:
            self._seen.popitem(last=False)

    def in_flight_of(self, server_id: int) -> int:
        """Groups leased to `server_id` and not yet complete (kept as a count: asked on every
        lease, held ones included, after every accepted sample)."""
        return self._in_flight[server_id]

    def open_group(
        self, item: PromptItem, now: float, lease_version: int, server_id: int = 0
    ) -> None:
        if item.group_id in self._groups:
            raise ValueError(f"group {item.group_id!r} is already open")
        if item.n < 1:
            raise ValueError(f"group {item.group_id!r}: n must be >= 1, got {item.n}")
        self._groups[item.group_id] = Group(item, lease_version, now, server_id, [None] * item.n)
        self._in_flight[server_id] += 1

    def add(self, traj: Trajectory) -> AddStatus:
        """Place one sample. `duplicate`: this traj_id was seen before (any attempt), or its slot
        is already filled; `late`: its group is unknown, expired, dropped or consumed. Raises
        MalformedTrajectory when the sample cannot be trained on."""
        check_trajectory(traj, self.limits)
        if traj.traj_id in self._seen:
            return "duplicate"
        group = self._groups.get(traj.group_id)
        if group is not None and not 0 <= traj.sample_index < len(group.samples):
            raise MalformedTrajectory(
                f"sample_index {traj.sample_index} outside 0..{len(group.samples) - 1} "
                f"of group {traj.group_id!r}"
            )
        if group is not None and traj.server_id != group.server_id:
            raise MalformedTrajectory(
                f"group {traj.group_id!r} was leased to server {group.server_id}, "
                f"not server {traj.server_id}"
            )
        self._remember(traj.traj_id)
        if group is None:
            return "late"
        if traj.traj_id in group.traj_ids or group.samples[traj.sample_index] is not None:
            return "duplicate"
        group.samples[traj.sample_index] = traj
        group.traj_ids.add(traj.traj_id)
        group.filled += 1
        group.latencies.append(time.monotonic() - group.opened_at)
        v = sample_version(traj, group.lease_version)
        group.version = v if group.version is None else min(group.version, v)
        if group.ready:
            self._ready += 1
            self._in_flight[group.server_id] -= 1
        return "accepted"

    def pop_batch(
        self, learner_version: int, num_groups: int, max_staleness: int
    ) -> tuple[list[Group], int]:
        """Drop every ready group too stale for `learner_version`, then take exactly
        `num_groups` ready groups, oldest lease first, or none if fewer are ready.
        Returns (groups, number of groups dropped as stale)."""
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        stale = [
            g
            for g in self._groups.values()
            if g.ready and learner_version - _version(g) > max_staleness
        ]
        for g in stale:
            self._remove(g)
        if self._ready < num_groups:
            return [], len(stale)
        taken = []
        for g in self._groups.values():
            if g.ready:
                taken.append(g)
                if len(taken) == num_groups:
                    break
        for g in taken:
            self._remove(g)
        return taken, len(stale)

    def expire(self, now: float, lease_timeout_s: float) -> list[PromptItem]:
        """Drop incomplete groups leased more than `lease_timeout_s` ago; returns their prompts
        (so the caller can count and re-issue them)."""
        old = [
            g for g in self._groups.values() if not g.ready and now - g.opened_at > lease_timeout_s
        ]
        for g in old:
            self._remove(g)
        return [g.item for g in old]

    def drop_server(self, server_id: int) -> list[PromptItem]:
        """Drop the incomplete groups leased to `server_id` (declared dead, or replaced by a
        newer epoch); returns their prompts, to be re-issued. Its samples that arrive later
        are answered `late`, never trained."""
        dropped = [g for g in self._groups.values() if not g.ready and g.server_id == server_id]
        for g in dropped:
            self._remove(g)
        return [g.item for g in dropped]

    def drop_group(self, group_id: str, server_id: int) -> PromptItem | None:
        """Drop the incomplete group `group_id` if it is leased to `server_id` (that server
        could not sample it); its prompt, or None when no such group is in flight (complete,
        expired, taken back, or another server's). Its samples arriving later are `late`."""
        group = self._groups.get(group_id)
        if group is None or group.ready or group.server_id != server_id:
            return None
        self._remove(group)
        return group.item

    def ready_group(self, group_id: str) -> Group | None:
        """The group `group_id` if it is held and complete (None: incomplete or not held)."""
        group = self._groups.get(group_id)
        return group if group is not None and group.ready else None

    def drop_ready(self, group_id: str) -> None:
        """Drop the complete group `group_id` untrained (`replay.group_filter`); its samples'
        resends are answered `duplicate` or `late`, as for any group that left."""
        group = self.ready_group(group_id)
        if group is None:
            raise ValueError(f"group {group_id!r} is not a complete group of the buffer")
        self._remove(group)

    def _remove(self, group: Group) -> None:
        del self._groups[group.item.group_id]
        if group.ready:
            self._ready -= 1
        else:
            self._in_flight[group.server_id] -= 1

    def _remember(self, traj_id: str) -> None:
        self._seen[traj_id] = None
        while len(self._seen) > self._seen_limit:
            self._seen.popitem(last=False)


def _version(group: Group) -> int:
    return group.lease_version if group.version is None else group.version


def to_batch(request_id: int, groups: list[Group], stale_dropped: int) -> Batch:
    """Flatten whole groups into the wire layout of `Batch`; a group's samples stay
    consecutive, in sample_index order."""
    samples: list[Trajectory] = []
    group_ids: list[str] = []
    data_sources: list[str] = []
    for g in groups:
        whole = g.complete_samples()
        samples += whole
        group_ids += [g.item.group_id] * len(whole)
        data_sources += [g.item.data_source] * len(whole)

    names = sorted({k for s in samples for k in s.metrics})

    def offsets(arrays: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)

    def cat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
        return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)

    return Batch(
        request_id=request_id,
        traj_ids=[s.traj_id for s in samples],
        group_ids=group_ids,
        data_sources=data_sources,
        finish_reasons=[s.finish_reason for s in samples],
        rewards=np.array([s.reward for s in samples], np.float32),
        baseline_rewards=np.array([s.baseline_reward for s in samples], np.float32),
        prompt_offsets=offsets([s.prompt_ids for s in samples]),
        response_offsets=offsets([s.response_ids for s in samples]),
        prompt_ids=cat([s.prompt_ids for s in samples], np.int32),
        response_ids=cat([s.response_ids for s in samples], np.int32),
        loss_mask=cat([s.loss_mask for s in samples], np.uint8),
        behaviour_logprobs=cat([s.behaviour_logprobs for s in samples], np.float32),
        versions=cat([s.versions for s in samples], np.int32),
        metric_names=names,
        fleet={},
        metric_values=np.array(
            [s.metrics.get(k, np.nan) for s in samples for k in names], np.float32
        ),
        stale_dropped=stale_dropped,
    )
