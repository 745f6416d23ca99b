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
publish_version (and validate, when due).

Every rank runs every stage, in step. What leaves the learner group (the replay, the weight
sync's servers, validation, loggers, the replay's part of a checkpoint) goes through the rank's
`learner.coordinator.Coordinator`: rank 0's `Leader` does it, the other ranks' `Follower` only
joins the collectives. `setup_learner` wires a rank; `run_learner` is a rank's entry point.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from asyncrl.algorithms.advantages import compute_advantages, outcome_token_rewards
from asyncrl.algorithms.estimators import ESTIMATORS
from asyncrl.algorithms.kl import KLInReward
from asyncrl.algorithms.kl_math import kl_penalty
from asyncrl.config import Config
from asyncrl.dtypes import torch_dtype
from asyncrl.metrics import StageTimer
from asyncrl.placement import maybe_limit_gpu_memory
from asyncrl.run_spec import RunSpec
from asyncrl.weights.probe import DeliveryProbe
from learner.batch import TrainBatch, from_message, share_batch
from learner.checkpoint import load_checkpoint, save_checkpoint, save_final_weights
from learner.coordinator import Coordinator, Follower, StepOutcome, Weights
from learner.corrections import off_policy_corrections
from learner.delivery import delivery_probe, wants_probe
from learner.forward import policy_forward, value_forward
from learner.fsdp import hf_config, setup_distributed, setup_model, sync_specs, sync_tensors
from learner.leader import setup_leader
from learner.optim import lr_factor, set_lr, setup_optimizer
from learner.precision import with_concrete_dtype
from learner.update import UpdateInputs, Updater, recompute

log = logging.getLogger("asyncrl.learner")


class Learner:
    """One learner rank: the SPMD stages of a step, the same on every rank. What a stage sends
    or asks outside the learner group goes through `coordinator` (module docstring)."""

    def __init__(
        self,
        cfg: Config,
        spec: RunSpec,
        rank: int,
        world: int,
        device: torch.device,
        coordinator: Coordinator,
    ):
        self.cfg, self.spec, self.rank, self.world, self.device = cfg, spec, rank, world, device
        self.coordinator = coordinator
        self.stop_requested = False
        lc = cfg.learner
        self.model = setup_model(spec.model_path, device, lc)  # in training mode
        self.optimizer = setup_optimizer(self.model, lc.lr, lc)
        self.sync_dtype = torch_dtype(cfg.rollout.dtype)  # weights go out in the engine's
        self.specs = sync_specs(self.model, self.sync_dtype)  # LoRA: the adapters only
        self.temperature = cfg.rollout.temperature or 1.0
        algo = cfg.algorithm
        self.ref_model = None
        if algo.needs_reference:
            self.ref_model = setup_model(spec.model_path, device, lc, trainable=False)
        self.critic = self.critic_optimizer = None
        if ESTIMATORS[algo.adv_estimator].needs_critic:
            self.critic = setup_model(spec.model_path, device, lc, head="value")
            self.critic_optimizer = setup_optimizer(self.critic, lc.critic_lr, lc)
        self.kl_ctrl = algo.kl_in_reward.controller()
        """The in-reward KL's coefficient (`asyncrl.algorithms.kl_math`); None: no KL in the reward."""
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
        self.pad_id = hf_config(self.model).pad_token_id or 0
        self._last_step_end = time.perf_counter()

    # ---- stages -------------------------------------------------------------------------
    def fetch_batch(self, version: int) -> TrainBatch | None:
        """Whole groups trainable at `version` on every rank: rank 0's coordinator waits for
        them at the replay, and they are broadcast to all; None on every rank once rank 0's
        has none (a stop was requested). While it waits, a restarted rollout server that waits
        to join the weight sync is brought to `version` (`catch_up`): with one server, no batch
        would come before it has weights."""
        while True:
            msg = self.coordinator.fetch_batch(version, should_stop=lambda: self.stop_requested)
            if not self._rank0_says(msg is None and self.coordinator.joins_waiting()):
                break
            self.coordinator.catch_up(self._weights_to_send(version))
        batch = from_message(msg, self.pad_id) if msg is not None else None
        return share_batch(batch, self.rank, self.world, self.device)

    def compute_logprobs(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """The no-grad forwards the chosen algorithm needs before the update: proximal policy
        (decoupled PPO, IS, rejection), frozen reference (KL), critic values (gae); in
        micro-batches of their own budget (`learner.max_tokens_per_forward`)."""
        out: dict[str, torch.Tensor] = {}
        layout = self.updater.layout  # every model here is set up alike
        every_row = torch.arange(batch.size, device=self.device)
        args = (self.updater.recompute_plan(batch, every_row), self.world, self.device)

        def logp(model, b):
            return policy_forward(model, b, self.temperature, False, layout)[0]

        if self.cfg.algorithm.needs_proximal:
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
        if self.kl_ctrl is not None:
            current = proximal if proximal is not None else behaviour
            kl = kl_penalty(current, logprobs["ref"], self.kl_ctrl.estimator) * mask
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
            weights, keep = off_policy_corrections(algo, proximal, behaviour, mask, metrics)
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
            logprobs.get("ref") if algo.kl_loss.needs_reference else None,
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
        """Gather full weights (all ranks) and deliver them to every member of the weight sync
        (rank 0's coordinator); returns their checksum when learner.weight_checksum asks."""
        return self.coordinator.deliver_weights(self._weights_to_send(version))

    def _weights_to_send(self, version: int) -> Weights:
        """The weights of `version` with their delivery probe, when asked for (all ranks: a
        forward, then the gathers as the coordinator drains them)."""
        lc, probe = self.cfg.learner, None
        if wants_probe(self.cfg):
            probe = delivery_probe(self.model, lc, self.cfg.rollout.dtype, self.device)
        return self.weights(version, probe)

    def _rank0_says(self, flag: bool) -> bool:
        """Rank 0's `flag` on every rank (a broadcast when there are other ranks)."""
        if self.world == 1:
            return flag
        shared = torch.tensor([int(flag)], device=self.device)
        dist.broadcast(shared, 0)
        return bool(shared.item())

    def weights(self, version: int, probe: DeliveryProbe | None = None) -> Weights:
        """The weights a version carries (a collective to drain: every rank, in step)."""
        return Weights(version, self.specs, sync_tensors(self.model), probe)

    def maybe_validate(self, version: int) -> dict[str, float]:
        """Validation scores (`validate`) every trainer.val_every versions and at the last;
        {} otherwise."""
        tc = self.cfg.trainer
        due = tc.val_every and (version % tc.val_every == 0 or version == tc.total_steps)
        return self.validate(version) if due else {}

    def validate(self, version: int) -> dict[str, float]:
        """Validation scores (rank 0's coordinator runs the job; {} on the other ranks). A
        restarted server that waits to join meanwhile is brought to `version` (`catch_up`),
        as in `fetch_batch`: with one server the job's prompts wait for it."""
        while True:
            scores = self.coordinator.validate(version)
            if not self._rank0_says(self.coordinator.joins_waiting()):
                return scores
            self.coordinator.catch_up(self._weights_to_send(version))

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
            self.coordinator,
            {
                "kl_coef": None if self.kl_ctrl is None else self.kl_ctrl.value,
                "kl_in_reward": self.cfg.algorithm.kl_in_reward.type,
            },
            self.cfg.trainer.keep_checkpoints,
            self.cfg.trainer.resume_from,
        )

    def load_checkpoint(self, path: Path) -> int:
        """Restore a `save_checkpoint` directory; returns its version."""
        modules = (self.model, self.optimizer, self.critic, self.critic_optimizer)
        trainer = load_checkpoint(path, modules)
        coef = restored_kl_coef(self.cfg.algorithm.kl_in_reward, trainer)
        if self.kl_ctrl is not None and coef is not None:
            self.kl_ctrl.value = coef
        return int(trainer["version"])

    def run(self) -> None:
        """Validate first if asked, resume if asked, then train to trainer.total_steps (or a
        stop request), saving checkpoints and, unless stopped early, the final weights."""
        tc = self.cfg.trainer
        if self.cfg.learner.weight_checksum and tc.resume_from is None:
            # the base model's checksum, version 0 (a resumed run recorded it already)
            self.coordinator.record_weights(self.weights(0))
        if tc.val_before_train or tc.val_only:
            self.coordinator.log(0, self.validate(0))
        start = 0
        if tc.resume_from is not None:
            start = self.load_checkpoint(Path(tc.resume_from))
            self.broadcast_weights(start)  # servers loaded the base model: bring them to `start`
            log.info("resumed from %s at version %d", tc.resume_from, start)
        if not tc.val_only:
            stopped = self.train(start)
            if tc.save_final and not stopped:  # an interrupted run is not finished
                out = Path(self.spec.run_dir) / "final"
                lora = self.cfg.learner.lora
                step = max(start, tc.total_steps)  # the version train() ended at
                save_final_weights(out, self.model, lora, self.spec.model_path, self.rank, step)
        self.coordinator.shutdown()

    def train(self, start: int) -> bool:
        """Steps from version `start` to trainer.total_steps, a checkpoint every
        trainer.save_every; True when a stop request (SIGTERM: the launcher was interrupted)
        ended them early. Then, with trainer.checkpoint_on_interrupt, the ranks write the
        checkpoint of the version reached, unless it is that of their newest checkpoint (or
        the start). All ranks agree on that version: only rank 0 heeds the request, and its
        empty batch leaves every rank's loop at the same step (`share_batch`), so they enter
        the checkpoint's collectives together."""
        tc, saved = self.cfg.trainer, start
        for version in range(start, tc.total_steps):
            if not self.train_step(version):
                log.info("stop requested; leaving the loop at version %d", version)
                if tc.checkpoint_on_interrupt and version > saved:
                    self.save_checkpoint(version)
                return True
            if tc.save_every and (version + 1) % tc.save_every == 0:
                self.save_checkpoint(version + 1)
                saved = version + 1
        return False

    def train_step(self, version: int) -> bool:
        """One step at `version`, its stages timed; False when there was no batch (a stop)."""
        timer = StageTimer()
        with timer("fetch_batch"):
            batch = self.fetch_batch(version)
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
        with timer("publish_version"):
            self.coordinator.publish_version(version + 1)
        with timer("validate"):
            stats.update(self.maybe_validate(version + 1))
        now = time.perf_counter()
        step_time, self._last_step_end = now - self._last_step_end, now
        outcome = StepOutcome(version, batch, timer, step_time, checksum)
        self.coordinator.log(version + 1, stats, outcome)
        return True


def setup_learner(
    cfg: Config, spec: RunSpec, rank: int, world: int, device: torch.device
) -> Learner:
    """One learner rank, wired: rank 0's coordinator is the `Leader` (the replay's client, the
    weight sync, loggers: `learner.leader.setup_leader`), every other rank's a `Follower`."""
    coordinator = setup_leader(cfg, spec, device) if rank == 0 else Follower()
    return Learner(cfg, spec, rank, world, device, coordinator)


def run_learner(spec: RunSpec, cfg: Config) -> None:
    """Entry point of one learner rank (RANK/WORLD_SIZE/MASTER_* come from the launcher)."""
    torch.set_num_threads(spec.threads)
    torch.manual_seed(cfg.trainer.seed)
    rank, world, device = setup_distributed(cfg.learner.device)
    cfg = with_concrete_dtype(cfg, device)  # learner.dtype=auto -> float32 or bfloat16
    maybe_limit_gpu_memory(spec.own_place(f"learner_{rank}"), device)  # its share, in its log
    learner = setup_learner(cfg, spec, rank, world, device)
    # the launcher's interrupt (or any SIGTERM): end the step, checkpoint it (`Learner.train`)
    signal.signal(signal.SIGTERM, lambda *_: setattr(learner, "stop_requested", True))
    try:
        learner.run()
    finally:
        learner.coordinator.close()
        dist.destroy_process_group()


def restored_kl_coef(variant: KLInReward, trainer: dict) -> float | None:
    """The in-reward KL coefficient a resumed run takes from its checkpoint's trainer state, or
    None: the configured `coef`. Only a variant whose coefficient is state
    (`KLInReward.stateful`: `adaptive`) restores it, and only from a checkpoint that the same
    type wrote (`kl_in_reward` beside `kl_coef`): a `fixed` coefficient is the config's, so
    `--resume RUN algorithm.kl_in_reward.coef=X` takes X. A checkpoint older than that marker
    restores its coefficient into an `adaptive` run, logged."""
    saved = trainer.get("kl_coef")
    if not variant.stateful or saved is None:
        return None
    written_by = trainer.get("kl_in_reward")
    if written_by is None:
        log.warning(
            "the checkpoint does not say which algorithm.kl_in_reward wrote its kl_coef (an "
            "older one): the %s coefficient resumes at its %s",
            variant.type,
            saved,
        )
        return float(saved)
    if written_by != variant.type:
        log.info(
            "the checkpoint's kl_coef is a %s run's: algorithm.kl_in_reward.coef applies",
            written_by,
        )
        return None
    return float(saved)
