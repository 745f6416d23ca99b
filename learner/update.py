"""Forward passes and the optimizer update of one learner step.

Every tensor here is [B, T] aligned to *target* tokens: position t holds what concerns
input_ids[:, t + 1] (its log-prob under the policy, its loss mask, its advantage, the value of
the state before it). That is the layout of `logits[:, :-1]`.

Invariants:
- Loss normalisation is global: each mini-batch's denominator (tokens or sequences, per
  `loss_agg_mode`) is computed over the whole mini-batch on every rank, so micro-batching and
  the number of ranks do not change the loss (FSDP averages gradients, hence the x world).
- Every rank runs the same number of forward/backward passes per mini-batch (filler rows
  carry zero weight; `learner.micro_batches`), so FSDP's collectives pair up.
- Packing (`learner.packing`) changes which tokens the model computes, never which tokens a
  loss sees: outputs come back in the [B, T] layout below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.algorithms.correction_math import behaviour_weighted
from asyncrl.algorithms.policy_losses import PolicyLossInputs
from asyncrl.config import AlgorithmConfig, LearnerConfig
from learner.batch import TrainBatch
from learner.forward import layout_of, policy_forward, value_forward
from learner.fsdp import set_gradient_sync
from learner.losses import aggregate_denominator, aggregate_loss, value_token_loss
from learner.micro_batches import MicroBatch, plan_micro_batches
from learner.update_metrics import (
    CRITIC_METRICS,
    UPDATE_METRICS,
    CriticStep,
    MetricSums,
    MicroStep,
    combine_mini_batches,
)


@torch.no_grad()
def recompute(
    model: torch.nn.Module,
    batch: TrainBatch,
    fn,
    plan: list[MicroBatch],
    world: int,
    device: torch.device,
) -> torch.Tensor:
    """Run `fn(model, micro_batch) -> [b, T]` over this rank's `plan` (of the whole batch) and
    all-reduce, so every rank ends with the full [B, T] result."""
    out = torch.zeros(batch.size, batch.input_ids.shape[1] - 1, device=device)
    for micro in plan:
        vals = fn(model, batch.select(micro.rows))
        counted = micro.weights > 0
        out[micro.rows[counted]] = vals[counted]
    if world > 1:
        dist.all_reduce(out)  # each row was computed by exactly one rank
    return out


def forward_budget(lc: LearnerConfig) -> tuple[int, int]:
    """(rows, tokens) per micro-batch of the no-grad recompute passes, as `plan_micro_batches`
    takes them (tokens 0: count rows): `learner.max_tokens_per_forward` tokens when set, else
    twice the update's budget in the update's unit. A forward without autograd keeps no
    layer's activations for a backward, so it has room for more tokens at once than a
    micro-batch that trains; its log-probs are chunked (`learner.logprobs`), so the logits do
    not grow with it. A model on the full-logits path (`learner.forward.full_logits_reason`:
    soft-capped or scaled logits) holds [tokens x vocabulary] logits at twice the tokens:
    set max_tokens_per_forward to the update's budget there."""
    if lc.max_tokens_per_forward:
        return lc.micro_batch_size, lc.max_tokens_per_forward
    if lc.max_tokens_per_micro_batch:
        return lc.micro_batch_size, 2 * lc.max_tokens_per_micro_batch
    return 2 * lc.micro_batch_size, 0


@dataclass
class UpdateInputs:
    """What the optimizer step needs besides the batch, all [B, T] (None when not used)."""

    advantages: torch.Tensor
    old_logprobs: torch.Tensor  # behaviour log-probs (the engine's)
    proximal: torch.Tensor | None  # recomputed before the update (a correction, a rejection)
    is_weights: torch.Tensor | None  # behaviour -> proximal importance weights
    keep: torch.Tensor | None  # rejection mask (1 keeps the token)
    ref_logprobs: torch.Tensor | None  # frozen reference policy (KL loss)
    returns: torch.Tensor | None  # gae value targets
    old_values: torch.Tensor | None  # values before the update (value clipping)


class Updater:
    """Runs ppo_epochs x mini-batches x micro-batches of policy (and critic) updates."""

    def __init__(
        self,
        model,
        optimizer,
        algo: AlgorithmConfig,
        lc: LearnerConfig,
        temperature: float,
        world: int,
        rank: int,
        device: torch.device,
        critic=None,
        critic_optimizer=None,
    ):
        self.model, self.optimizer, self.algo, self.lc = model, optimizer, algo, lc
        self.critic, self.critic_optimizer = critic, critic_optimizer
        self.temperature = temperature
        self.layout = layout_of(lc, device)
        self.world, self.rank, self.device = world, rank, device
        self.metrics = UPDATE_METRICS
        """The policy update's metrics (`learner.update_metrics`)."""
        self.critic_metrics = CRITIC_METRICS
        """The critic's metrics (`learner.update_metrics`)."""

    def plan(self, batch: TrainBatch, rows: torch.Tensor) -> list[MicroBatch]:
        """This rank's forward/backward micro-batches over `rows` of `batch`
        (`learner.micro_batches`); a group's rows stay together when they share their prompt
        in the forward."""
        lc = self.lc
        return self._plan(batch, rows, lc.micro_batch_size, lc.max_tokens_per_micro_batch)

    def recompute_plan(self, batch: TrainBatch, rows: torch.Tensor) -> list[MicroBatch]:
        """This rank's micro-batches of the no-grad forwards over `rows` (`recompute`), cut by
        `forward_budget`: the same invariants as `plan` (every rank runs as many, groups that
        share a prompt stay together), fewer and larger micro-batches."""
        return self._plan(batch, rows, *forward_budget(self.lc))

    def _plan(
        self, batch: TrainBatch, rows: torch.Tensor, micro_rows: int, max_tokens: int
    ) -> list[MicroBatch]:
        shared = self.layout == "shared"
        return plan_micro_batches(
            rows,
            batch.attention_mask.sum(1),
            self.world,
            self.rank,
            micro_rows,
            max_tokens,
            batch.group_index if shared else None,
            batch.prompt_lengths if shared else None,
        )

    def run(
        self, batch: TrainBatch, inputs: UpdateInputs, epochs: int, groups_per_mini: int
    ) -> dict[str, float]:
        """`epochs` passes over the batch in mini-batches of `groups_per_mini` whole groups (0:
        one), an optimizer step each; the metrics combined over the mini-batches as each
        declares (`learner.update_metrics`)."""
        mask = batch.loss_mask[:, 1:]
        if inputs.keep is not None:
            mask = mask * inputs.keep
        group_rows = _rows_by_group(batch.group_index)
        per_mini = groups_per_mini or len(group_rows)
        steps = []
        for _ in range(epochs):
            for start in range(0, len(group_rows), per_mini):
                rows = torch.cat(group_rows[start : start + per_mini])
                steps.append(self._mini_batch_step(batch, inputs, mask, rows))
        return combine_mini_batches(steps, (*self.metrics, *self.critic_metrics))

    def _mini_batch_step(
        self, batch: TrainBatch, inputs: UpdateInputs, mask: torch.Tensor, rows: torch.Tensor
    ) -> dict[str, float]:
        """One optimizer step of the policy (and of the critic) over the mini-batch `rows`."""
        denom = float(aggregate_denominator(mask[rows], self.algo.loss_agg_mode))
        tokens = float(mask[rows].sum().clamp(min=1))
        plan = self.plan(batch, rows)
        sums = MetricSums(self.metrics, self.device)
        for i, micro in enumerate(plan):
            set_gradient_sync(self.model, i == len(plan) - 1)
            sums.add(self._micro_step(batch, inputs, mask, micro, self.world / max(denom, 1e-8)))
        grad_norm = _clip_and_step(self.model, self.optimizer, self.lc.grad_clip)
        sums.all_reduce(self.world)
        stats = {**sums.values(tokens, denom), "grad_norm": grad_norm}
        if self.critic is not None:
            stats.update(self._critic_step(batch, inputs, rows, plan))
        return stats

    def _micro_step(
        self,
        batch: TrainBatch,
        inputs: UpdateInputs,
        mask: torch.Tensor,
        micro: MicroBatch,
        scale: float,
    ) -> MicroStep:
        """Forward and backward of one micro-batch (its loss times `scale`: the global
        normalisation); what its metrics read."""
        algo = self.algo
        horizon = mask.shape[1]
        idx = micro.rows
        m = mask[idx] * micro.weights[:, None]
        logp, entropy = policy_forward(
            self.model,
            batch.select(idx),
            self.temperature,
            True,
            self.layout,
            algo.entropy_coeff > 0,
        )
        assert entropy is not None  # asked for (with_entropy=True)
        per_token, st = self._policy_loss(logp, idx, inputs, m)
        num, _ = aggregate_loss(per_token, m, algo.loss_agg_mode, horizon)
        loss = num
        if algo.entropy_coeff > 0:
            ent_num, _ = aggregate_loss(-entropy, m, algo.loss_agg_mode, horizon)
            loss = loss + algo.entropy_coeff * ent_num
        kl_tok = None
        if inputs.ref_logprobs is not None and (
            kl := algo.kl_loss.per_token(logp, inputs.ref_logprobs[idx])
        ):
            kl_tok, coef = kl
            kl_num, _ = aggregate_loss(kl_tok, m, algo.loss_agg_mode, horizon)
            loss = loss + coef * kl_num
        (loss * scale).backward()
        anchor = inputs.proximal if algo.correction.decoupled else inputs.old_logprobs
        assert anchor is not None, "decoupled: the proximal log-probs were recomputed"
        return MicroStep(
            m,
            logp.detach(),
            inputs.old_logprobs[idx],
            anchor[idx],
            entropy.detach(),
            None if kl_tok is None else kl_tok.detach(),
            num.detach(),
            st,
        )

    def _policy_loss(self, logp, idx, inputs: UpdateInputs, m):
        """The token loss of `algorithm.policy_loss` (`asyncrl.algorithms.policy_losses`) with
        the correction `algorithm.correction` asks for, whatever the loss:

        - not decoupled (`none`): the ratio is taken against the behaviour log-probs (the
          engine's), as in verl's bypass mode;
        - decoupled (`decoupled`, `truncated_is`): the ratio is taken against the proximal
          log-probs and the token losses are weighted by behaviour -> proximal importance
          weights: `inputs.is_weights` (the variant's batch weights, as `truncated_is`
          computes them), else untruncated token weights (AReaL's decoupled PPO;
          `asyncrl.algorithms.correction_math.behaviour_weighted`).
        """
        a = self.algo
        behaviour = inputs.old_logprobs[idx]
        proximal = None
        if a.correction.decoupled:
            assert inputs.proximal is not None
            proximal = inputs.proximal[idx]
        loss, stats = a.policy_loss.loss(
            PolicyLossInputs(
                logp, behaviour if proximal is None else proximal, inputs.advantages[idx], m
            )
        )
        if proximal is None:
            return loss, stats
        weights = inputs.is_weights[idx] if inputs.is_weights is not None else None
        return behaviour_weighted(loss, proximal, behaviour, m, weights), stats

    def _critic_step(self, batch, inputs: UpdateInputs, rows, plan: list[MicroBatch]):
        """One optimizer step of the critic on `value_token_loss`, token-mean over the rows."""
        c = self.algo.value_clip
        old_values, returns = inputs.old_values, inputs.returns
        assert old_values is not None and returns is not None, "a critic's inputs have them (gae)"
        tokens = float(batch.loss_mask[:, 1:][rows].sum().clamp(min=1))
        scale = self.world / tokens
        sums = MetricSums(self.critic_metrics, self.device)
        for i, micro in enumerate(plan):
            idx, mb, w = micro.rows, batch.select(micro.rows), micro.weights
            set_gradient_sync(self.critic, i == len(plan) - 1)
            m = batch.loss_mask[:, 1:][idx] * w[:, None]
            v = value_forward(self.critic, mb, self.layout)
            per_token, st = value_token_loss(v, old_values[idx], returns[idx], m, c)
            (per_token.sum() * scale).backward()
            sums.add(CriticStep(m, v, per_token, st))
        grad_norm = _clip_and_step(self.critic, self.critic_optimizer, self.lc.grad_clip)
        sums.all_reduce(self.world)
        return {**sums.values(tokens, tokens), "critic_grad_norm": grad_norm}


def _rows_by_group(group_index: torch.Tensor) -> list[torch.Tensor]:
    return [torch.nonzero(group_index == g).squeeze(-1) for g in range(int(group_index.max()) + 1)]


def _clip_and_step(model, optimizer, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
