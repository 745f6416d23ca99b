"""Evaluation metrics: mean score per data_source and unbiased pass@k.

The same code scores validation during training (`trainer.val_every`) and standalone
`asyncrl eval`, so the two report comparable numbers.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from asyncrl.config import DataConfig
from asyncrl.data.prompts import setup_task
from asyncrl.data.rows import row_to_prompt_item
from asyncrl.wire.protocol import PromptItem
from asyncrl.wire.replay_client import ReplayClient

CORRECT_AT = 1.0 - 1e-6
"""A sample counts as correct for pass@k when its score reaches 1 (full credit)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. (2021) for one prompt with n samples, c of them correct:

    pass@k = 1 - C(n - c, k) / C(n, k)
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(
    scores: Sequence[float], group_ids: Sequence[str], data_sources: Sequence[str]
) -> dict[str, float]:
    """Scores of every sample -> {"<source>/mean_score", "<source>/pass@k", "mean_score", ...}.

    pass@k is reported for k = 1, 2, 4, ... up to the smallest group's size (each prompt is one
    group of n samples); "mean_score" and "pass@k" without a prefix average over all prompts.
    """
    by_group: dict[str, list[float]] = defaultdict(list)
    source_of: dict[str, str] = {}
    for score, group, source in zip(scores, group_ids, data_sources, strict=True):
        by_group[group].append(score)
        source_of[group] = source
    if not by_group:
        return {}
    n_min = min(len(v) for v in by_group.values())
    ks = [k for k in (2**i for i in range(11)) if k <= n_min]
    out: dict[str, float] = {}
    for only in [*sorted(set(source_of.values())), None]:  # None: every source
        groups = [g for g in by_group if only is None or source_of[g] == only]
        prefix = "" if only is None else f"{only}/"
        samples = [s for g in groups for s in by_group[g]]
        out[f"{prefix}mean_score"] = sum(samples) / len(samples)
        out[f"{prefix}num_prompts"] = float(len(groups))
        for k in ks:
            per_prompt = [
                pass_at_k(len(by_group[g]), sum(s >= CORRECT_AT for s in by_group[g]), k)
                for g in groups
            ]
            out[f"{prefix}pass@{k}"] = sum(per_prompt) / len(per_prompt)
    return out


def eval_prompts(
    rows: Iterable[dict[str, Any]], n: int, temperature: float | None, job_id: str
) -> list[PromptItem]:
    """One evaluation prompt per row, each to be sampled n times at `temperature` (None: each
    server's `rollout.temperature`). ValueError for a temperature the replay would refuse
    (negative or not finite: `PromptItem.validate`)."""
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"evaluation temperature must be finite and >= 0, got {temperature}")
    items = []
    for i, row in enumerate(rows):
        item = row_to_prompt_item(row, i, n)
        items.append(dataclasses.replace(item, eval_job=job_id, temperature=temperature))
    return items


def run_eval_job(
    client: ReplayClient,
    prompts: list[PromptItem],
    job_id: str,
    timeout_s: float,
    poll_s: float = 0.2,
    progress: Callable[[int, int], None] | None = None,
    submit: bool = True,
) -> dict[str, float]:
    """Submit a job through the replay, wait until every sample is scored, summarize it. A
    prompt no server could sample (given up by the replay, `replay.max_group_failures`) is left
    out of the scores, even the samples it had, and counted (`num_failed_prompts`). Without
    `submit`, wait for a job submitted before (a wait that `progress` broke off by raising)."""
    if submit:
        client.submit_eval(job_id, prompts)
    deadline = time.monotonic() + timeout_s
    while True:
        res = client.poll_eval(job_id)
        if progress is not None:
            progress(len(res.scores), res.expected)
        if len(res.scores) >= res.expected:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"evaluation job {job_id}: {len(res.scores)}/{res.expected} samples after "
                f"{timeout_s:.0f}s; are rollout servers running on this replay?"
            )
        time.sleep(poll_s)
    failed = set(res.failed_groups)
    kept = [i for i, g in enumerate(res.group_ids) if g not in failed]
    summary = summarize(
        [float(res.scores[i]) for i in kept],
        [res.group_ids[i] for i in kept],
        [res.data_sources[i] for i in kept],
    )
    summary["response_len_mean"] = float(res.response_lengths[kept].mean()) if kept else 0.0
    summary["num_samples"] = float(len(kept))
    summary["num_failed_prompts"] = float(len(failed))
    return summary


def load_eval_rows(files: list[str], data: DataConfig) -> list[dict[str, Any]]:
    """Every row of the given parquet files once, in file order; no files: the questions of
    the task `data.task` (its `val_rows`)."""
    if not files:
        return setup_task(data).val_rows()
    import pyarrow.parquet as pq

    return [row for f in files for row in pq.read_table(f).to_pylist()]
