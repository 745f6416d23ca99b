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
    evaluator      -> replay   EvalSubmit     -> Ack          (prompts leased first; in parts)
    evaluator      -> replay   EvalPoll       -> EvalResults  (scores so far; done when complete)
    learner rank 0 -> replay   CheckpointRequest -> Ack       (replay saves its data position)
    learner rank 0 -> replay   DeclareDead    -> Ack          (a server dropped from weight sync)
    replay         -> anyone   Error                          (a message it could not decode)

Every message is importable from here. The sample-carrying ones (`Trajectory`, `Trajectories`,
`Acks`, `BatchRequest`, `Batch`) are declared in `asyncrl.wire.samples`, and the bounds
every `validate()` checks in `asyncrl.wire.bounds`. (The vLLM worker's notices to its
rollout server: `rollout_servers.engines.vllm_notices`.)

Token ids, masks, log-probs and versions always travel as raw array frames (see `codec`).
Every message's `validate()` bounds its fields (the codec runs it on every decode); whether a
trajectory can be trained on is the replay's check (`replay.sample_checks.check_trajectory`), so its
sender gets an `Ack(rejected)` and stops resending.
"""

from __future__ import annotations

import math
from dataclasses import field
from typing import Literal

from asyncrl.wire.bounds import (
    MAX_SAMPLES_PER_PROMPT,
    check_id,
    check_index,
    check_seconds,
)
from asyncrl.wire.codec import Float32Array, Int32Array, JsonObject, check, message, struct


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
        check_id(self.group_id, "PromptItem.group_id")
        check_index(self.n, "PromptItem.n", low=1)
        check(self.n <= MAX_SAMPLES_PER_PROMPT, f"PromptItem.n {self.n} > {MAX_SAMPLES_PER_PROMPT}")
        check_id(self.data_source, "PromptItem.data_source", empty_ok=True)
        check_id(self.agent_name, "PromptItem.agent_name", empty_ok=True)
        check_id(self.eval_job, "PromptItem.eval_job", empty_ok=True)
        check(
            self.temperature is None or (math.isfinite(self.temperature) and self.temperature >= 0),
            f"PromptItem.temperature must be None or finite and >= 0, got {self.temperature}",
        )
        check_index(self.failures, "PromptItem.failures")


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
        check_index(self.request_id, "request_id")
        check_index(self.server_id, "server_id")
        check_index(self.server_version, "server_version")
        check_index(self.max_groups, "max_groups")
        check_seconds(self.engine_busy_s, "engine_busy_s")
        check_seconds(self.weight_apply_s, "weight_apply_s")
        check_seconds(self.uptime_s, "uptime_s")


@message("lease_grant")
class LeaseGrant:
    request_id: int  # the LeaseRequest answered
    prompts: list[PromptItem]  # may be empty: admission control or capacity said wait

    def validate(self) -> None:
        for p in self.prompts:
            p.validate()


@message("ack")
class Ack:
    request_id: int  # the request acknowledged (0 for trajectories)
    traj_id: str  # the trajectory acknowledged ("" for non-trajectory acks)
    # late: its group was already dropped; rejected: it decoded but cannot be trained on (the
    # sender logs and counts it and stops resending; `Ack` then carries no other detail)
    status: Literal["accepted", "duplicate", "late", "rejected", "ok"]


@message("version_update")
class VersionUpdate:
    request_id: int  # echoed in the Ack
    version: int  # the learner's new policy version (its weights are on every server)

    def validate(self) -> None:
        check_index(self.request_id, "request_id")
        check_index(self.version, "version")


@message("heartbeat")
class Heartbeat:
    request_id: int  # echoed in the Ack
    server_id: int  # the rollout server that is alive
    epoch: int  # its restart count (0: first start); a newer epoch replaces the older one

    def validate(self) -> None:
        for name in ("request_id", "server_id", "epoch"):
            check_index(getattr(self, name), name)


@message("declare_dead")
class DeclareDead:
    """Learner rank 0 stopped waiting for this server epoch in a weight sync (`replay.health`)."""

    request_id: int  # echoed in the Ack
    server_id: int
    epoch: int  # only this epoch: a newer one of the same server is left alone
    reason: str  # why, for the replay's log (at most 500 characters)

    def validate(self) -> None:
        for name in ("request_id", "server_id", "epoch"):
            check_index(getattr(self, name), name)
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
            check_index(getattr(self, name), name)
        check_id(self.group_id, "GroupFailed.group_id")
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
    # more parts of this job follow (a large job travels in parts under the sender's size
    # limit, `ReplayClient.submit_eval`); the job is not finished before its last part
    more: bool = False

    def validate(self) -> None:
        check_index(self.request_id, "request_id")
        check_id(self.job_id, "job_id")
        for p in self.prompts:
            p.validate()
            check(p.eval_job == self.job_id, f"prompt {p.group_id!r} not marked for this job")


@message("eval_poll")
class EvalPoll:
    request_id: int  # echoed in the reply
    job_id: str  # the job asked about

    def validate(self) -> None:
        check_index(self.request_id, "request_id")
        check_id(self.job_id, "job_id")


@message("eval_results")
class EvalResults:
    request_id: int  # the EvalPoll answered
    job_id: str  # the job
    expected: int  # samples the job will produce in all (not the empty slots of failed_groups)
    group_ids: list[str]  # [S] samples scored so far
    data_sources: list[str]  # [S]
    scores: Float32Array  # [S] reward of each sample
    response_lengths: Int32Array  # [S] response tokens of each sample
    versions: Int32Array  # [S] oldest policy version of each sample
    failed_groups: list[str] = field(default_factory=list)  # given up (`replay.max_group_failures`)

    def validate(self) -> None:
        s = len(self.group_ids)
        check(len(self.data_sources) == s, f"EvalResults.data_sources: {s} entries expected")
        for name in ("scores", "response_lengths", "versions"):
            check(getattr(self, name).shape == (s,), f"EvalResults.{name} must have shape [{s}]")


@message("checkpoint_request")
class CheckpointRequest:
    request_id: int  # echoed in the Ack
    path: str  # file the replay writes its whole state to, relative to the run directory
    version: int  # the learner version the checkpoint is taken at (the replay's current one)

    def validate(self) -> None:
        check_index(self.request_id, "request_id")
        check_index(self.version, "version")
        check(0 < len(self.path) <= 4096 and "\0" not in self.path, "bad checkpoint path")


@message("error")
class Error:
    reason: str  # why the last message was rejected
