"""The learner's config sections: how it trains (`learner`) and what it optimises (`algorithm`).

Part of the tree `asyncrl.config` assembles (and re-exports); kept apart so each file reads
as one thing.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import Field

from asyncrl.algorithms.policy_losses import POLICY_LOSSES
from asyncrl.config.base import Section


class LoraConfig(Section):
    """LoRA RL (`peft`): the policy trains low-rank adapters on `target_modules` only, and each
    version's weight sync carries only the adapters; the engine merges them into its copy of
    the base weights (W = W0 + alpha / rank x B A). rank 0: full fine-tuning."""

    rank: int = Field(0, ge=0, le=4096)
    """Rank of the adapters (r); 0: no adapters, full fine-tuning."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: the adapters' update is multiplied by alpha / rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input during training."""
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]  # fmt: skip
    )
    """Names (last component) of the linear layers that get adapters."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LearnerConfig(Section):
    world_size: int = Field(1, ge=1, le=1024)
    """Learner ranks (N), sharded with FSDP2."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the learner; `auto` picks CUDA when present (NCCL), else CPU (gloo)."""
    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward on one rank (gradient accumulation above it); used when
    max_tokens_per_micro_batch is 0."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Token budget of one forward/backward (verl's use_dynamic_bsz): a rank's rows are packed
    into micro-batches of at most this many tokens (a longer row gets one of its own); 0: count
    rows (micro_batch_size). Rows are shared across ranks balanced by tokens either way."""
    max_tokens_per_forward: int = Field(0, ge=0)
    """Token budget of one no-grad recompute forward (proximal and reference log-probs, the
    critic's values before the update), which keeps no activations for a backward and so can
    take more tokens at once. 0: twice the update's budget, in the update's unit (2 x
    max_tokens_per_micro_batch tokens, or 2 x micro_batch_size rows when that is 0)."""
    packing: bool = True
    """Run the policy, reference and critic on packed sequences (no pad token is computed), with
    exact per-segment attention: per-segment SDPA on CPU; on CUDA compiled FlexAttention, or
    flash-attn varlen when installed, bf16 and share_prompts=false
    (`learner.packing.choose_packed_attention`). false: right-padded rows (every row as long as
    the longest)."""
    share_prompts: bool = True
    """With packing, the samples of a group that have the same prompt share one copy of it in
    the forward (each response attends to it as to its own prompt: exact). Runs on CPU and with
    FlexAttention on CUDA; false lets CUDA use flash-attn's varlen kernel (when installed, bf16),
    which packs every row whole."""
    packed_attention: Literal["auto", "asyncrl_packed", "asyncrl_flex", "flash_attention_2"] = (
        "auto"
    )
    """The attention kernel on packed rows: auto follows `learner.packing.choose_packed_attention`'s
    rule (per-segment SDPA `asyncrl_packed` on CPU; compiled FlexAttention `asyncrl_flex` or
    flash-attn varlen `flash_attention_2` on CUDA); a name forces that kernel (tests,
    benchmarks; the log then says `forced`), and flash_attention_2 is refused where it cannot
    run (not CUDA, not bf16, not installed)."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Compute dtype (FSDP2 MixedPrecisionPolicy): bfloat16 computes forward and backward in
    bf16 while master weights, gradients' reduction, optimizer state and log-softmax stay fp32.
    auto: bfloat16 on CUDA and on a CPU with bf16 arithmetic (AVX512_BF16, AMX, Arm BF16), else
    float32, since emulated bf16 is many times slower than fp32 (`learner.precision`)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them
    (less memory, about a third more compute)."""
    offload: bool = False
    """Keep parameters, gradients and optimizer state in CPU memory between uses (FSDP2
    CPUOffloadPolicy; the optimizer steps on CPU). Saves GPU memory on CUDA learners; on a CPU
    learner they are in CPU memory already, so it only adds the policy's copies."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: constant, or cosine decay to min_lr_ratio x lr at trainer.total_steps."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup from lr / (warmup_steps + 1) to lr over this many optimizer steps."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Cosine schedule: the final learning rate as a fraction of lr."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    ppo_mini_batch_size: int = Field(0, ge=0)
    """Groups per optimizer step within a batch; 0: the whole batch is one mini-batch."""
    critic_lr: float = Field(1e-3, gt=0)
    """gae: AdamW learning rate of the critic (its value head starts from scratch)."""
    bucket_mb: float = Field(64.0, gt=0)
    """Weight broadcast bucket size."""
    delivery_check: bool = True
    """With every version, send the learner's log-probs of a fixed probe; the engine checks its
    own after applying and fails loudly when they differ (both engines check it)."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """Adapters instead of full fine-tuning (rank > 0); see `LoraConfig`."""
    weight_checksum: bool = False
    """Checksum the weights at every sync on both sides (for tests; costs a pass over the bytes)."""


KLKind = Literal[
    "kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+"
]
REJECT_AGGREGATIONS = ("mean", "sum", "max")


def rejection_problem(level: str, metric: str, agg: str) -> str | None:
    """Why a rejection at `level` on `metric` aggregated by `agg` means nothing (None: it is
    fine). The aggregation acts on k1/k2/k3 over a sequence's sampled tokens (verl's rollout_rs
    `seq_mean_k*`, `seq_sum_k*`, `seq_max_k2|3`); the sequence ratio is the product of its token
    ratios already; the max of k1 (= -log r, of either sign) bounds no divergence and verl has
    no `seq_max_k1`."""
    if agg not in REJECT_AGGREGATIONS:
        return f"unknown aggregation {agg!r}; valid: {', '.join(REJECT_AGGREGATIONS)}"
    if agg == "mean":
        return None
    if level != "sequence":
        return f"{agg} aggregates a sequence's tokens: it needs reject_level=sequence"
    if metric == "ratio":
        return "the sequence ratio is already the product of its token ratios (use k1 with sum)"
    if metric == "k1" and agg == "max":
        return "the max of k1 bounds no divergence (verl has no seq_max_k1): use k2 or k3"
    return None


class AlgorithmConfig(Section):
    adv_estimator: str = "grpo"
    """Advantage estimator, a name in `asyncrl.algorithms.estimators.ESTIMATORS` (verl's names: gae, grpo,
    rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax). `gae` trains a critic;
    `remax` samples a greedy baseline."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's std (false gives Dr.GRPO)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount for gae and reinforce_plus_plus."""
    lam: float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda."""
    policy_loss: str = "ppo"
    """A name in `asyncrl.algorithms.policy_losses.POLICY_LOSSES`: `ppo` (token-level clipped ratio),
    `gspo` (sequence-level, length-normalised ratio), or a loss declared with `@policy_loss`."""
    clip_ratio_low: float = Field(0.2, ge=0, le=1)
    """Clip: ratio lower bound is 1 - this."""
    clip_ratio_high: float = Field(0.2, ge=0)
    """Clip: ratio upper bound is 1 + this (raise it for clip-higher / DAPO)."""
    clip_ratio_c: float | None = Field(3.0, gt=1.0)
    """Dual-clip bound for negative advantages (None disables it)."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How token losses become one number (normalised over the whole batch, all ranks)."""
    decoupled: bool = False
    """Decoupled PPO: clip around a proximal policy recomputed by the learner before the update,
    and weight tokens by behaviour -> proximal importance weights. Off by default: in the
    staleness study (docs/off_policy.md, tiny task, two seeds) no correction ended above plain
    PPO clipped against the behaviour policy, at any staleness."""
    is_level: Literal["off", "token", "sequence"] = "off"
    """Truncated importance sampling behaviour -> proximal (needs decoupled=true; off with
    decoupled: untruncated token-level weights, as AReaL)."""
    is_cap: float | None = Field(2.0, gt=0)
    """Cap of the truncated importance weight (None: no truncation)."""
    is_batch_normalize: bool = False
    """Divide the (truncated) importance weights by their mean over the whole batch, per token
    or per sequence as is_level says, so they average 1 (verl's rollout_is_batch_normalize;
    needs is_level)."""
    reject_level: Literal["off", "token", "sequence"] = "off"
    """Rejection mask on behaviour-vs-proximal divergence: drop tokens or whole sequences."""
    reject_metric: Literal["ratio", "k1", "k2", "k3"] = "ratio"
    """Quantity the rejection bounds apply to."""
    reject_agg: Literal["mean", "sum", "max"] = "mean"
    """reject_level=sequence with k1/k2/k3: the mean, sum or max of the metric over the
    sequence's sampled tokens (verl's rollout_rs seq_mean_k*, seq_sum_k*, seq_max_k2|3)."""
    reject_low: float | None = None
    """Reject when the metric is below this."""
    reject_high: float | None = None
    """Reject when the metric is above this."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef x KL(policy || reference) from the per-token reward."""
    kl_penalty: KLKind = "kl"
    """Estimator of the in-reward KL."""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient, or the adaptive controller of Ziegler et al. (2019)."""
    kl_coef: float = Field(0.001, ge=0)
    """(Initial) coefficient of the in-reward KL."""
    kl_target: float = Field(0.1, gt=0)
    """Adaptive controller: target KL."""
    kl_horizon: int = Field(10000, ge=1)
    """Adaptive controller: horizon."""
    use_kl_loss: bool = False
    """Add kl_loss_coef x KL(policy || reference) to the loss (GRPO style)."""
    kl_loss_coef: float = Field(0.001, ge=0)
    """Coefficient of the KL loss."""
    kl_loss_type: KLKind = "low_var_kl"
    """Estimator of the KL loss."""
    entropy_coeff: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    value_clip: float = Field(0.5, gt=0)
    """gae: clip range of the value loss around the old values."""

    @pydantic.field_validator("policy_loss")
    @classmethod
    def _registered_policy_loss(cls, value: str) -> str:
        """Refused at start-up, before any process starts, naming the losses there are."""
        if value not in POLICY_LOSSES:
            raise ValueError(
                f"algorithm.policy_loss={value!r} is not a registered policy loss: "
                f"{POLICY_LOSSES.names()}"
            )
        return value

    @pydantic.model_validator(mode="after")
    def _meaningful_correction(self) -> AlgorithmConfig:
        """Refuse what would silently do nothing or mean nothing, naming the keys."""
        if self.is_batch_normalize and self.is_level == "off":
            raise ValueError(
                "algorithm.is_batch_normalize=true needs algorithm.is_level=token|sequence: "
                "there are no truncated importance weights to normalise"
            )
        if self.reject_agg != "mean":
            why = rejection_problem(self.reject_level, self.reject_metric, self.reject_agg)
            if why is not None:
                raise ValueError(
                    f"algorithm.reject_agg={self.reject_agg} with algorithm.reject_level="
                    f"{self.reject_level} and algorithm.reject_metric={self.reject_metric}: {why}"
                )
        return self

    @pydantic.field_validator("is_level", "reject_level", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML reads a bare `off` (in a file or as `algorithm.is_level=off`) as false."""
        return "off" if value is False else value


def check_algorithm(
    algo: AlgorithmConfig, group_size: int, mini_batch_size: int, train_batch_size: int
) -> None:
    """The algorithm's fit with the rest of the run: `rollout.n` (`group_size`),
    `learner.ppo_mini_batch_size` and `data.train_batch_size`; ValueError naming the key."""
    if algo.is_level != "off" and not algo.decoupled:
        raise ValueError(
            f"algorithm.is_level={algo.is_level!r} needs algorithm.decoupled=true: without it "
            "the PPO ratio is already taken against the behaviour policy (verl's bypass "
            "mode), and importance weights on top would correct the same lag twice"
        )
    from asyncrl.algorithms.estimators import ESTIMATORS

    if (est := ESTIMATORS.get(algo.adv_estimator)) is None:
        raise ValueError(
            f"algorithm.adv_estimator={algo.adv_estimator!r} is not a registered "
            f"estimator: {ESTIMATORS.names()}"
        )
    if group_size < est.min_group_size:
        raise ValueError(
            f"rollout.n must be >= {est.min_group_size} for {est.name} (a group needs a baseline)"
        )
    if mini_batch_size > train_batch_size:
        raise ValueError(
            f"learner.ppo_mini_batch_size={mini_batch_size} exceeds "
            f"data.train_batch_size={train_batch_size}"
        )
