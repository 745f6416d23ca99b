"""The messages that carry samples: trajectories up to the replay, batches down to the learner.

    rollout server -> replay   Trajectory     -> Ack          (accepted/duplicate/late/rejected)
    rollout server -> replay   Trajectories   -> Acks         (several at once: one status each)
    learner rank 0 -> replay   BatchRequest   -> Batch        (whole groups; may be empty)

Their token ids, masks, log-probs and versions travel as raw array frames (`asyncrl.wire.codec.Int32Array` and its siblings). Every
message is importable from `asyncrl.wire.protocol`, which lists them all.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from asyncrl.wire.bounds import (
    MAX_METRICS,
    MAX_TRAJECTORIES_PER_MESSAGE,
    check_id,
    check_index,
    check_offsets,
)
from asyncrl.wire.codec import (
    Float32Array,
    Float64Array,
    Int32Array,
    Int64Array,
    UInt8Array,
    check,
    message,
)


@message("trajectory")
class Trajectory:
    traj_id: str  # unique per trajectory, stable across resends
    attempt: int  # 0 on the first send, +1 on each resend
    group_id: str  # the lease this sample belongs to
    sample_index: int  # 0..n-1 within the group
    server_id: int  # which server generated it
    prompt_ids: Int32Array  # [P] prompt token ids (after the chat template)
    response_ids: Int32Array  # [R] everything after the prompt: sampled and tool tokens
    loss_mask: UInt8Array  # [R] 1 where the policy sampled the token, 0 elsewhere
    behaviour_logprobs: Float32Array  # [R] engine log-prob of each sampled token (0 where mask 0)
    versions: Int32Array  # [R] policy version that sampled each token (-1 where mask 0)
    reward: float  # scalar reward of the whole trajectory
    baseline_reward: float  # reward of the group's greedy answer (ReMax); NaN when not sampled
    finish_reason: str  # "stop" | "length" | agent-specific
    metrics: dict[str, float]  # per-trajectory extras (reward parts, turns, tool calls)

    def validate(self) -> None:
        """Ids and bounds only: whether it can be trained on (equal lengths, finite numbers) is
        `replay.sample_checks.check_trajectory`, answered with Ack(rejected)."""
        check_id(self.traj_id, "traj_id")
        check_id(self.group_id, "group_id")
        check_id(self.finish_reason, "finish_reason", empty_ok=True)
        check_index(self.attempt, "attempt")
        check_index(self.sample_index, "sample_index")
        check_index(self.server_id, "server_id")
        check(len(self.metrics) <= MAX_METRICS, f"{len(self.metrics)} metrics > {MAX_METRICS}")
        for key in self.metrics:
            check_id(key, "metric name")


@message("trajectories")
class Trajectories:
    """Several trajectories of one server in one message: what a server's agent loops finish in
    the same event-loop turn travels together (one header, one signature, one `Acks`). Sample i
    owns prompt_ids[prompt_offsets[i]:prompt_offsets[i+1]] and the response arrays
    [response_offsets[i]:response_offsets[i+1]]; `unpack()` gives each back as the `Trajectory`
    it would have been alone, and each is checked as if it came alone."""

    server_id: int  # the server that generated all of them
    traj_ids: list[str]  # [B]
    group_ids: list[str]  # [B]
    finish_reasons: list[str]  # [B]
    metrics: list[dict[str, float]]  # [B]
    attempts: Int32Array  # [B]
    sample_indices: Int32Array  # [B]
    rewards: Float64Array  # [B]
    baseline_rewards: Float64Array  # [B]
    prompt_offsets: Int64Array  # [B+1]
    response_offsets: Int64Array  # [B+1]
    prompt_ids: Int32Array  # [sum P]
    response_ids: Int32Array  # [sum R]
    loss_mask: UInt8Array  # [sum R]
    behaviour_logprobs: Float32Array  # [sum R]
    versions: Int32Array  # [sum R]

    @classmethod
    def pack(cls, trajs: list[Trajectory]) -> Trajectories:
        """One server's samples whose response arrays have one length each (`packable`)."""
        server_ids = {t.server_id for t in trajs}
        if len(server_ids) != 1 or not all(map(packable, trajs)):
            raise ValueError("one server's samples, each with equal-length response arrays")

        def cat(name: str, dtype: str) -> np.ndarray:
            return np.concatenate([np.asarray(getattr(t, name), dtype) for t in trajs])

        def offsets(name: str) -> np.ndarray:
            return np.cumsum([0] + [len(getattr(t, name)) for t in trajs], dtype=np.int64)

        return cls(
            server_id=trajs[0].server_id,
            traj_ids=[t.traj_id for t in trajs],
            group_ids=[t.group_id for t in trajs],
            finish_reasons=[t.finish_reason for t in trajs],
            metrics=[t.metrics for t in trajs],
            attempts=np.array([t.attempt for t in trajs], np.int32),
            sample_indices=np.array([t.sample_index for t in trajs], np.int32),
            rewards=np.array([t.reward for t in trajs], np.float64),
            baseline_rewards=np.array([t.baseline_reward for t in trajs], np.float64),
            prompt_offsets=offsets("prompt_ids"),
            response_offsets=offsets("response_ids"),
            prompt_ids=cat("prompt_ids", "int32"),
            response_ids=cat("response_ids", "int32"),
            loss_mask=cat("loss_mask", "uint8"),
            behaviour_logprobs=cat("behaviour_logprobs", "float32"),
            versions=cat("versions", "int32"),
        )

    def unpack(self) -> list[Trajectory]:
        """The samples, each with arrays of its own (a kept sample must not pin the message);
        not validated: the replay checks each one alone (`Trajectory.validate`)."""
        p, r = self.prompt_offsets.tolist(), self.response_offsets.tolist()
        return [
            Trajectory(
                traj_id=self.traj_ids[i],
                attempt=int(self.attempts[i]),
                group_id=self.group_ids[i],
                sample_index=int(self.sample_indices[i]),
                server_id=self.server_id,
                prompt_ids=self.prompt_ids[p[i] : p[i + 1]].copy(),
                response_ids=self.response_ids[r[i] : r[i + 1]].copy(),
                loss_mask=self.loss_mask[r[i] : r[i + 1]].copy(),
                behaviour_logprobs=self.behaviour_logprobs[r[i] : r[i + 1]].copy(),
                versions=self.versions[r[i] : r[i + 1]].copy(),
                reward=float(self.rewards[i]),
                baseline_reward=float(self.baseline_rewards[i]),
                finish_reason=self.finish_reasons[i],
                metrics=self.metrics[i],
            )
            for i in range(len(self.traj_ids))
        ]

    def validate(self) -> None:
        """Consistent lengths and offsets (each sample's own checks are the receiver's, so that
        a bad sample fails alone: `replay.service`)."""
        b = len(self.traj_ids)
        check(
            1 <= b <= MAX_TRAJECTORIES_PER_MESSAGE,
            f"Trajectories: {b} samples outside 1..{MAX_TRAJECTORIES_PER_MESSAGE}",
        )
        for name in ("group_ids", "finish_reasons", "metrics"):
            check(len(getattr(self, name)) == b, f"Trajectories.{name}: {b} entries expected")
        for name in ("attempts", "sample_indices", "rewards", "baseline_rewards"):
            check(getattr(self, name).shape == (b,), f"Trajectories.{name} must have shape [{b}]")
        n = len(self.response_ids)
        for name in ("loss_mask", "behaviour_logprobs", "versions"):
            check(getattr(self, name).shape == (n,), f"Trajectories.{name} must have shape [{n}]")
        check_offsets(self.prompt_offsets, b, len(self.prompt_ids), "Trajectories.prompt_offsets")
        check_offsets(self.response_offsets, b, n, "Trajectories.response_offsets")
        check_index(self.server_id, "server_id")


def packable(traj: Trajectory) -> bool:
    """Whether `traj` fits in a `Trajectories` (its response arrays share offsets); one that
    does not is sent alone, for the replay to answer `rejected`."""
    n = len(traj.response_ids)
    return len(traj.loss_mask) == len(traj.behaviour_logprobs) == len(traj.versions) == n


@message("acks")
class Acks:
    """The replay's answer to `Trajectories`: one status per sample, in the message's order."""

    traj_ids: list[str]
    statuses: list[Literal["accepted", "duplicate", "late", "rejected"]]

    def validate(self) -> None:
        check(len(self.statuses) == len(self.traj_ids), "Acks: one status per traj_id")


@message("batch_request")
class BatchRequest:
    request_id: int  # echoed in the reply
    learner_version: int  # the version the learner will train at (staleness is checked against it)
    num_groups: int  # whole groups wanted

    def validate(self) -> None:
        check_index(self.request_id, "request_id")
        check_index(self.learner_version, "learner_version")
        check_index(self.num_groups, "num_groups", low=1)


@message("batch")
class Batch:
    """Whole groups, flattened: sample i owns prompt_ids[prompt_offsets[i]:prompt_offsets[i+1]]
    and response arrays [response_offsets[i]:response_offsets[i+1]]."""

    request_id: int  # the BatchRequest answered
    traj_ids: list[str]  # [B] samples, group by group
    group_ids: list[str]  # [B] group of each sample (consecutive samples share a group)
    data_sources: list[str]  # [B]
    finish_reasons: list[str]  # [B]
    rewards: Float32Array  # [B]
    baseline_rewards: Float32Array  # [B] greedy-baseline reward (ReMax), NaN when absent
    prompt_offsets: Int64Array  # [B+1]
    response_offsets: Int64Array  # [B+1]
    prompt_ids: Int32Array  # [sum P]
    response_ids: Int32Array  # [sum R]
    loss_mask: UInt8Array  # [sum R]
    behaviour_logprobs: Float32Array  # [sum R]
    versions: Int32Array  # [sum R]
    metric_names: list[str]  # [K] union of the samples' Trajectory.metrics keys
    metric_values: Float32Array  # [B * K] row-major; NaN where a sample lacks a metric
    fleet: dict[str, float]  # replay occupancy, servers' idle ratio and pause, sample latency
    stale_dropped: int  # groups dropped as too stale while assembling this batch

    def validate(self) -> None:
        """The learner's edge: offsets that index inside the arrays, one entry per sample in
        every list, and numbers that are numbers (a reward, a log-prob or a metric that is not
        finite in float32 names itself here instead of poisoning a step)."""
        b, k = len(self.traj_ids), len(self.metric_names)
        for name in ("group_ids", "data_sources", "finish_reasons"):
            check(len(getattr(self, name)) == b, f"Batch.{name}: {b} entries expected")
        for name in ("rewards", "baseline_rewards"):
            check(getattr(self, name).shape == (b,), f"Batch.{name} must have shape [{b}]")
        check(self.metric_values.shape == (b * k,), f"Batch.metric_values must be [{b * k}]")
        r = len(self.response_ids)
        for name in ("loss_mask", "behaviour_logprobs", "versions"):
            check(getattr(self, name).shape == (r,), f"Batch.{name} must have shape [{r}]")
        check_offsets(self.prompt_offsets, b, len(self.prompt_ids), "Batch.prompt_offsets")
        check_offsets(self.response_offsets, b, r, "Batch.response_offsets")
        check(bool(np.isfinite(self.rewards).all()), "Batch.rewards: a reward is not finite")
        sampled = self.loss_mask == 1
        check(
            bool(np.isfinite(self.behaviour_logprobs[sampled]).all()),
            "Batch.behaviour_logprobs: a sampled token's log-prob is not finite",
        )
        check(not np.isinf(self.metric_values).any(), "Batch.metric_values: an infinite metric")
