"""The learner's micro-batch plan: rows balanced over ranks by tokens, token budgets kept,
every rank running the same number of micro-batches, every row counted exactly once."""

from __future__ import annotations

import torch

from learner.micro_batches import balance_rows, cut, plan_micro_batches


def _counted(plans):
    return sorted(
        int(r)
        for plan in plans
        for mb in plan
        for r, w in zip(mb.rows, mb.weights, strict=True)
        if w > 0
    )


def test_rows_are_balanced_by_tokens_not_by_count():
    tokens = torch.tensor([100, 10, 10, 10, 10, 10, 10, 10, 10, 10])
    parts = balance_rows(torch.arange(10), tokens, 2)
    loads = [sum(int(tokens[r]) for r in p) for p in parts]
    assert parts[0] == [0] and loads == [100, 90]  # the long row alone on one rank


def test_token_budget_is_kept_and_a_longer_row_goes_alone():
    tokens = torch.tensor([30, 25, 20, 15, 70, 5])
    bins = cut([4, 0, 1, 2, 3, 5], tokens, micro_rows=99, max_tokens=50)
    assert [4] in bins
    for b in bins:
        assert len(b) == 1 or sum(int(tokens[r]) for r in b) <= 50
    assert sorted(r for b in bins for r in b) == [0, 1, 2, 3, 4, 5]


def test_every_rank_runs_the_same_number_of_micro_batches_and_rows_count_once():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 200, (37,), generator=g)
    rows = torch.arange(3, 37)  # a mini-batch: a subset of the batch's rows
    for world in (1, 2, 3):
        for micro_rows, budget in ((4, 0), (99, 300), (99, 150)):
            plans = [
                plan_micro_batches(rows, tokens, world, r, micro_rows, budget) for r in range(world)
            ]
            assert len({len(p) for p in plans}) == 1
            assert _counted(plans) == rows.tolist()
            for plan in plans:
                for mb in plan:
                    real = mb.rows[mb.weights > 0]
                    if budget and len(real) > 1:
                        assert int(tokens[real].sum()) <= budget
                    if not budget:
                        assert len(mb.rows) <= micro_rows


def test_a_rank_with_fewer_micro_batches_runs_weightless_fillers():
    tokens = torch.tensor([100, 100, 100])  # rank 0: two rows of a full budget, rank 1: one
    plans = [plan_micro_batches(torch.arange(3), tokens, 2, r, 99, 100) for r in range(2)]
    assert len(plans[0]) == len(plans[1]) == 2
    fillers = [mb for p in plans for mb in p if float(mb.weights.sum()) == 0]
    assert len(fillers) == 1 and len(fillers[0].rows) == 1
