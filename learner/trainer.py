"""The learner main loop: fetch a batch, compute advantages, update, broadcast, publish.

Invariants:
- The learner trains at version w = number of optimizer steps taken; it asks the replay for
  groups trainable at w, so no token older than `replay.max_staleness` versions reaches the loss.
- After step w the weights of version w + 1 are on every rollout server (the broadcast is a
  collective: it returns when all have them) before the replay hears of version w + 1.
- Every rank runs the same number of forward/backward passes (FSDP collectives pair up).
"""

from __future__ import annotations

import logging
import math
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.config import Config
from asyncrl.metrics import JsonlWriter, StageTimer, peak_rss_mb, write_json_atomic
from asyncrl.replay_client import ReplayClient
from asyncrl.run_spec import RunSpec
from asyncrl.weight_sync import SyncGroup, WeightBroadcaster, weights_checksum
from learner.algorithms import grpo_advantages, ppo_clip_loss
from learner.batch import TrainBatch, broadcast_batch, from_message, pad_rows
from learner.fsdp import iter_full_tensors, param_specs, setup_distributed, setup_model

log = logging.getLogger("asyncrl.learner")


def token_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """log p(token_t | tokens_<t) of softmax(logits / T), [B, L-1] aligned to input_ids[:, 1:].
    The same quantity the engines report as behaviour log-probs."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[:, :-1].float() / temperature
    targets = batch.input_ids[:, 1:].unsqueeze(-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)


class Learner:
    """One learner rank. Rank 0 also talks to the replay and broadcasts weights."""

    def __init__(self, cfg: Config, spec: RunSpec, rank: int, world: int, device: torch.device):
        self.cfg, self.spec, self.rank, self.world, self.device = cfg, spec, rank, world, device
        self.stop_requested = False
        self.model = setup_model(spec.model_path, device)
        self.model.train()
        lc = cfg.learner
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay
        )
        self.specs = param_specs(self.model)
        self.temperature = cfg.rollout.temperature or 1.0
        self.pad_id = self.model.config.pad_token_id or 0
        run_dir = Path(spec.run_dir)
        self.replay: ReplayClient | None = None
        self.broadcaster: WeightBroadcaster | None = None
        if rank == 0:
            self.replay = ReplayClient(spec.replay_address)
            group = SyncGroup(
                spec.sync_host, spec.sync_port, 0, 1 + cfg.rollout.num_servers, device
            )
            self.broadcaster = WeightBroadcaster(group, int(lc.bucket_mb * 2**20))
            self.metrics = JsonlWriter(run_dir / "metrics.jsonl")
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
                    "stale_dropped": msg.stale_dropped,
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
        return batch, info

    def update(self, batch: TrainBatch, advantages: torch.Tensor) -> dict[str, float]:
        """One optimizer step on this rank's slice, with the PPO clipped loss over the behaviour
        log-probs as the old policy, normalised by the global number of sampled tokens."""
        mbs = self.cfg.learner.micro_batch_size
        full = pad_rows(batch, self.world)
        adv_full = torch.cat([advantages, advantages.new_zeros(full.size - batch.size)])
        per_rank = full.size // self.world
        lo = self.rank * per_rank
        mine, my_adv = full.rows(lo, lo + per_rank), adv_full[lo : lo + per_rank]
        num_micro = math.ceil(per_rank / mbs)
        total_tokens = batch.loss_mask[:, 1:].sum().clamp(min=1.0)
        scale = self.world / total_tokens
        a = self.cfg.algorithm
        sums = torch.zeros(4, device=self.device)  # loss, clipped, ratio_sum, |logp - old| sum
        ratio_max = torch.zeros((), device=self.device)
        for i in range(num_micro):
            mb = mine.rows(i * mbs, (i + 1) * mbs)
            self.model.set_requires_gradient_sync(i == num_micro - 1)
            logp = token_logprobs(self.model, mb, self.temperature)
            mask = mb.loss_mask[:, 1:]
            adv = my_adv[i * mbs : (i + 1) * mbs, None].expand_as(logp)
            loss_sum, st = ppo_clip_loss(
                logp, mb.old_logprobs[:, 1:], adv, mask, a.clip_ratio_low, a.clip_ratio_high
            )
            (loss_sum * scale).backward()
            with torch.no_grad():
                diff = ((logp - mb.old_logprobs[:, 1:]).abs() * mask).sum()
                sums += torch.stack(
                    [loss_sum.detach(), st["clipped_tokens"], st["ratio_sum"], diff]
                )
                ratio_max = torch.maximum(ratio_max, st["ratio_max"])
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.cfg.learner.grad_clip
        )
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.world > 1:
            dist.all_reduce(sums)
            dist.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
        n = float(total_tokens)
        return {
            "loss": float(sums[0]) / n,
            "clip_frac": float(sums[1]) / n,
            "ratio_mean": float(sums[2]) / n,
            "ratio_max": float(ratio_max),
            "logprob_abs_diff": float(sums[3]) / n,
            "grad_norm": float(grad_norm),
        }

    def broadcast_weights(self, version: int) -> str | None:
        """Gather full weights (all ranks) and broadcast them to every server (rank 0)."""
        want_sum = self.cfg.learner.weight_checksum and self.rank == 0
        hashed: list[tuple[str, torch.Tensor]] = []

        def tensors():
            for name, t in iter_full_tensors(self.model):
                if want_sum:
                    hashed.append((name, t.cpu().clone()))
                yield t

        if self.rank == 0:
            assert self.broadcaster is not None
            self.broadcaster.broadcast(self.specs, tensors(), version)
        else:
            for _ in tensors():
                pass
        if not want_sum:
            return None
        digest = weights_checksum(hashed)
        self.weight_log.write({"version": version, "checksum": digest})
        return digest

    # ---- loop ---------------------------------------------------------------------------
    def run(self) -> None:
        if self.cfg.learner.weight_checksum and self.rank == 0:
            self.weight_log.write(
                {"version": 0, "checksum": weights_checksum(iter_full_tensors(self.model))}
            )
        elif self.cfg.learner.weight_checksum:
            for _ in iter_full_tensors(self.model):
                pass
        for version in range(self.cfg.trainer.total_steps):
            if not self.train_step(version):
                log.info("stop requested; leaving the loop at version %d", version)
                break
        if self.cfg.trainer.save_final:
            self.save_final(Path(self.spec.run_dir) / "final")
        if self.rank == 0:
            self.broadcaster.shutdown()

    def train_step(self, version: int) -> bool:
        timer = StageTimer()
        with timer("fetch_batch"):
            batch, info = self.fetch_batch(version)
        if batch is None:
            return False
        with timer("compute_advantages"):
            adv = grpo_advantages(
                batch.rewards, batch.group_index, self.cfg.algorithm.norm_adv_by_std
            )
        with timer("update"):
            stats = self.update(batch, adv)
        with timer("broadcast_weights"):
            checksum = self.broadcast_weights(version + 1)
        if self.rank == 0:
            with timer("publish_version"):
                self.replay.publish_version(version + 1)
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
        sampled = batch.versions.masked_fill(batch.loss_mask == 0, 2**31)
        oldest = sampled.min(dim=1).values.clamp(max=version)
        staleness = (version - oldest).float()
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
            "staleness_mean": float(staleness.mean()),
            "staleness_max": float(staleness.max()),
            "stale_dropped": info["stale_dropped"],
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
        self.metrics.write(record)
        if self.samples is not None:
            self.samples.write(
                {
                    "step": version + 1,
                    "learner_version": version,
                    "traj_ids": info["traj_ids"],
                    "oldest_versions": [int(v) for v in oldest],
                }
            )

    def save_final(self, out: Path) -> None:
        """Write the final weights as an ordinary Hugging Face model directory (rank 0)."""
        full = {name: t.cpu().clone() for name, t in iter_full_tensors(self.model)}
        if self.rank != 0:
            return
        from transformers import AutoModelForCausalLM, AutoTokenizer

        plain = AutoModelForCausalLM.from_pretrained(self.spec.model_path, dtype=torch.float32)
        plain.load_state_dict(full)
        plain.save_pretrained(out, safe_serialization=True)
        AutoTokenizer.from_pretrained(self.spec.model_path).save_pretrained(out)
        log.info("final weights written to %s", out)


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
