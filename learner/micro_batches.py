"""Which rows each learner rank runs, in which micro-batches (pure functions of the batch).

Every rank holds the whole batch, so every rank computes the same plan for every rank without
talking to the others:
1. the rows of a mini-batch are shared out over the ranks balanced by tokens (longest first,
   each to the rank with the fewest tokens so far; ties to the fewest rows, then lowest rank);
2. each rank cuts its rows into micro-batches: at most `max_tokens` tokens each when a token
   budget is set (first-fit, longest first; a row longer than the budget gets one of its own,
   like verl's dynamic batch size), else at most `micro_rows` rows;
3. every rank runs as many micro-batches as the busiest rank (FSDP's collectives pair up):
   the others add micro-batches of one row at weight 0 (computed, never counted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    rows: torch.Tensor  # int64 row indices into the batch
    weights: torch.Tensor  # float32, 1.0 per counted row, 0.0 for the filler row


def balance_rows(rows: torch.Tensor, tokens: torch.Tensor, world: int) -> list[list[int]]:
    """Share `rows` (indices) over `world` ranks balanced by `tokens` (per batch row)."""
    load = [0] * world
    parts: list[list[int]] = [[] for _ in range(world)]
    order = sorted(rows.tolist(), key=lambda r: (-int(tokens[r]), r))
    for r in order:
        rank = min(range(world), key=lambda i: (load[i], len(parts[i]), i))
        parts[rank].append(r)
        load[rank] += int(tokens[r])
    return parts


def cut(rows: list[int], tokens: torch.Tensor, micro_rows: int, max_tokens: int) -> list[list[int]]:
    """One rank's rows (longest first) as micro-batches by row count or by token budget."""
    if not max_tokens:
        return [rows[i : i + micro_rows] for i in range(0, len(rows), micro_rows)]
    bins: list[list[int]] = []
    room: list[int] = []
    for r in rows:
        need = int(tokens[r])
        for i, free in enumerate(room):
            if need <= free:
                bins[i].append(r)
                room[i] -= need
                break
        else:
            bins.append([r])
            room.append(max_tokens - need)
    return bins


def plan_micro_batches(
    rows: torch.Tensor,
    tokens: torch.Tensor,
    world: int,
    rank: int,
    micro_rows: int,
    max_tokens: int = 0,
) -> list[MicroBatch]:
    """This rank's micro-batches over `rows`; every rank gets the same number of them (their
    tensors on `tokens`' device)."""
    per_rank = [
        cut(part, tokens, micro_rows, max_tokens) for part in balance_rows(rows, tokens, world)
    ]
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
