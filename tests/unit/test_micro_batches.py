"""The learner's micro-batch plan: units balanced over ranks by tokens, token budgets kept,
groups kept together when they share a prompt, every rank running the same number of
micro-batches, every row counted exactly once."""

from __future__ import annotations

import torch

from learner.micro_batches import Unit, balance, cut, make_units, plan_micro_batches


def _counted(plans):
    return sorted(
        int(r)
        for plan in plans
        for mb in plan
        for r, w in zip(mb.rows, mb.weights, strict=True)
        if w > 0
    )


def test_rows_are_balanced_by_tokens_not_by_count():
    tokens = [100, 10, 10, 10, 10, 10, 10, 10, 10, 10]
    parts = balance(make_units(list(range(10)), tokens, 99, 0), 2)
    loads = [sum(u.cost for u in p) for p in parts]
    assert [u.rows for u in parts[0]] == [(0,)] and loads == [100, 90]


def test_token_budget_is_kept_and_a_larger_unit_goes_alone():
    units = [Unit((4,), 70), Unit((0,), 30), Unit((1,), 25), Unit((2,), 20), Unit((3,), 15)]
    bins = cut(units, micro_rows=99, max_tokens=50)
    assert [4] in bins
    cost = {4: 70, 0: 30, 1: 25, 2: 20, 3: 15}
    for b in bins:
        assert len(b) == 1 or sum(cost[r] for r in b) <= 50
    assert sorted(r for b in bins for r in b) == [0, 1, 2, 3, 4]


def test_a_group_sharing_a_prompt_travels_together_and_pays_it_once():
    tokens = [12, 14, 11, 13, 30]  # rows 0-3: group 0 with a 10-token prompt; row 4: group 1
    groups, prompts = [0, 0, 0, 0, 1], [10, 10, 10, 10, 5]
    units = make_units([0, 1, 2, 3, 4], tokens, 99, 0, groups, prompts)
    assert units == [Unit((0, 1, 2, 3), 12 + 4 + 1 + 3), Unit((4,), 30)]
    # a budget cuts the group where it would overflow; each piece pays the prompt again
    units = make_units([0, 1, 2, 3], tokens, 99, 18, groups, prompts)
    assert units == [Unit((0, 1, 2), 17), Unit((3,), 13)]
    # so do row-count micro-batches
    assert [u.rows for u in make_units([0, 1, 2, 3], tokens, 3, 0, groups, prompts)] == [
        (0, 1, 2),
        (3,),
    ]


def test_every_rank_runs_the_same_number_of_micro_batches_and_rows_count_once():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, 200, (37,), generator=g)
    groups = torch.arange(37) // 4
    prompts = torch.full((37,), 4)
    rows = torch.arange(3, 37)  # a mini-batch: a subset of the batch's rows
    for world in (1, 2, 3):
        for micro_rows, budget in ((4, 0), (99, 300), (99, 150)):
            for shared in ((None, None), (groups, prompts)):
                plans = [
                    plan_micro_batches(rows, tokens, world, r, micro_rows, budget, *shared)
                    for r in range(world)
                ]
                assert len({len(p) for p in plans}) == 1
                assert _counted(plans) == rows.tolist()
                for plan in plans:
                    for mb in plan:
                        real = mb.rows[mb.weights > 0]
                        if budget and len(real) > 1:
                            assert int(tokens[real].sum()) - 4 * (len(real) - 1) <= budget
                        if not budget:
                            assert len(mb.rows) <= micro_rows


def test_a_rank_with_fewer_micro_batches_runs_weightless_fillers():
    tokens = torch.tensor([100, 100, 100])  # rank 0: two rows of a full budget, rank 1: one
    plans = [plan_micro_batches(torch.arange(3), tokens, 2, r, 99, 100) for r in range(2)]
    assert len(plans[0]) == len(plans[1]) == 2
    fillers = [mb for p in plans for mb in p if float(mb.weights.sum()) == 0]
    assert len(fillers) == 1 and len(fillers[0].rows) == 1
