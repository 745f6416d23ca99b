"""Every message that crosses a process boundary, one typed schema each.

Who sends what (replies echo the request's `request_id`):

    rollout server -> replay   LeaseRequest   -> LeaseGrant   (prompts to sample; may be empty)
    rollout server -> replay   Trajectory     -> Ack          (accepted/duplicate/late/rejected)
    rollout server -> replay   Trajectories   -> Acks         (several at once: one status each)
    rollout server -> replay   Heartbeat      -> Ack          (ok; rejected: declared dead)
    rollout server -> replay   GroupFailed    -> Ack          (a leased group it cannot sample)
    learner rank 0 -> replay   BatchRequest   -> Batch        (whole groups; may be empty)
    learner rank 0 -> replay   VersionUpdate  -> Ack
    anyone         -> replay   StatsRequest   -> Stats        (counters for progress and tests)
    evaluator      -> replay   EvalSubmit     -> Ack          (prompts leased before training ones)
    evaluator      -> replay   EvalPoll       -> EvalResults  (scores so far; done when complete)
    learner rank 0 -> replay   CheckpointRequest -> Ack       (replay saves its data position)
    learner rank 0 -> replay   DeclareDead    -> Ack          (a server dropped from weight sync)
    replay         -> anyone   Error                          (a message it could not decode)

(The vLLM worker's notices to its rollout server: `rollout_servers.engines.vllm_notices`.)

Token ids, masks, log-probs and versions always travel as raw array frames (see `codec`).
Every message's `validate()` bounds its fields (the codec runs it on every decode); whether a
trajectory can be trained on is the replay's check (`replay.buffer.check_trajectory`), so its
sender gets an `Ack(rejected)` and stops resending.
"""

from __future__ import annotations

import math
from dataclasses import field
from typing import Literal

import numpy as np

from asyncrl.codec import Array, JsonObject, check, message, struct

MAX_ID_CHARS = 256  # traj_id, group_id, job_id, data_source, agent names
MAX_SAMPLES_PER_PROMPT = 1024  # PromptItem.n
MAX_METRICS = 256  # Trajectory.metrics entries
MAX_TRAJECTORIES_PER_MESSAGE = 4096  # Trajectories
MAX_INDEX = 2**31 - 1  # server ids, sample indices, versions, counts (they travel as int32)
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_ABS_REWARD = 1e6
"""Largest |reward| a sample may carry. Finite in float32 is not enough: two rewards of 3e38
in one group overflow the group's mean and std; no reward of an LM task comes near this."""


def _check_id(value: str, name: str, empty_ok: bool = False) -> None:
    check(
        (empty_ok or bool(value)) and len(value) <= MAX_ID_CHARS,
        f"{name} must have {0 if empty_ok else 1}..{MAX_ID_CHARS} characters, got {len(value)}",
    )


def _check_index(value: int, name: str, low: int = 0) -> None:
    check(low <= value <= MAX_INDEX, f"{name} {value} outside {low}..{MAX_INDEX}")


def finite32(value: float) -> bool:
    """Whether `value` stays a finite number once stored as float32 (1e39 does not)."""
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def plausible_reward(value: float) -> bool:
    """Whether `value` can be a reward: finite, |value| <= MAX_ABS_REWARD."""
    return math.isfinite(value) and abs(value) <= MAX_ABS_REWARD


def _check_seconds(value: float, name: str) -> None:
    check(math.isfinite(value) and value >= 0, f"{name} must be finite and >= 0, got {value}")


@struct
class ChatMessage:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str  # the message text


@struct
class PromptItem:
    group_id: str  # unique per lease; all n samples of this prompt share it
    n: int  # samples the server must return for this group
    data_source: str  # selects the reward function
    messages: list[ChatMessage]  # the prompt as chat messages (rendered by the server's template)
    ground_truth: str  # reward_model.ground_truth of the row
    extra_info: JsonObject  # the row's extra_info (free-form; reward functions read it)
    agent_name: str = ""  # the row's agent loop ("": the config's default)
    tools_kwargs: JsonObject = field(default_factory=dict)  # {tool: {create_kwargs: {...}}}
    interaction_kwargs: JsonObject = field(default_factory=dict)  # {name: ..., start kwargs}
    eval_job: str = ""  # "" for training; else the evaluation job this prompt belongs to
    temperature: float | None = None  # sampling temperature; None: the server's default
    failures: int = 0  # times a server could not sample this row before (`GroupFailed`)

    def validate(self) -> None:
        _check_id(self.group_id, "PromptItem.group_id")
        _check_index(self.n, "PromptItem.n", low=1)
        check(self.n <= MAX_SAMPLES_PER_PROMPT, f"PromptItem.n {self.n} > {MAX_SAMPLES_PER_PROMPT}")
        _check_id(self.data_source, "PromptItem.data_source", empty_ok=True)
        _check_id(self.agent_name, "PromptItem.agent_name", empty_ok=True)
        _check_id(self.eval_job, "PromptItem.eval_job", empty_ok=True)
        check(
            self.temperature is None or (math.isfinite(self.temperature) and self.temperature >= 0),
            f"PromptItem.temperature must be None or finite and >= 0, got {self.temperature}",
        )
        _check_index(self.failures, "PromptItem.failures")


@message("lease_request")
class LeaseRequest:
    request_id: int  # echoed in the reply
    server_id: int  # which rollout server asks
    server_version: int  # policy version the server's engine holds now
    max_groups: int  # most prompts the server can take now
    engine_busy_s: float = 0.0  # cumulative seconds the engine spent sampling
    weight_apply_s: float = 0.0  # cumulative seconds generation was paused applying weights
    uptime_s: float = 0.0  # seconds since the server's main loop started

    def validate(self) -> None:
        _check_index(self.request_id, "request_id")
        _check_index(self.server_id, "server_id")
        _check_index(self.server_version, "server_version")
        _check_index(self.max_groups, "max_groups")
        _check_seconds(self.engine_busy_s, "engine_busy_s")
        _check_seconds(self.weight_apply_s, "weight_apply_s")
        _check_seconds(self.uptime_s, "uptime_s")


@message("lease_grant")
class LeaseGrant:
    request_id: int  # the LeaseRequest answered
    prompts: list[PromptItem]  # may be empty: admission control or capacity said wait

    def validate(self) -> None:
        for p in self.prompts:
            p.validate()


@message("trajectory")
class Trajectory:
    traj_id: str  # unique per trajectory, stable across resends
    attempt: int  # 0 on the first send, +1 on each resend
    group_id: str  # the lease this sample belongs to
    sample_index: int  # 0..n-1 within the group
    server_id: int  # which server generated it
    prompt_ids: Array("int32")  # [P] prompt token ids (after the chat template)
    response_ids: Array("int32")  # [R] everything after the prompt: sampled and tool tokens
    loss_mask: Array("uint8")  # [R] 1 where the policy sampled the token, 0 elsewhere
    behaviour_logprobs: Array(
        "float32"
    )  # [R] engine log-prob of each sampled token (0 where mask 0)
    versions: Array("int32")  # [R] policy version that sampled each token (-1 where mask 0)
    reward: float  # scalar reward of the whole trajectory
    baseline_reward: float  # reward of the group's greedy answer (ReMax); NaN when not sampled
    finish_reason: str  # "stop" | "length" | agent-specific
    metrics: dict[str, float]  # per-trajectory extras (reward parts, turns, tool calls)

    def validate(self) -> None:
        """Ids and bounds only: whether it can be trained on (equal lengths, finite numbers) is
        `replay.buffer.check_trajectory`, answered with Ack(rejected)."""
        _check_id(self.traj_id, "traj_id")
        _check_id(self.group_id, "group_id")
        _check_id(self.finish_reason, "finish_reason", empty_ok=True)
        _check_index(self.attempt, "attempt")
        _check_index(self.sample_index, "sample_index")
        _check_index(self.server_id, "server_id")
        check(len(self.metrics) <= MAX_METRICS, f"{len(self.metrics)} metrics > {MAX_METRICS}")
        for key in self.metrics:
            _check_id(key, "metric name")


@message("ack")
class Ack:
    request_id: int  # the request acknowledged (0 for trajectories)
    traj_id: str  # the trajectory acknowledged ("" for non-trajectory acks)
    # late: its group was already dropped; rejected: it decoded but cannot be trained on (the
    # sender logs and counts it and stops resending; `Ack` then carries no other detail)
    status: Literal["accepted", "duplicate", "late", "rejected", "ok"]


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
    attempts: Array("int32")  # [B]
    sample_indices: Array("int32")  # [B]
    rewards: Array("float64")  # [B]
    baseline_rewards: Array("float64")  # [B]
    prompt_offsets: Array("int64")  # [B+1]
    response_offsets: Array("int64")  # [B+1]
    prompt_ids: Array("int32")  # [sum P]
    response_ids: Array("int32")  # [sum R]
    loss_mask: Array("uint8")  # [sum R]
    behaviour_logprobs: Array("float32")  # [sum R]
    versions: Array("int32")  # [sum R]

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
        _check_offsets(self.prompt_offsets, b, len(self.prompt_ids), "Trajectories.prompt_offsets")
        _check_offsets(self.response_offsets, b, n, "Trajectories.response_offsets")
        _check_index(self.server_id, "server_id")


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
        _check_index(self.request_id, "request_id")
        _check_index(self.learner_version, "learner_version")
        _check_index(self.num_groups, "num_groups", low=1)


@message("batch")
class Batch:
    """Whole groups, flattened: sample i owns prompt_ids[prompt_offsets[i]:prompt_offsets[i+1]]
    and response arrays [response_offsets[i]:response_offsets[i+1]]."""

    request_id: int  # the BatchRequest answered
    traj_ids: list[str]  # [B] samples, group by group
    group_ids: list[str]  # [B] group of each sample (consecutive samples share a group)
    data_sources: list[str]  # [B]
    finish_reasons: list[str]  # [B]
    rewards: Array("float32")  # [B]
    baseline_rewards: Array("float32")  # [B] greedy-baseline reward (ReMax), NaN when absent
    prompt_offsets: Array("int64")  # [B+1]
    response_offsets: Array("int64")  # [B+1]
    prompt_ids: Array("int32")  # [sum P]
    response_ids: Array("int32")  # [sum R]
    loss_mask: Array("uint8")  # [sum R]
    behaviour_logprobs: Array("float32")  # [sum R]
    versions: Array("int32")  # [sum R]
    metric_names: list[str]  # [K] union of the samples' Trajectory.metrics keys
    metric_values: Array("float32")  # [B * K] row-major; NaN where a sample lacks a metric
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
        _check_offsets(self.prompt_offsets, b, len(self.prompt_ids), "Batch.prompt_offsets")
        _check_offsets(self.response_offsets, b, r, "Batch.response_offsets")
        check(bool(np.isfinite(self.rewards).all()), "Batch.rewards: a reward is not finite")
        sampled = self.loss_mask == 1
        check(
            bool(np.isfinite(self.behaviour_logprobs[sampled]).all()),
            "Batch.behaviour_logprobs: a sampled token's log-prob is not finite",
        )
        check(not np.isinf(self.metric_values).any(), "Batch.metric_values: an infinite metric")


@message("version_update")
class VersionUpdate:
    request_id: int  # echoed in the Ack
    version: int  # the learner's new policy version (its weights are on every server)

    def validate(self) -> None:
        _check_index(self.request_id, "request_id")
        _check_index(self.version, "version")


@message("heartbeat")
class Heartbeat:
    request_id: int  # echoed in the Ack
    server_id: int  # the rollout server that is alive
    epoch: int  # its restart count (0: first start); a newer epoch replaces the older one

    def validate(self) -> None:
        for name in ("request_id", "server_id", "epoch"):
            _check_index(getattr(self, name), name)


@message("declare_dead")
class DeclareDead:
    """Learner rank 0 stopped waiting for this server epoch in a weight sync (`replay.health`)."""

    request_id: int  # echoed in the Ack
    server_id: int
    epoch: int  # only this epoch: a newer one of the same server is left alone
    reason: str  # why, for the replay's log (at most 500 characters)

    def validate(self) -> None:
        for name in ("request_id", "server_id", "epoch"):
            _check_index(getattr(self, name), name)
        check(len(self.reason) <= 500, "DeclareDead: reason longer than 500 characters")


@message("group_failed")
class GroupFailed:
    """A rollout server could not sample a group leased to it (`replay.leases.LeaseDesk.fail`)."""

    request_id: int  # echoed in the Ack
    server_id: int  # the server the group was leased to
    group_id: str
    error: str  # what went wrong, for the replay's log and failed_groups.jsonl (<= 500 chars)

    def validate(self) -> None:
        for name in ("request_id", "server_id"):
            _check_index(getattr(self, name), name)
        _check_id(self.group_id, "GroupFailed.group_id")
        check(len(self.error) <= 500, "GroupFailed: error longer than 500 characters")


@message("stats_request")
class StatsRequest:
    request_id: int  # echoed in the reply


@struct
class ServerHealth:
    server_id: int  # a rollout server the replay has heard a heartbeat from
    epoch: int  # the restart count of its latest heartbeat
    alive: bool  # False: declared dead (silent for launch.server_timeout_s, or DeclareDead)
    silent_s: float  # seconds since its latest heartbeat
    in_flight: int  # incomplete training groups leased to it now


@message("stats")
class Stats:
    request_id: int  # the StatsRequest answered
    counters: dict[str, float]  # named counters and gauges of the replay
    servers: list[ServerHealth] = field(default_factory=list)  # by server id (`replay.health`)


@message("eval_submit")
class EvalSubmit:
    request_id: int  # echoed in the Ack
    job_id: str  # unique name of the job (prompts carry it as eval_job)
    prompts: list[PromptItem]  # each sampled prompt.n times; never trained on

    def validate(self) -> None:
        _check_index(self.request_id, "request_id")
        _check_id(self.job_id, "job_id")
        for p in self.prompts:
            p.validate()
            check(p.eval_job == self.job_id, f"prompt {p.group_id!r} not marked for this job")


@message("eval_poll")
class EvalPoll:
    request_id: int  # echoed in the reply
    job_id: str  # the job asked about

    def validate(self) -> None:
        _check_index(self.request_id, "request_id")
        _check_id(self.job_id, "job_id")


@message("eval_results")
class EvalResults:
    request_id: int  # the EvalPoll answered
    job_id: str  # the job
    expected: int  # samples the job will produce in all (not the empty slots of failed_groups)
    group_ids: list[str]  # [S] samples scored so far
    data_sources: list[str]  # [S]
    scores: Array("float32")  # [S] reward of each sample
    response_lengths: Array("int32")  # [S] response tokens of each sample
    versions: Array("int32")  # [S] oldest policy version of each sample
    failed_groups: list[str] = field(default_factory=list)  # given up (`replay.max_group_failures`)

    def validate(self) -> None:
        s = len(self.group_ids)
        check(len(self.data_sources) == s, f"EvalResults.data_sources: {s} entries expected")
        for name in ("scores", "response_lengths", "versions"):
            check(getattr(self, name).shape == (s,), f"EvalResults.{name} must have shape [{s}]")


@message("checkpoint_request")
class CheckpointRequest:
    request_id: int  # echoed in the Ack
    path: str  # file the replay writes its whole state to (inside the run directory)
    version: int  # the learner version the checkpoint is taken at (the replay's current one)

    def validate(self) -> None:
        _check_index(self.request_id, "request_id")
        _check_index(self.version, "version")
        check(0 < len(self.path) <= 4096 and "\0" not in self.path, "bad checkpoint path")


@message("error")
class Error:
    reason: str  # why the last message was rejected


def _check_offsets(offsets: np.ndarray, b: int, total: int, name: str) -> None:
    check(offsets.shape == (b + 1,), f"{name} must have shape [{b + 1}]")
    check(
        offsets[0] == 0 and offsets[-1] == total and bool((np.diff(offsets) >= 0).all()),
        f"{name} must rise from 0 to {total}",
    )
