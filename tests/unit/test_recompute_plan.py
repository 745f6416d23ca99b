"""The no-grad recompute passes (proximal / reference log-probs, values) plan micro-batches of
their own budget (`learner.max_tokens_per_forward`): the rule worked out by hand, fewer and
larger micro-batches than the update's by default, the plan's invariants kept on every rank,
and outputs equal to those of the update's plan on a tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.config import AlgorithmConfig, ConfigError, LearnerConfig, load_config
from learner.batch import TrainBatch
from learner.forward import policy_forward, value_forward
from learner.fsdp import attention_implementation
from learner.update import Updater, forward_budget, recompute

CPU = torch.device("cpu")
N = 4  # samples per prompt


def test_the_budget_rule_by_hand():
    # 0: twice the update's budget, in the update's unit
    assert forward_budget(LearnerConfig(micro_batch_size=8)) == (16, 0)
    assert forward_budget(LearnerConfig(micro_batch_size=8, max_tokens_per_micro_batch=300)) == (
        8,
        600,
    )
    # set: that many tokens, whatever the update counts
    lc = LearnerConfig(micro_batch_size=8, max_tokens_per_forward=1000)
    assert forward_budget(lc) == (8, 1000)
    lc = LearnerConfig(
        micro_batch_size=8, max_tokens_per_micro_batch=300, max_tokens_per_forward=50
    )
    assert forward_budget(lc) == (8, 50)


def test_a_negative_budget_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="max_tokens_per_forward"):
        load_config(None, ["learner.max_tokens_per_forward=-1"])


def _batch(rows: int, seed: int = 0) -> TrainBatch:
    """`rows` samples in groups of N sharing a prompt of 3-6 tokens, responses of 1-14."""
    g = torch.Generator().manual_seed(seed)
    groups = torch.arange(rows) // N
    prompts = torch.randint(3, 7, (rows // N,), generator=g)[groups]
    lengths = prompts + torch.randint(1, 15, (rows,), generator=g)
    width = int(lengths.max())
    pos = torch.arange(width)[None]
    attention = (pos < lengths[:, None]).long()
    ids = torch.randint(1, 50, (rows, width), generator=g)
    for r in range(rows):
        ids[r, : prompts[r]] = ids[int(groups[r]) * N, : prompts[r]]
    loss_mask = ((pos >= prompts[:, None]) & (pos < lengths[:, None])).float()
    zeros = torch.zeros(rows, width)
    return TrainBatch(
        input_ids=ids * attention,
        attention_mask=attention,
        loss_mask=loss_mask,
        old_logprobs=zeros,
        versions=zeros.long(),
        rewards=torch.zeros(rows),
        group_index=groups,
        baseline_rewards=torch.full((rows,), float("nan")),
        prompt_lengths=prompts,
    )


def _computed(batch: TrainBatch, rows: torch.Tensor, shared: bool) -> int:
    """Tokens a packed forward of `rows` computes (a group's prompt once when shared)."""
    tokens = int(batch.attention_mask[rows].sum())
    if not shared:
        return tokens
    groups = batch.group_index[rows]
    return tokens - sum(
        int(batch.prompt_lengths[rows][groups == g][0]) * (int((groups == g).sum()) - 1)
        for g in groups.unique()
    )


CASES = {
    "token budget, shared prompts": LearnerConfig(max_tokens_per_micro_batch=60),
    "token budget, whole rows": LearnerConfig(max_tokens_per_micro_batch=60, share_prompts=False),
    "row count, padded": LearnerConfig(micro_batch_size=3, packing=False),
}


@pytest.mark.parametrize("case", CASES)
def test_the_recompute_plan_is_coarser_and_pairs_up_on_every_rank(case):
    lc = CASES[case]
    batch = _batch(40)
    every_row = torch.arange(batch.size)
    rows_per, budget = forward_budget(lc)
    for world in (1, 2, 3):
        updaters = [
            Updater(None, None, AlgorithmConfig(), lc, 1.0, world, r, CPU) for r in range(world)
        ]
        shared = updaters[0].layout == "shared"
        update = [u.plan(batch, every_row) for u in updaters]
        forward = [u.recompute_plan(batch, every_row) for u in updaters]
        # every rank runs as many no-grad forwards (the all-reduce and FSDP's gathers pair up)
        assert len({len(p) for p in forward}) == 1
        assert len(forward[0]) < len(update[0])
        counted = sorted(int(r) for p in forward for mb in p for r in mb.rows[mb.weights > 0])
        assert counted == every_row.tolist()  # each row computed by exactly one rank
        biggest = {
            name: max(_computed(batch, mb.rows, shared) for p in plans for mb in p)
            for name, plans in (("update", update), ("forward", forward))
        }
        assert biggest["forward"] > biggest["update"]
        for mb in (mb for p in forward for mb in p if mb.weights.sum() > 0):
            if budget:
                assert len(mb.rows) == 1 or _computed(batch, mb.rows, shared) <= budget
            else:
                assert len(mb.rows) <= rows_per
            if shared:  # a group's rows together (a group of 4 fits the doubled budget)
                for g in batch.group_index[mb.rows].unique():
                    assert set((batch.group_index == g).nonzero().flatten().tolist()) <= set(
                        mb.rows.tolist()
                    )


def _tiny_model(lc: LearnerConfig, head: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        num_labels=1,
    )
    config._attn_implementation = attention_implementation(lc, CPU)
    if head == "value":
        from transformers import LlamaForTokenClassification

        return LlamaForTokenClassification(config).eval()
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("head", ["lm", "value"])
def test_recompute_gives_the_update_plans_outputs(case, head):
    lc = CASES[case]
    batch = _batch(20, seed=1)
    model = _tiny_model(lc, head)
    updater = Updater(model, None, AlgorithmConfig(), lc, 1.0, 1, 0, CPU)
    layout = updater.layout

    def fn(m, b):
        if head == "value":
            return value_forward(m, b, layout)
        return policy_forward(m, b, 0.7, False, layout)[0]

    every_row = torch.arange(batch.size)
    plans = updater.plan(batch, every_row), updater.recompute_plan(batch, every_row)
    assert len(plans[1]) < len(plans[0])
    want, got = (recompute(model, batch, fn, plan, 1, CPU) for plan in plans)
    target = batch.attention_mask[:, 1:] > 0
    assert bool((want[target] != 0).all())  # every real target was computed
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
