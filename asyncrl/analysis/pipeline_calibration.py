"""Fitting the pipeline model's unit costs (`pipeline_inputs.Costs`) to measured runs: the
`--json` records of `tools/bench_pipeline.py` (per-step metrics and trace spans of each run).
`tools/simulate.py calibrate` drives it; docs/simulator.md has the method and the figures."""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.analysis.pipeline_inputs import Costs


def nnls(rows: list[list[float]], y: list[float]) -> np.ndarray:
    """Least squares with non-negative coefficients (exhaustive over column subsets: few).
    Among equally good fits the one with the later columns wins (the per-token terms, which
    extrapolate, over the constant, when the data cannot tell them apart)."""
    a, b = np.asarray(rows, float), np.asarray(y, float)
    best, best_err = np.zeros(a.shape[1]), float("inf")
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(reversed(range(a.shape[1])), k):
            coef = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            err = float(np.sum((a[:, cols] @ coef - b) ** 2))
            if (coef >= 0).all() and err < best_err * (1 - 1e-9):
                best, best_err = np.zeros(a.shape[1]), err
                best[list(cols)] = coef
    return best


def expected_max(lengths: list[int], b: int) -> float:
    """E[max of b lengths drawn from `lengths`]: how long a static batch of b rows decodes."""
    values, counts = np.unique(lengths, return_counts=True)
    cdf = np.cumsum(counts) / counts.sum()
    below = np.concatenate([[0.0], cdf[:-1]])  # P(x < value)
    return float(np.sum(values * (cdf**b - below**b)))


Span = dict[str, Any]
"""One trace span of a bench record: name, proc, ts, dur, args."""


def _sync_latencies(
    cfg: dict[str, Any],
    spans: list[Span],
    gens: list[Span],
    warm: float,
    apply: list[float],
    lease_gaps: list[float],
    deliver_x: list[list[float]],
    deliver_gaps: list[float],
) -> None:
    """Append a synchronous run's apply times, apply-to-next-batch gaps (lease) and
    batch-end-to-fetch-end gaps (delivery, against the reward rounds of the last batch)."""
    applies = [s for s in spans if s["name"] == "apply_weights" and s["ts"] >= warm]
    apply += [s["dur"] for s in applies]
    for a in applies:
        end = a["ts"] + a["dur"]
        nxt = [s["ts"] for s in gens if s["proc"] == a["proc"] and s["ts"] >= end]
        if nxt:
            lease_gaps.append(min(nxt) - end)
    workers = cfg.get("reward_workers", 2)
    for f in spans:
        if f["name"] == "fetch_batch" and f["ts"] >= warm:
            end = f["ts"] + f["dur"]
            ended = [s for s in gens if s["ts"] + s["dur"] <= end]
            if ended:
                last = max(ended, key=lambda s: s["ts"] + s["dur"])
                deliver_x.append([1.0, math.ceil(last["args"]["batch"] / workers)])
                deliver_gaps.append(end - last["ts"] - last["dur"])


def fit_costs(
    benches: list[dict[str, Any]], modes: tuple[str, ...] = ("sync", "async")
) -> tuple[Costs, dict[str, Any]]:
    """Fit `Costs` from `tools/bench_pipeline.py --json` records. Returns (costs, fit report).

    Generation: every sampling batch after the first learner step, duration = gen_batch_s +
    gen_step_s * E[longest row] + gen_seq_step_s * rows * mean length. Training: every steady
    step, step time - fetch - broadcast = train_step_s + train_token_s * padded tokens. The
    latencies come from the synchronous runs' traces: an apply's end to the next batch's start
    (lease_s); a batch's end to the learner's fetch end = fetch_s + deliver_s + score_s *
    ceil(rows / reward workers); fetch_s is the 10th percentile of async runs' fetch times."""
    p = _gather_points(benches, modes)
    gen = nnls(p.gen_x, p.gen_y)
    train = nnls(p.train_x, p.train_y)
    if len({x[1] for x in p.bcast_x}) > 1:  # runs with different numbers of servers
        broadcast = nnls(p.bcast_x, p.bcast_y)
    else:
        broadcast = np.array([statistics.fmean(p.bcast_y), 0.0])
    fetch_s = float(np.percentile(p.fetch_ready, 10)) if p.fetch_ready else 0.0
    deliver = nnls(p.deliver_x, p.deliver_gaps) if p.deliver_gaps else np.array([fetch_s, 0.0])
    costs = Costs(
        gen_batch_s=gen[0],
        gen_step_s=gen[1],
        gen_seq_step_s=gen[2],
        train_step_s=train[0],
        train_token_s=train[1],
        fetch_s=fetch_s,
        broadcast_s=broadcast[0],
        broadcast_per_server_s=broadcast[1],
        apply_s=statistics.fmean(p.apply) if p.apply else 0.0,
        lease_s=statistics.median(p.lease_gaps) if p.lease_gaps else 0.0,
        score_s=deliver[1],
        deliver_s=max(0.0, deliver[0] - fetch_s),
        prompt_tokens=statistics.fmean(p.prompt),
    )
    report = {
        "generation": _fit_quality(p.gen_x, p.gen_y, gen),
        "training": _fit_quality(p.train_x, p.train_y, train),
        "modes": list(modes),
        "load_avg": [r["load_avg"] for bench in benches for r in bench["runs"].values()],
    }
    return costs, report


@dataclass
class _Points:
    """The regression points and latency samples of every run, gathered before any fit."""

    gen_x: list[list[float]] = field(default_factory=list)
    gen_y: list[float] = field(default_factory=list)
    train_x: list[list[float]] = field(default_factory=list)
    train_y: list[float] = field(default_factory=list)
    bcast_x: list[list[float]] = field(default_factory=list)
    bcast_y: list[float] = field(default_factory=list)
    deliver_x: list[list[float]] = field(default_factory=list)
    deliver_gaps: list[float] = field(default_factory=list)
    prompt: list[float] = field(default_factory=list)
    apply: list[float] = field(default_factory=list)
    lease_gaps: list[float] = field(default_factory=list)
    fetch_ready: list[float] = field(default_factory=list)


def _gather_points(benches: list[dict[str, Any]], modes: tuple[str, ...]) -> _Points:
    """Every generation batch after the first step, every steady training step, and the
    synchronous runs' latencies, of each bench's runs in `modes` (`fit_costs` says which)."""
    p = _Points()
    for bench in benches:
        for mode in modes:
            run = bench["runs"][mode]
            cfg, steps, spans = run["config"], run["steps"], run["spans"]
            lengths = run["response_lengths"]
            mean_len, warm = statistics.fmean(lengths), steps[0]["time"]
            gens = [s for s in spans if s["name"] == "generate" and s["ts"] >= warm]
            for s in gens:
                rows = s["args"]["batch"]
                p.gen_x.append([1.0, expected_max(lengths, rows), rows * mean_len])
                p.gen_y.append(s["dur"])
            for r in steps[bench["warmup"] :]:
                _add_step(p, cfg, r)
            if cfg["max_staleness"] == 0:  # an async apply span includes the running batch's end
                _sync_latencies(
                    cfg, spans, gens, warm, p.apply, p.lease_gaps, p.deliver_x, p.deliver_gaps
                )
    return p


def _add_step(p: _Points, cfg: dict[str, Any], r: dict[str, Any]) -> None:
    """One steady training step's points: its prompt length, its training time against its
    padded tokens, its broadcast against the servers, its fetch when the run is async."""
    prompt = r["train_tokens_per_s"] * r["time_update_s"] / r["samples"]
    p.prompt.append(prompt - r["response_len_mean"])
    p.train_x.append([1.0, r["samples"] * (p.prompt[-1] + r["response_len_max"])])
    p.train_y.append(r["step_time_s"] - r["time_fetch_batch_s"] - r["time_broadcast_weights_s"])
    p.bcast_x.append([1.0, cfg["num_servers"] - 1.0])
    p.bcast_y.append(r["time_broadcast_weights_s"])
    if cfg["max_staleness"] > 0:
        p.fetch_ready.append(r["time_fetch_batch_s"])


def _fit_quality(x: list[list[float]], y: list[float], coef: np.ndarray) -> dict[str, float]:
    pred = np.asarray(x) @ coef
    y_ = np.asarray(y)
    ss = float(np.sum((y_ - y_.mean()) ** 2)) or 1.0
    return {
        "points": len(y),
        "mean_s": float(y_.mean()),
        "r2": 1.0 - float(np.sum((y_ - pred) ** 2)) / ss,
        "rel_rmse": float(np.sqrt(np.mean((y_ - pred) ** 2)) / y_.mean()),
    }
