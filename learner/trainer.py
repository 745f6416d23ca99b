"""The learner main loop: fetch a batch, compute advantages, update, broadcast, publish.

Invariants:
- The learner trains at version w = number of optimizer steps taken; it asks the replay for
  groups trainable at w, so no token older than `replay.max_staleness` versions reaches the loss.
- After step w the weights of version w + 1 are on every rollout server that is a member of
  the weight sync (the broadcast returns when each has acknowledged them, or has been dropped:
  `learner.sync_fleet`) before the replay hears of version w + 1.
- Every rank runs the same number of forward/backward passes (FSDP collectives pair up).

A step is a list of named, timed stages: fetch_batch, compute_logprobs (proximal / reference /
values, only those the algorithm needs), compute_advantages, update, broadcast_weights,
publish_version.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.advantages import ESTIMATORS, compute_advantages, outcome_token_rewards
from asyncrl.auth import key_from_env
from asyncrl.config import Config
from asyncrl.evaluation import eval_prompts, load_eval_rows, run_eval_job
from asyncrl.loggers import setup_loggers
from asyncrl.metrics import JsonlWriter, StageTimer, peak_rss_mb, write_json_atomic
from asyncrl.protocol import Batch
from asyncrl.replay_client import ReplayClient
from asyncrl.run_spec import RunSpec
from asyncrl.trace import SpanWriter
from asyncrl.weight_sync import weights_checksum
from learner.batch import TrainBatch, broadcast_batch, from_message
from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.delivery import delivery_probe, wants_probe
from learner.forward import policy_forward, value_forward
from learner.fsdp import (
    iter_full_tensors,
    setup_distributed,
    setup_model,
    sync_specs,
    sync_tensors,
)
from learner.lora import is_adapted, merged_state, save_adapter
from learner.kl import AdaptiveKLController, FixedKLController, kl_penalty
from learner.losses import importance_weights, mismatch_kl, rejection_mask
from learner.optim import lr_factor, set_lr, setup_optimizer
from learner.sync_fleet import SyncFleet, as_sent, sent_tensors, setup_sync_fleet
from learner.update import UpdateInputs, Updater, recompute
from learner.version_stats import oldest_versions, version_stats

log = logging.getLogger("asyncrl.learner")


class Learner:
    """One learner rank. Rank 0 also talks to the replay and broadcasts weights."""

    def __init__(self, cfg: Config, spec: RunSpec, rank: int, world: int, device: torch.device):
        self.cfg, self.spec, self.rank, self.world, self.device = cfg, spec, rank, world, device
        self.stop_requested = False
        lc = cfg.learner
        self.model = setup_model(spec.model_path, device, lc)  # in training mode
        self.optimizer = setup_optimizer(self.model, lc.lr, lc)
        self.sync_dtype = getattr(torch, cfg.rollout.dtype)  # weights go out in the engine's
        self.specs = sync_specs(self.model, self.sync_dtype)  # LoRA: the adapters only
        self.temperature = cfg.rollout.temperature or 1.0
        algo = cfg.algorithm
        self.needs_proximal = algo.decoupled or algo.is_level != "off" or algo.reject_level != "off"
        self.ref_model = None
        if algo.use_kl_in_reward or algo.use_kl_loss:
            self.ref_model = setup_model(spec.model_path, device, lc, trainable=False)
        self.critic = self.critic_optimizer = None
        if ESTIMATORS[algo.adv_estimator].needs_critic:
            self.critic = setup_model(spec.model_path, device, lc, head="value")
            self.critic_optimizer = setup_optimizer(self.critic, lc.critic_lr, lc)
        self.kl_ctrl = (
            AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)
            if algo.kl_ctrl == "adaptive"
            else FixedKLController(algo.kl_coef)
        )
        self.updater = Updater(
            self.model,
            self.optimizer,
            algo,
            lc,
            self.temperature,
            world,
            rank,
            device,
            self.critic,
            self.critic_optimizer,
        )
        self.pad_id = self.model.config.pad_token_id or 0
        run_dir = Path(spec.run_dir)
        self.replay: ReplayClient | None = None
        self.fleet: SyncFleet | None = None
        if rank == 0:
            self.replay = ReplayClient(spec.replay_address, key_from_env("learner"))
            self.fleet = setup_sync_fleet(cfg, spec, device, self.replay)
            self.trace = SpanWriter(run_dir / "trace" / "learner_0.jsonl")
            self.loggers = setup_loggers(cfg.trainer.logger, run_dir, cfg.model_dump(mode="json"))
            dc = cfg.data
            self.val_rows = load_eval_rows(dc.val_files, dc)
            self.samples = (
                JsonlWriter(run_dir / "samples.jsonl") if cfg.trainer.log_samples else None
            )
            self.weight_log = (
                JsonlWriter(run_dir / "weights_learner.jsonl") if lc.weight_checksum else None
            )
        self._last_step_end = time.perf_counter()

    # ---- stages -------------------------------------------------------------------------
    def fetch_batch(self, version: int) -> tuple[TrainBatch | None, dict[str, Any]]:
        """Rank 0 waits for whole groups trainable at `version` and shares them with all ranks."""
        info: dict[str, Any] = {}
        batch = None
        if self.rank == 0:
            assert self.replay is not None
            msg = self.replay.fetch_batch(
                version, self.cfg.data.train_batch_size, should_stop=lambda: self.stop_requested
            )
            if msg is not None:
                batch = from_message(msg, self.pad_id)
                info = {
                    "traj_ids": msg.traj_ids,
                    "group_ids": msg.group_ids,
                    "stale_dropped": msg.stale_dropped,
                    "traj_metrics": trajectory_metric_means(msg),
                    "fleet": dict(msg.fleet),
                    "response_lengths": [
                        int(x) for x in msg.response_offsets[1:] - msg.response_offsets[:-1]
                    ],
                }
        go = torch.tensor([1 if (self.rank != 0 or batch is not None) else 0], device=self.device)
        if self.world > 1:
            dist.broadcast(go, 0)
        if not int(go.item()):
            return None, info
        if self.world > 1:
            batch = broadcast_batch(batch, self.rank, self.device)
        else:
            batch = batch.to(self.device)
        return batch, info

    def compute_logprobs(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """The no-grad forwards the chosen algorithm needs before the update: proximal policy
        (decoupled PPO, IS, rejection), frozen reference (KL), critic values (gae)."""
        out: dict[str, torch.Tensor] = {}
        layout = self.updater.layout  # every model here is set up alike
        every_row = torch.arange(batch.size, device=self.device)
        args = (self.updater.plan(batch, every_row), self.world, self.device)

        def logp(model, b):
            return policy_forward(model, b, self.temperature, False, layout)[0]

        if self.needs_proximal:
            out["proximal"] = recompute(self.model, batch, logp, *args)
        if self.ref_model is not None:
            out["ref"] = recompute(self.ref_model, batch, logp, *args)
        if self.critic is not None:
            out["values"] = recompute(
                self.critic, batch, lambda m, b: value_forward(m, b, layout), *args
            )
        return out

    def compute_advantages(
        self, batch: TrainBatch, logprobs: dict[str, torch.Tensor]
    ) -> tuple[UpdateInputs, dict[str, float]]:
        """Token rewards (with the in-reward KL penalty), advantages, importance weights and
        rejection masks: everything the update consumes."""
        algo = self.cfg.algorithm
        mask = batch.loss_mask[:, 1:]
        behaviour = batch.old_logprobs[:, 1:]
        proximal = logprobs.get("proximal")
        metrics: dict[str, float] = {}
        token_rewards = None
        if algo.use_kl_in_reward:
            current = proximal if proximal is not None else behaviour
            kl = kl_penalty(current, logprobs["ref"], algo.kl_penalty) * mask
            token_rewards = outcome_token_rewards(batch.rewards, mask) - self.kl_ctrl.value * kl
            seq_kl = float((kl.sum(-1) / mask.sum(-1).clamp(min=1)).mean())
            metrics.update(kl_in_reward=seq_kl, kl_coef=self.kl_ctrl.value)
            self.kl_ctrl.update(seq_kl, batch.size)
        advantages, returns = compute_advantages(
            algo.adv_estimator,
            rewards=batch.rewards,
            mask=mask,
            group_index=batch.group_index,
            values=logprobs.get("values"),
            token_rewards=token_rewards,
            baseline_rewards=batch.baseline_rewards,
            gamma=algo.gamma,
            lam=algo.lam,
            norm_adv_by_std=algo.norm_adv_by_std,
        )
        weights = keep = None
        if proximal is not None:
            metrics["proximal_behaviour_kl"] = float(mismatch_kl(proximal, behaviour, mask))
            if algo.is_level != "off":
                weights = importance_weights(proximal, behaviour, mask, algo.is_level, algo.is_cap)
                raw = importance_weights(proximal, behaviour, mask, algo.is_level, None)
                n = mask.sum().clamp(min=1)
                metrics.update(
                    is_weight_mean=float((raw * mask).sum() / n),
                    is_weight_max=float((raw * mask).max()),
                    is_truncated_frac=float(((raw > weights) * mask).sum() / n),
                )
            if algo.reject_level != "off":
                keep = _keep_mask(
                    rejection_mask(
                        proximal,
                        behaviour,
                        mask,
                        algo.reject_level,
                        algo.reject_metric,
                        algo.reject_low,
                        algo.reject_high,
                    )
                )
                metrics["masked_token_frac"] = float(
                    ((1 - keep) * mask).sum() / mask.sum().clamp(min=1)
                )
        valid = mask > 0
        metrics.update(
            adv_mean=float(advantages[valid].mean()),
            adv_std=float(advantages[valid].std()),
            adv_min=float(advantages[valid].min()),
            adv_max=float(advantages[valid].max()),
        )
        inputs = UpdateInputs(
            advantages,
            behaviour,
            proximal,
            weights,
            keep,
            logprobs.get("ref") if algo.use_kl_loss else None,
            returns,
            logprobs.get("values"),
        )
        return inputs, metrics

    def update(self, batch: TrainBatch, inputs: UpdateInputs, version: int) -> dict[str, float]:
        """PPO epochs over the batch at the scheduled learning rate (`learner.optim`)."""
        lc = self.cfg.learner
        factor = lr_factor(version, lc, self.cfg.trainer.total_steps)
        set_lr(self.optimizer, lc.lr * factor)
        if self.critic_optimizer is not None:
            set_lr(self.critic_optimizer, lc.critic_lr * factor)
        stats = self.updater.run(batch, inputs, lc.ppo_epochs, lc.ppo_mini_batch_size)
        return {**stats, "lr": lc.lr * factor}

    def broadcast_weights(self, version: int) -> str | None:
        """Gather full weights (all ranks) and broadcast them to every member of the weight
        sync (rank 0; it first joins restarted servers and drops failed ones)."""
        hashed: list | None = [] if self.cfg.learner.weight_checksum and self.rank == 0 else None
        lc, probe = self.cfg.learner, None
        if wants_probe(self.cfg):  # all ranks: a forward
            probe = delivery_probe(self.model, lc, self.cfg.rollout.dtype, self.device)
        tensors = sent_tensors(self.model, self.sync_dtype, hashed)
        if self.rank != 0:
            for _ in tensors:  # the gathers are collectives
                pass
            return None
        members = self.fleet.broadcast(self.specs, tensors, version, probe)
        if hashed is None:
            return None
        digest = weights_checksum(hashed)
        # members: server id -> epoch of each server that acknowledged this version
        delivered = {str(server): epoch for server, epoch in sorted(members.items())}
        self.weight_log.write({"version": version, "checksum": digest, "members": delivered})
        return digest

    def validate(self, version: int) -> dict[str, float]:
        """Rank 0 sends the validation set through the rollout servers as an evaluation job
        (leased before any training prompt, never trained on) and waits for every score."""
        if self.rank != 0:
            return {}
        dc, job = self.cfg.data, f"val-{version}-{time.time_ns()}"
        prompts = eval_prompts(self.val_rows, dc.val_n, dc.val_temperature, job)
        summary = run_eval_job(self.replay, prompts, job, self.cfg.trainer.val_timeout_s)
        log.info("validation at version %d: mean score %.4f", version, summary["mean_score"])
        return {f"val/{k}": v for k, v in summary.items()}

    def maybe_validate(self, version: int) -> dict[str, float]:
        tc = self.cfg.trainer
        due = tc.val_every and (version % tc.val_every == 0 or version == tc.total_steps)
        return self.validate(version) if due else {}

    # ---- loop ---------------------------------------------------------------------------
    def save_checkpoint(self, version: int) -> None:
        """Weights and optimizer (sharded), the trainer state and the replay's whole state,
        as one checkpoint run_dir/checkpoints/step_<version> (`learner.checkpoint`)."""
        save_checkpoint(
            Path(self.spec.run_dir),
            version,
            self.rank,
            self.world,
            (self.model, self.optimizer, self.critic, self.critic_optimizer),
            self.replay,
            {"kl_coef": self.kl_ctrl.value},
            self.cfg.trainer.keep_checkpoints,
        )

    def load_checkpoint(self, path: Path) -> int:
        """Restore a `save_checkpoint` directory; returns its version."""
        modules = (self.model, self.optimizer, self.critic, self.critic_optimizer)
        trainer = load_checkpoint(path, modules)
        self.kl_ctrl.value = trainer["kl_coef"]
        return int(trainer["version"])

    def run(self) -> None:
        tc = self.cfg.trainer
        if self.cfg.learner.weight_checksum and tc.resume_from is None:
            # the base model's checksum, version 0 (a resumed run recorded it already); a
            # collective: all ranks
            sent = ((n, as_sent(t, self.sync_dtype)) for n, t in sync_tensors(self.model))
            digest = weights_checksum(sent)
            if self.rank == 0:
                self.weight_log.write({"version": 0, "checksum": digest})
        if tc.val_before_train or tc.val_only:
            val = self.validate(0)
            if self.rank == 0:
                self.loggers.log({"step": 0, "version": 0, "time": time.time(), **val}, 0)
        start = 0
        if tc.resume_from is not None:
            start = self.load_checkpoint(Path(tc.resume_from))
            self.broadcast_weights(start)  # servers loaded the base model: bring them to `start`
            log.info("resumed from %s at version %d", tc.resume_from, start)
        if not tc.val_only:
            for version in range(start, tc.total_steps):
                if not self.train_step(version):
                    log.info("stop requested; leaving the loop at version %d", version)
                    break
                if tc.save_every and (version + 1) % tc.save_every == 0:
                    self.save_checkpoint(version + 1)
            if tc.save_final:
                self.save_final(Path(self.spec.run_dir) / "final")
        if self.rank == 0:
            self.fleet.shutdown()
            self.loggers.close()
            self.trace.flush()

    def train_step(self, version: int) -> bool:
        timer = StageTimer()
        with timer("fetch_batch"):
            batch, info = self.fetch_batch(version)
        if batch is None:
            return False
        with timer("compute_logprobs"):
            logprobs = self.compute_logprobs(batch)
        with timer("compute_advantages"):
            inputs, adv_metrics = self.compute_advantages(batch, logprobs)
        with timer("update"):
            stats = {**adv_metrics, **self.update(batch, inputs, version)}
        with timer("broadcast_weights"):
            checksum = self.broadcast_weights(version + 1)
        if self.rank == 0:
            with timer("publish_version"):
                self.replay.publish_version(version + 1)
        with timer("validate"):
            stats.update(self.maybe_validate(version + 1))
        if self.rank == 0:
            self.log_step(version, batch, info, stats, timer, checksum)
        return True

    def log_step(
        self,
        version: int,
        batch: TrainBatch,
        info: dict[str, Any],
        stats: dict[str, float],
        timer: StageTimer,
        checksum: str | None,
    ) -> None:
        now = time.perf_counter()
        step_time, self._last_step_end = now - self._last_step_end, now
        lengths = info["response_lengths"]
        gen_tokens = float(batch.loss_mask.sum())
        record = {
            "step": version + 1,
            "version": version + 1,
            "time": time.time(),
            "reward_mean": float(batch.rewards.mean()),
            "reward_std": float(batch.rewards.std()),
            "samples": batch.size,
            "response_len_mean": sum(lengths) / max(len(lengths), 1),
            **version_stats(
                batch.versions, batch.loss_mask, version, self.cfg.replay.max_staleness
            ),
            "stale_dropped": info["stale_dropped"],
            **info["traj_metrics"],
            **info["fleet"],
            "response_len_p50": float(np.percentile(lengths, 50)),
            "response_len_max": float(max(lengths)),
            "train_tokens_per_s": float(batch.attention_mask.sum()) / timer.seconds["update"],
            "weight_sync_s": timer.seconds["broadcast_weights"],
            **stats,
            "step_time_s": step_time,
            "samples_per_s": batch.size / step_time,
            "gen_tokens_per_s": gen_tokens / step_time,
            "learner_idle_ratio": timer.seconds["fetch_batch"] / step_time,
            **{f"time_{k}_s": v for k, v in timer.seconds.items()},
            "peak_rss_mb": peak_rss_mb(),
        }
        if checksum is not None:
            record["weights_checksum"] = checksum
        self.loggers.log(record, version + 1)
        for name, start, took in timer.spans:
            self.trace.record(name, "learner", start, took, step=version + 1)
        if self.samples is not None:
            self.samples.write(
                {
                    "step": version + 1,
                    "learner_version": version,
                    "traj_ids": info["traj_ids"],
                    "group_ids": sorted(set(info["group_ids"])),
                    "oldest_versions": [
                        int(v) for v in oldest_versions(batch.versions, batch.loss_mask, version)
                    ],
                }
            )

    def save_final(self, out: Path) -> None:
        """Write the final weights as an ordinary Hugging Face model directory (rank 0); with
        LoRA, the merged model, and the adapter in peft's format under out/adapter."""
        full = {name: t.cpu().clone() for name, t in iter_full_tensors(self.model)}
        if self.rank != 0:
            return
        from transformers import AutoModelForCausalLM, AutoTokenizer

        lora, adapter = self.cfg.learner.lora, None
        if is_adapted(self.model):
            full, adapter = merged_state(full, lora)
        plain = AutoModelForCausalLM.from_pretrained(self.spec.model_path, dtype=torch.float32)
        plain.load_state_dict(full)
        plain.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(self.spec.model_path).save_pretrained(out)
        if adapter is not None:
            save_adapter(out / "adapter", adapter, lora, self.spec.model_path)
        log.info("final weights written to %s", out)


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


def _keep_mask(result) -> torch.Tensor:
    """`rejection_mask` returns the mask, possibly with stats alongside."""
    return result[0] if isinstance(result, tuple) else result


def run_learner(spec: RunSpec, cfg: Config) -> None:
    """Entry point of one learner rank (RANK/WORLD_SIZE/MASTER_* come from the launcher)."""
    torch.set_num_threads(spec.threads)
    torch.manual_seed(cfg.trainer.seed)
    rank, world, device = setup_distributed(cfg.learner.device)
    learner = Learner(cfg, spec, rank, world, device)
    signal.signal(signal.SIGTERM, lambda *_: setattr(learner, "stop_requested", True))
    try:
        learner.run()
    finally:
        if rank == 0:
            write_json_atomic(
                Path(spec.run_dir) / "stats" / "learner.json", {"peak_rss_mb": peak_rss_mb()}
            )
        dist.destroy_process_group()
