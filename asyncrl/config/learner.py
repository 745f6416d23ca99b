"""The learner's config sections: how it trains (`learner`) and what it optimises (`algorithm`).

Part of the tree `asyncrl.config` assembles (and re-exports); kept apart so each file reads
as one thing.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from asyncrl.algorithms.corrections import (
    OFF_POLICY_CORRECTIONS,
    REJECTIONS,
    DecoupledCorrection,
    NoCorrection,
    NoRejection,
    SequenceRejection,
    TokenRejection,
    TruncatedIS,
)
from asyncrl.algorithms.estimators import ESTIMATORS
from asyncrl.algorithms.kl import (
    KL_IN_REWARD,
    KL_LOSSES,
    AdaptiveKLInReward,
    FixedKLInReward,
    NoKLInReward,
    NoKLLoss,
    ReferenceKLLoss,
)
from asyncrl.algorithms.policy_losses import POLICY_LOSSES, GSPOLoss, PPOLoss
from asyncrl.algorithms.variants import VariantOf
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


class AlgorithmConfig(Section):
    """What the learner optimises: the advantage estimator and the variants of the policy loss,
    the off-policy correction, the rejection mask and the KL terms. Each variant is a mapping
    with its `type` and only its own fields, or just its name (`algorithm.policy_loss=gspo`);
    a field another variant has is refused naming the key (`asyncrl.algorithms.variants`)."""

    adv_estimator: str = "grpo"
    """Advantage estimator, a name in `asyncrl.algorithms.estimators.ESTIMATORS` (verl's names:
    gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax). `gae` trains a
    critic; `remax` samples a greedy baseline."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's std (false gives Dr.GRPO)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount for gae and reinforce_plus_plus."""
    lam: float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda."""
    policy_loss: Annotated[
        PPOLoss | GSPOLoss, VariantOf(POLICY_LOSSES, "algorithm.policy_loss", "ppo")
    ] = PPOLoss()
    """The policy loss, a variant in `asyncrl.algorithms.policy_losses.POLICY_LOSSES`: `ppo`
    (token-level clipped ratio: clip_ratio_low, clip_ratio_high, clip_ratio_c), `gspo`
    (sequence-level, length-normalised ratio: clip_ratio_low, clip_ratio_high), or a loss
    declared with `@policy_loss`."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How token losses become one number (normalised over the whole batch, all ranks)."""
    correction: Annotated[
        NoCorrection | DecoupledCorrection | TruncatedIS,
        VariantOf(OFF_POLICY_CORRECTIONS, "algorithm.correction", "none"),
    ] = NoCorrection()
    """The off-policy correction, a variant in
    `asyncrl.algorithms.corrections.OFF_POLICY_CORRECTIONS`: `none` (PPO clipped against the
    behaviour policy, verl's bypass mode), `decoupled` (AReaL's decoupled PPO: clip around a
    proximal policy recomputed before the update, untruncated behaviour -> proximal token
    weights) or `truncated_is` (decoupled with truncated weights: level, cap,
    batch_normalize). `none` by default: in the staleness study (docs/off_policy.md, tiny
    task, two seeds) no correction ended above it, at any staleness."""
    rejection: Annotated[
        NoRejection | TokenRejection | SequenceRejection,
        VariantOf(REJECTIONS, "algorithm.rejection", "none"),
    ] = NoRejection()
    """Rejection mask on behaviour-vs-proximal divergence, a variant in
    `asyncrl.algorithms.corrections.REJECTIONS`: `none`, `token` (metric, low, high) or
    `sequence` (metric, agg, low, high)."""
    kl_in_reward: Annotated[
        NoKLInReward | FixedKLInReward | AdaptiveKLInReward,
        VariantOf(KL_IN_REWARD, "algorithm.kl_in_reward", "none"),
    ] = NoKLInReward()
    """KL(policy || reference) subtracted from the per-token reward, a variant in
    `asyncrl.algorithms.kl.KL_IN_REWARD`: `none`, `fixed` (coef, estimator) or `adaptive`
    (coef, estimator, target, horizon: Ziegler et al. 2019)."""
    kl_loss: Annotated[
        NoKLLoss | ReferenceKLLoss, VariantOf(KL_LOSSES, "algorithm.kl_loss", "none")
    ] = NoKLLoss()
    """KL(policy || reference) added to the loss, a variant in
    `asyncrl.algorithms.kl.KL_LOSSES`: `none` or `reference` (coef, estimator; GRPO style)."""
    entropy_coeff: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    value_clip: float = Field(0.5, gt=0)
    """gae: clip range of the value loss around the old values."""

    @property
    def needs_proximal(self) -> bool:
        """The learner recomputes the proximal policy's log-probs before the update."""
        return self.correction.needs_proximal or self.rejection.needs_proximal

    @property
    def needs_reference(self) -> bool:
        """The learner keeps a frozen reference policy."""
        return self.kl_in_reward.needs_reference or self.kl_loss.needs_reference


def check_algorithm(
    algo: AlgorithmConfig, group_size: int, mini_batch_size: int, train_batch_size: int
) -> None:
    """The algorithm's fit with the rest of the run: `rollout.n` (`group_size`),
    `learner.ppo_mini_batch_size` and `data.train_batch_size`; ValueError naming the key."""
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
