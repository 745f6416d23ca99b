"""Which rejections mean something (torch-free): the rule the `sequence` rejection's config
check (`asyncrl.algorithms.corrections`) and the rejection mask's math
(`asyncrl.algorithms.correction_math.rejection_mask`) both apply."""

from __future__ import annotations

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
        return f"{agg} aggregates a sequence's tokens: it needs the sequence level"
    if metric == "ratio":
        return "the sequence ratio is already the product of its token ratios (use k1 with sum)"
    if metric == "k1" and agg == "max":
        return "the max of k1 bounds no divergence (verl has no seq_max_k1): use k2 or k3"
    return None
