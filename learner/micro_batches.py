"""Which rows each learner rank runs, in which micro-batches (pure functions of the batch).

Every rank holds the whole batch, so every rank computes the same plan for every rank without
talking to the others:
1. rows are put in units: one row each, or, when a group's rows share one copy of their prompt
   in a packed forward, the group's rows together (cut where they would exceed a micro-batch);
   a unit costs its tokens, a shared prompt counted once;
2. units are shared out over the ranks balanced by cost (largest first, each to the rank with
   the least cost so far; ties to the fewest rows, then the lowest rank);
3. each rank cuts its units into micro-batches: at most `max_tokens` tokens each when a token
   budget is set (first-fit, largest first; a unit over the budget gets one of its own, like
   verl's dynamic batch size), else at most `micro_rows` rows;
4. every rank runs as many micro-batches as the busiest rank (FSDP's collectives pair up):
   the others add micro-batches of one row at weight 0 (computed, never counted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    rows: torch.Tensor  # int64 row indices into the batch
    weights: torch.Tensor  # float32, 1.0 per counted row, 0.0 for the filler row


@dataclass(frozen=True)
class Unit:
    rows: tuple[int, ...]
    cost: int  # tokens the forward computes for these rows


def make_units(
    rows: list[int],
    tokens: list[int],
    micro_rows: int,
    max_tokens: int,
    groups: list[int] | None = None,
    prompts: list[int] | None = None,
) -> list[Unit]:
    """Single rows, or (with `groups` and `prompts`, per batch row) each group's rows together,
    cut so that a unit fits a micro-batch (it pays its prompt once per piece)."""
    if groups is None or prompts is None:
        return [Unit((r,), tokens[r]) for r in rows]
    by_group: dict[int, list[int]] = {}
    for r in rows:
        by_group.setdefault(groups[r], []).append(r)
    units = []
    for members in by_group.values():
        piece: list[int] = []
        cost = 0
        for r in members:
            more = tokens[r] - (prompts[r] if piece else 0)
            full = len(piece) == micro_rows if not max_tokens else cost + more > max_tokens
            if piece and full:
                units.append(Unit(tuple(piece), cost))
                piece, more = [], tokens[r]
                cost = 0
            piece.append(r)
            cost += more
        units.append(Unit(tuple(piece), cost))
    return units


def balance(units: list[Unit], world: int) -> list[list[Unit]]:
    """Share units over `world` ranks balanced by cost."""
    load = [0] * world
    count = [0] * world
    parts: list[list[Unit]] = [[] for _ in range(world)]
    for unit in sorted(units, key=lambda u: (-u.cost, u.rows)):
        rank = min(range(world), key=lambda i: (load[i], count[i], i))
        parts[rank].append(unit)
        load[rank] += unit.cost
        count[rank] += len(unit.rows)
    return parts


def cut(units: list[Unit], micro_rows: int, max_tokens: int) -> list[list[int]]:
    """One rank's units (largest first) as micro-batches of rows, by row count or budget."""
    bins: list[list[int]] = []
    room: list[int] = []
    for unit in units:
        need = unit.cost if max_tokens else len(unit.rows)
        capacity = max_tokens or micro_rows
        for i, free in enumerate(room):
            if need <= free:
                bins[i].extend(unit.rows)
                room[i] -= need
                break
        else:
            bins.append(list(unit.rows))
            room.append(capacity - need)
    return bins


def plan_micro_batches(
    rows: torch.Tensor,
    tokens: torch.Tensor,
    world: int,
    rank: int,
    micro_rows: int,
    max_tokens: int = 0,
    groups: torch.Tensor | None = None,
    prompts: torch.Tensor | None = None,
) -> list[MicroBatch]:
    """This rank's micro-batches over `rows` (tokens, groups, prompts: per batch row); every
    rank gets the same number of them (their tensors on `tokens`' device). Pass `groups` and
    `prompts` when a group's rows share their prompt in the forward."""
    tokens_ = tokens.tolist()
    shared: tuple[list[int] | None, list[int] | None] = (None, None)
    if groups is not None:
        assert prompts is not None, "groups and prompts are passed together"
        shared = (groups.tolist(), prompts.tolist())
    units = make_units(rows.tolist(), tokens_, micro_rows, max_tokens, *shared)
    per_rank = [cut(part, micro_rows, max_tokens) for part in balance(units, world)]
    count = max(1, max(len(bins) for bins in per_rank))
    device = tokens.device
    mine = [
        MicroBatch(
            torch.tensor(sorted(b), dtype=torch.int64, device=device),
            torch.ones(len(b), device=device),
        )
        for b in per_rank[rank]
    ]
    filler = MicroBatch(rows[:1].to(device), torch.zeros(1, device=device))
    return mine + [filler] * (count - len(mine))
