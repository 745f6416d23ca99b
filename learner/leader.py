"""Learner rank 0's coordinator: the one learner process that talks to the rest of the run.

`Leader` implements `learner.coordinator.Coordinator` over components it is handed, built by
`setup_leader`: the replay's client (batches, versions, validation jobs, the replay's part of a
checkpoint), the weight sync's fleet (`learner.sync_fleet`), the loggers (metrics.jsonl and
the others of `trainer.logger`), the trace, samples.jsonl (`trainer.log_samples`) and
weights_learner.jsonl (`learner.weight_checksum`). It never trains: the SPMD stages are
`trainer.Learner`'s, on every rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.config import Config
from asyncrl.evaluation import eval_prompts, load_eval_rows, run_eval_job
from asyncrl.loggers import MetricsLogger, setup_loggers
from asyncrl.metrics import JsonlWriter, peak_rss_mb, write_json_atomic
from asyncrl.run_spec import RunSpec
from asyncrl.trace import SpanWriter
from asyncrl.weights.layout import weights_checksum
from asyncrl.wire.auth import key_from_env
from asyncrl.wire.protocol import PromptItem
from asyncrl.wire.replay_client import ReplayClient
from asyncrl.wire.samples import Batch
from learner.coordinator import StepOutcome, Weights
from learner.sync_fleet import SyncFleet, as_sent, sent_tensors, setup_sync_fleet
from learner.version_stats import oldest_versions, version_stats

log = logging.getLogger("asyncrl.learner")


class Leader:
    """The coordinator of learner rank 0 (`learner.coordinator.Coordinator`)."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        replay: ReplayClient,
        fleet: SyncFleet,
        loggers: MetricsLogger,
        trace: SpanWriter,
        val_rows: list[dict[str, Any]],
        samples: JsonlWriter | None,
        weight_log: JsonlWriter | None,
    ):
        """`samples`: samples.jsonl, when trainer.log_samples; `weight_log`:
        weights_learner.jsonl, when learner.weight_checksum."""
        self.cfg, self.run_dir, self.replay, self.fleet = cfg, run_dir, replay, fleet
        self.loggers, self.trace, self.val_rows = loggers, trace, val_rows
        self.samples, self.weight_log = samples, weight_log
        self._fetched: Batch | None = None  # the last batch handed over, until its step's log
        self._joins_waiting = False  # why the last fetch or validation ended early
        # the validation waited for: (version, job id, prompts, deadline)
        self._validation: tuple[int, str, list[PromptItem], float] | None = None

    def fetch_batch(self, version: int, should_stop: Callable[[], bool]) -> Batch | None:
        """The replay's next whole groups trainable at `version`, kept for the step's log;
        None at a stop, or as soon as a restarted server waits to join (`joins_waiting`)."""
        self._joins_waiting = False
        self._fetched = None

        def stop_or_join() -> bool:
            if should_stop():
                return True
            self._joins_waiting = self.fleet.joins_waiting(version)
            return self._joins_waiting

        self._fetched = self.replay.fetch_batch(
            version,
            self.cfg.data.train_batch_size,
            should_stop=stop_or_join,
            give_up_s=self.cfg.trainer.batch_wait_timeout_s,
        )
        return self._fetched

    def joins_waiting(self) -> bool:
        return self._joins_waiting

    def catch_up(self, weights: Weights) -> None:
        """Join the waiting servers and bring them to `weights.version` (`SyncFleet.catch_up`)."""
        tensors = sent_tensors(weights.specs, weights.tensors)
        joined = self.fleet.catch_up(weights.specs, tensors, weights.version, weights.probe)
        log.info(
            "weight sync: version %d sent to the servers that joined: %s", weights.version, joined
        )

    def deliver_weights(self, weights: Weights) -> str | None:
        """Send to every member of the weight sync; log which members have the version and
        its checksum (learner.weight_checksum), which is returned."""
        hashed: list | None = [] if self.weight_log is not None else None
        tensors = sent_tensors(weights.specs, weights.tensors, hashed)
        members = self.fleet.broadcast(weights.specs, tensors, weights.version, weights.probe)
        if self.weight_log is None or hashed is None:
            return None
        digest = weights_checksum(hashed)
        # members: server id -> epoch of each server that acknowledged this version
        delivered = {str(server): epoch for server, epoch in sorted(members.items())}
        self.weight_log.write(
            {"version": weights.version, "checksum": digest, "members": delivered}
        )
        return digest

    def record_weights(self, weights: Weights) -> None:
        """Log the checksum of weights the servers hold already (learner.weight_checksum)."""
        if self.weight_log is None:  # nothing to record: only the gathers
            for _ in weights.tensors:
                pass
            return
        pairs = zip(weights.specs, weights.tensors, strict=True)
        sent = ((name, as_sent(t, spec.dtype)) for spec, (name, t) in pairs)
        self.weight_log.write({"version": weights.version, "checksum": weights_checksum(sent)})

    def publish_version(self, version: int) -> None:
        self.replay.publish_version(version)

    def validate(self, version: int) -> dict[str, float]:
        """The validation set as an evaluation job (leased before any training prompt, never
        trained on), waiting for every score; {} as soon as a restarted server waits to join
        (`joins_waiting`: with one server its prompts wait for it, and it for its weights),
        and the next call waits for the same job, within what is left of its timeout."""
        self._joins_waiting = False
        if self._validation is None or self._validation[0] != version:
            dc, job = self.cfg.data, f"val-{version}-{time.time_ns()}"
            prompts = eval_prompts(self.val_rows, dc.val_n, dc.val_temperature, job)
            deadline = time.monotonic() + self.cfg.trainer.val_timeout_s
            self._validation, submit = (version, job, prompts, deadline), True
        else:
            _, job, prompts, deadline = self._validation
            submit = False

        def break_off_for_joins(done: int, expected: int) -> None:
            if self.fleet.joins_waiting(version):
                raise _JoinsWaiting

        left = max(deadline - time.monotonic(), 0.0)
        try:
            summary = run_eval_job(
                self.replay, prompts, job, left, progress=break_off_for_joins, submit=submit
            )
        except _JoinsWaiting:
            self._joins_waiting = True
            return {}
        self._validation = None
        log.info("validation at version %d: mean score %.4f", version, summary["mean_score"])
        return {f"val/{k}": v for k, v in summary.items()}

    def log(self, version: int, metrics: dict[str, float], step: StepOutcome | None = None) -> None:
        """A record of `version`; a step's also gets its trace spans and its samples line."""
        if step is None:
            self.loggers.log(
                {"step": version, "version": version, "time": time.time(), **metrics}, version
            )
            return
        assert self._fetched is not None, "a step is logged after its batch was fetched"
        msg, trained = self._fetched, step.version
        self.loggers.log(step_record(step, msg, metrics, self.cfg.replay.max_staleness), version)
        for name, start, took in step.timer.spans:
            self.trace.record(name, "learner", start, took, step=version)
        if self.samples is not None:
            batch = step.batch
            self.samples.write(
                {
                    "step": version,
                    "learner_version": trained,
                    "traj_ids": msg.traj_ids,
                    "group_ids": sorted(set(msg.group_ids)),
                    "oldest_versions": [
                        int(v) for v in oldest_versions(batch.versions, batch.loss_mask, trained)
                    ],
                }
            )

    def checkpoint(self, path: str, version: int) -> None:
        self.replay.checkpoint(path, version)

    def shutdown(self) -> None:
        self.fleet.shutdown()
        self.loggers.close()
        self.trace.flush()

    def close(self) -> None:
        write_json_atomic(self.run_dir / "stats" / "learner.json", {"peak_rss_mb": peak_rss_mb()})


class _JoinsWaiting(Exception):
    """Breaks off a validation's wait: a restarted server waits to join the weight sync."""


def step_record(
    step: StepOutcome, msg: Batch, metrics: dict[str, float], max_staleness: int
) -> dict[str, Any]:
    """One training step's record (the keys of metrics.jsonl that tools and tests read)."""
    batch, timer, version = step.batch, step.timer, step.version
    lengths = [int(x) for x in msg.response_offsets[1:] - msg.response_offsets[:-1]]
    gen_tokens = float(batch.loss_mask.sum())
    record: dict[str, Any] = {
        "step": version + 1,
        "version": version + 1,
        "time": time.time(),
        "reward_mean": float(batch.rewards.mean()),
        "reward_std": float(batch.rewards.std()),
        "samples": batch.size,
        "response_len_mean": sum(lengths) / max(len(lengths), 1),
        **version_stats(batch.versions, batch.loss_mask, version, max_staleness),
        "stale_dropped": msg.stale_dropped,
        "zero_variance_groups": zero_variance_groups(msg),
        **trajectory_metric_means(msg),
        **dict(msg.fleet),
        "response_len_p50": float(np.percentile(lengths, 50)),
        "response_len_max": float(max(lengths)),
        "train_tokens_per_s": float(batch.attention_mask.sum()) / timer.seconds["update"],
        "weight_sync_s": timer.seconds["broadcast_weights"],
        **metrics,
        "step_time_s": step.step_time_s,
        "samples_per_s": batch.size / step.step_time_s,
        "gen_tokens_per_s": gen_tokens / step.step_time_s,
        "learner_idle_ratio": timer.seconds["fetch_batch"] / step.step_time_s,
        **{f"time_{k}_s": v for k, v in timer.seconds.items()},
        "peak_rss_mb": peak_rss_mb(),
    }
    if step.checksum is not None:
        record["weights_checksum"] = step.checksum
    return record


def zero_variance_groups(msg: Batch) -> int:
    """Groups of the batch whose samples all have the same reward (no GRPO signal: what
    `replay.filter_groups` keeps out of batches); a group of one sample does not count."""
    rewards: dict[str, list[float]] = {}
    for group_id, reward in zip(msg.group_ids, msg.rewards.tolist(), strict=True):
        rewards.setdefault(group_id, []).append(reward)
    return sum(1 for r in rewards.values() if len(r) > 1 and max(r) == min(r))


def trajectory_metric_means(msg: Batch) -> dict[str, float]:
    """Per-step means of the samples' own metrics (tool calls, turns, reward parts), as
    `traj/<name>`; a sample without a metric does not count toward its mean."""
    if not msg.metric_names:
        return {}
    values = msg.metric_values.reshape(len(msg.traj_ids), len(msg.metric_names))
    out = {}
    for k, name in enumerate(msg.metric_names):
        column = values[:, k]
        column = column[np.isfinite(column)]
        if len(column):
            out[f"traj/{name}"] = float(column.mean())
    return out


def setup_leader(cfg: Config, spec: RunSpec, device: torch.device) -> Leader:
    """Rank 0's coordinator for a run: the replay's client (signed with the learner's key), the
    weight sync's fleet on the sync port, the loggers, trace and logs under the run directory,
    and the validation rows (`data.val_files`, else the task's own)."""
    run_dir = Path(spec.run_dir)
    replay = ReplayClient(spec.replay_address, key_from_env("learner"))
    return Leader(
        cfg,
        run_dir,
        replay,
        setup_sync_fleet(cfg, spec, device, replay),
        setup_loggers(cfg.trainer.logger, run_dir, cfg.model_dump(mode="json")),
        SpanWriter(run_dir / "trace" / "learner_0.jsonl"),
        load_eval_rows(cfg.data.val_files, cfg.data),
        JsonlWriter(run_dir / "samples.jsonl") if cfg.trainer.log_samples else None,
        JsonlWriter(run_dir / "weights_learner.jsonl") if cfg.learner.weight_checksum else None,
    )
