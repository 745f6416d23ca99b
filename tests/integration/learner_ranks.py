"""One learner rank of tests/integration/test_learner_exactness.py (run as a script, one process
per rank, torchrun-style environment; argv: model dir, report path, device cpu|cuda): the same
batch trained padded and packed.

For every loss_agg_mode it runs one update of a fresh FSDP2 model (same weights, same batch)
twice: right-padded rows in row-count micro-batches, and packed rows in token-budget
micro-batches (several per rank, uneven, so filler micro-batches run too). The optimizer is SGD
with lr 1 and no clipping in effect, so the weight change of the step is minus the gradient.
Activation checkpointing and CPU offload must give the packed run's numbers too. Rank 0 writes
the largest differences of log-probs, losses and gradients (and critic values, and bf16-vs-fp32
log-probs) as JSON to argv[2].
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.config import AlgorithmConfig, LearnerConfig
from asyncrl.launch.worker import exit_now
from learner.batch import TrainBatch
from learner.forward import layout_of, policy_forward, value_forward
from learner.fsdp import iter_full_tensors, setup_distributed, setup_model
from learner.losses import AGGREGATION_MODES
from learner.update import UpdateInputs, Updater, recompute

VOCAB = 64
TOKEN_BUDGET = 48


def build_model(path: str) -> None:
    """A random Llama with grouped-query attention (4 query heads, 2 key/value heads)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def make_batch(rows: int = 24, groups_of: int = 4) -> TrainBatch:
    """Groups of rows sharing a prompt of 2 to 6 tokens, responses of 1 to ~35 (long-tailed),
    right-padded. One row of group 1 has a prompt of its own (same length, other tokens)."""
    g = torch.Generator().manual_seed(1)
    group = torch.arange(rows) // groups_of
    prompts = torch.randint(2, 7, (rows // groups_of,), generator=g)[group]
    responses = torch.clamp((torch.randn(rows, generator=g) * 0.8 + 2.0).exp().long(), 1, 35)
    lengths = prompts + responses
    width = int(lengths.max())
    pos = torch.arange(width)[None]
    attention = (pos < lengths[:, None]).long()
    loss_mask = ((pos >= prompts[:, None]) & (pos < lengths[:, None])).float()
    ids = torch.randint(1, VOCAB, (rows, width), generator=g)
    first = group * groups_of
    ids = torch.where(pos < prompts[:, None], ids[first], ids) * attention
    ids[groups_of + 1, 0] = ids[groups_of, 0] % (VOCAB - 1) + 1  # not the group's prompt
    return TrainBatch(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        old_logprobs=torch.zeros(rows, width),
        versions=torch.zeros(rows, width, dtype=torch.int64),
        rewards=torch.rand(rows, generator=g),
        group_index=group,
        baseline_rewards=torch.full((rows,), float("nan")),
        prompt_lengths=prompts,
    )


def full_params(model) -> dict[str, torch.Tensor]:
    return {name: t.cpu().clone() for name, t in iter_full_tensors(model)}


def run_case(path, lc: LearnerConfig, algo: AlgorithmConfig, batch, old, adv, world, rank):
    """(log-probs [B, T] before the step, loss, gradient per parameter)."""
    device = batch.input_ids.device
    model = setup_model(path, device, lc)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    updater = Updater(model, optimizer, algo, lc, 1.0, world, rank, device)
    plan = updater.recompute_plan(batch, torch.arange(batch.size, device=device))

    def logp(m, b):
        return policy_forward(m, b, 1.0, False, layout_of(lc, device))[0]

    logprobs = recompute(model, batch, logp, plan, world, device)
    before = full_params(model)
    inputs = UpdateInputs(adv, old, None, None, None, None, None, None)
    stats = updater.run(batch, inputs, 1, 0)
    after = full_params(model)
    return logprobs, stats["loss"], {k: before[k] - after[k] for k in before}


def critic_values(path, lc: LearnerConfig, batch, world, rank) -> torch.Tensor:
    torch.manual_seed(2)  # the value head starts from the same random init in both layouts
    device = batch.input_ids.device
    critic = setup_model(path, device, lc, head="value")
    updater = Updater(critic, None, AlgorithmConfig(), lc, 1.0, world, rank, device)
    plan = updater.recompute_plan(batch, torch.arange(batch.size, device=device))
    return recompute(
        critic, batch, lambda m, b: value_forward(m, b, layout_of(lc, device)), plan, world, device
    )


def main() -> None:
    path, out = sys.argv[1], sys.argv[2]
    rank, world, device = setup_distributed(sys.argv[3] if len(sys.argv) > 3 else "cpu")
    batch = make_batch().to(device)
    mask = batch.loss_mask[:, 1:] > 0
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(mask.shape, generator=g).to(device) * mask
    padded = LearnerConfig(packing=False, micro_batch_size=5, grad_clip=1e9)
    packed = LearnerConfig(
        packing=True, share_prompts=False, max_tokens_per_micro_batch=TOKEN_BUDGET, grad_clip=1e9
    )
    shared = packed.model_copy(update={"share_prompts": True})
    report: dict = {"rows": batch.size, "width": batch.input_ids.shape[1]}
    old = None
    for mode in AGGREGATION_MODES:
        algo = AlgorithmConfig(loss_agg_mode=mode)
        if old is None:  # behaviour log-probs near the model's own, so some ratios clip
            ref_logp, _, _ = run_case(
                path, padded, algo, batch, torch.zeros_like(adv), adv, world, rank
            )
            old = (ref_logp + 0.2 * torch.randn(mask.shape, generator=g).to(device)) * mask
        a_logp, a_loss, a_grad = run_case(path, padded, algo, batch, old, adv, world, rank)
        for name, lc in (("packed", packed), ("shared", shared)):
            b_logp, b_loss, b_grad = run_case(path, lc, algo, batch, old, adv, world, rank)
            report[f"{mode}/{name}"] = {
                "logprob_max_abs_diff": float((a_logp - b_logp)[mask].abs().max()),
                "loss": [a_loss, b_loss],
                "grad_max_abs_diff": max(
                    float((a_grad[k] - b_grad[k]).abs().max()) for k in a_grad
                ),
                "grad_max_abs": max(float(a_grad[k].abs().max()) for k in a_grad),
            }
    values = [critic_values(path, lc, batch, world, rank) for lc in (padded, packed, shared)]
    report["value_max_abs_diff"] = max(
        float((values[0] - other)[mask].abs().max()) for other in values[1:]
    )
    algo = AlgorithmConfig()
    fp32_logp, fp32_loss, fp32_grad = run_case(path, packed, algo, batch, old, adv, world, rank)
    for saver in ("activation_checkpointing", "offload"):  # same arithmetic, less memory
        lc = packed.model_copy(update={saver: True})
        logp, loss, grad = run_case(path, lc, algo, batch, old, adv, world, rank)
        report[saver] = {
            "logprob_max_abs_diff": float((logp - fp32_logp)[mask].abs().max()),
            "loss": [fp32_loss, loss],
            "grad_max_abs_diff": max(float((grad[k] - fp32_grad[k]).abs().max()) for k in grad),
        }
    bf16 = packed.model_copy(update={"dtype": "bfloat16"})
    bf16_logp, _, _ = run_case(path, bf16, algo, batch, old, adv, world, rank)
    diff = (fp32_logp - bf16_logp)[mask].abs()
    report["bf16_logprob_abs_diff"] = {"mean": float(diff.mean()), "max": float(diff.max())}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_now(0)  # as the launcher's workers: torch's process-group threads can abort teardown
