"""A discrete-event model of the asyncrl pipeline, calibrated from `tools/bench_pipeline.py` runs.

    python tools/bench_pipeline.py --json A.json                  # measure (sync and async)
    python tools/simulate.py calibrate A.json [B.json ...] -o calibration.json
    python tools/simulate.py validate A.json [B.json ...] --calibration calibration.json
    python tools/simulate.py predict [--calibration calibration.json] --servers 64 \
        --learner-ranks 8 --lengths lognormal:256:1.0 --max-new-tokens 2048 --staleness 0,1,2,4,8
    python tools/simulate.py predict --config configs/smollm2_gsm8k.yaml [section.key=value ...]
    python tools/bench_pipeline.py --modes drain,inflight --lengths lognormal --json M.json
    python tools/simulate.py modes M.json [--engine continuous]   # drain vs inflight

It predicts throughput, idle ratios and staleness for fleets this machine cannot run; the model
itself, and what it mirrors of the code, is `asyncrl/analysis/pipeline_model.py`; the weight
update modes (`rollout.weight_update_mode` drain vs inflight) are `tools/sim_weight_updates.py`.
A fleet is a run's config (`asyncrl/analysis/pipeline_inputs.py` lists the fields the model
reads): `predict` takes one with `--config` and overrides, its flags are shorthands for those
fields. Method and figures: docs/simulator.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from sim_weight_updates import ModeMeans, RecomputeCosts, mean_mode

from asyncrl.analysis.pipeline_calibration import expected_max, fit_costs, nnls
from asyncrl.analysis.pipeline_inputs import Batching, Costs, Fleet, Lengths
from asyncrl.analysis.pipeline_model import Result, simulate
from asyncrl.config import Config, ConfigError, load_config

# the model and its calibration, re-exported
__all__ = ["Costs", "Fleet", "Lengths", "Result", "expected_max", "fit_costs", "simulate"]


# ---- fleets and results ----------------------------------------------------------------------
RECORD_KEYS = {
    "num_servers": "rollout.num_servers",
    "world_size": "learner.world_size",
    "n": "rollout.n",
    "train_batch_size": "data.train_batch_size",
    "max_concurrent_groups": "rollout.max_concurrent_groups",
    "max_batch_size": "rollout.hf.max_batch_size",
    "reward_workers": "reward.workers",
    "max_new_tokens": "rollout.max_new_tokens",
    "max_staleness": "replay.max_staleness",
    "capacity_groups": "replay.capacity_groups",
}
"""Where each key of a bench_pipeline record's `config` lives in the config tree."""


def fleet_of_run(run: dict[str, Any], *overrides: str, batching: Batching | None = None) -> Fleet:
    """The fleet a bench_pipeline run had, with its measured response lengths. It trains
    padded (`learner.packing=false`: `fit_costs` fits the cost of a padded token) unless
    `overrides` (`section.key=value`) say otherwise."""
    record = [f"{RECORD_KEYS[k]}={v}" for k, v in run["config"].items() if k in RECORD_KEYS]
    cfg = load_config(None, [*record, "learner.packing=false", *overrides])
    lengths = Lengths("empirical", values=tuple(run["response_lengths"]))
    return Fleet(cfg, lengths, batching)


def mean_result(fleet: Fleet, costs: Costs, steps: int, warmup: int, seeds: int) -> Result:
    """Means over `seeds` runs (the staleness histogram summed)."""
    runs = [simulate(fleet, costs, steps, warmup, seed) for seed in range(seeds)]
    width = max(len(r.staleness_hist) for r in runs)
    return Result(
        samples_per_s=statistics.fmean(r.samples_per_s for r in runs),
        step_time_s=statistics.fmean(r.step_time_s for r in runs),
        learner_idle=statistics.fmean(r.learner_idle for r in runs),
        server_idle=statistics.fmean(r.server_idle for r in runs),
        server_pause=statistics.fmean(r.server_pause for r in runs),
        staleness_hist=[
            sum(r.staleness_hist[i] for r in runs if i < len(r.staleness_hist))
            for i in range(width)
        ],
        stale_dropped=sum(r.stale_dropped for r in runs),
    )


# ---- weight-update modes: drain vs inflight -------------------------------------------------
MODES = ("drain", "inflight")


def fit_mode_costs(bench: dict[str, Any]) -> tuple[Costs, RecomputeCosts]:
    """Costs of a `bench_pipeline.py --modes drain,inflight` record. Generation from the
    record's `decode` timing of the engine (else as `fit_costs` fits it from the drain run's
    spans, which assumes static batches), broadcast as `fit_costs` fits it; training on the tokens really trained (the
    learner packs, so no padding to the longest), from both runs; `apply_s` from the inflight
    run's apply spans (a drain apply span includes the wait for the rows in flight); the
    latencies only a synchronous run shows (lease, scoring, delivery) from the built-in
    calibration; the recompute from the record's `prefill` timing of the bench model (a
    forward over rows x tokens), else one prefill plus a decode row-step per token."""
    costs, _ = fit_costs([bench], ("drain",))
    costs = dataclasses.replace(costs, **{k: float(v) for k, v in bench.get("decode", {}).items()})
    warmup, x, y, applies = bench["warmup"], [], [], []
    for mode, run in bench["runs"].items():
        for r in run["steps"][warmup:]:
            x.append([1.0, r["train_tokens_per_s"] * r["time_update_s"]])
            y.append(r["step_time_s"] - r["time_fetch_batch_s"] - r["time_broadcast_weights_s"])
        if mode == "inflight":
            warm = run["steps"][0]["time"]
            spans = run["spans"]
            applies += [s["dur"] for s in spans if s["name"] == "apply_weights" and s["ts"] >= warm]
    train, built_in = nnls(x, y), Costs()
    costs = dataclasses.replace(
        costs,
        train_step_s=train[0],
        train_token_s=train[1],
        apply_s=statistics.fmean(applies) if applies else costs.apply_s,
        lease_s=built_in.lease_s,
        score_s=built_in.score_s,
        deliver_s=built_in.deliver_s,
    )
    prefill = bench.get("prefill") or {
        "fixed_s": costs.gen_batch_s,
        "token_s": costs.gen_seq_step_s,
    }
    return costs, RecomputeCosts(prefill["fixed_s"], prefill["token_s"])


def predict_modes(
    bench: dict[str, Any], engine: Batching, seeds: int = 3, steps: int = 80
) -> dict[str, ModeMeans]:
    """Each mode of a `--modes` record, simulated with the record's fleet (its exact response
    lengths, `engine` batching, training on real tokens) and `fit_mode_costs`."""
    costs, recompute = fit_mode_costs(bench)
    runs = bench["runs"]
    lengths = Lengths(
        "empirical", values=tuple(x for r in runs.values() for x in r["response_lengths"])
    )
    warmup = bench["warmup"]
    steps = max(steps, runs["drain"]["config"]["total_steps"])
    predicted = {}
    for mode in MODES:
        packed = ("learner.packing=true", f"rollout.weight_update_mode={mode}")
        fleet = dataclasses.replace(
            fleet_of_run(runs["drain"], *packed, batching=engine), lengths=lengths
        )
        predicted[mode] = mean_mode(fleet, costs, recompute, steps, warmup, seeds)
    return predicted


def print_modes(bench: dict[str, Any], predicted: dict[str, ModeMeans]) -> float:
    """Measured vs predicted, per mode, and the inflight/drain ratios; returns the predicted
    ratio."""
    meas = {m: bench["runs"][m]["measured"] for m in MODES}
    print(f"{'':26}" + "".join(f"{m + ' meas.':>15}{'pred.':>9}" for m in MODES))
    for label, key, pkey, fmt in (
        ("samples/s", "samples_per_s", "samples_per_s", "{:.2f}"),
        ("server idle", "server_idle", "server_idle", "{:.3f}"),
        ("stall per sync, s", "stall_per_sync_s", "stall_per_sync_s", "{:.3f}"),
        ("multi-version fraction", "multi_version_frac", "multi_version_frac", "{:.3f}"),
    ):
        cells = [
            f"{fmt.format(meas[m].get(key, float('nan'))):>15}"
            f"{fmt.format(getattr(predicted[m], pkey)):>9}"
            for m in MODES
        ]
        print(f"{label:26}" + "".join(cells))
    measured = meas["inflight"]["samples_per_s"] / meas["drain"]["samples_per_s"]
    ratio = predicted["inflight"].samples_per_s / predicted["drain"].samples_per_s
    print(
        f"inflight/drain samples/s: measured {measured:.2f} (target >= 1.30), simulator "
        f"{ratio:.2f} ({100 * (ratio - measured) / measured:+.0f}%, target within 15%)"
    )
    return ratio


# ---- command line ---------------------------------------------------------------------------
def load_costs(path: Path | None) -> Costs:
    """A `calibrate` output file's costs; the built-in calibration when `path` is None."""
    return Costs() if path is None else Costs(**json.loads(path.read_text())["costs"])


def cmd_calibrate(args: argparse.Namespace) -> None:
    benches = [json.loads(p.read_text()) for p in args.bench]
    modes = ("sync",) if args.sync_only else ("sync", "async")
    costs, report = fit_costs(benches, modes)
    out = {"costs": dataclasses.asdict(costs), "fit": report, "sources": list(map(str, args.bench))}
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["costs"], indent=1))
    for name in ("generation", "training"):
        q = report[name]
        print(f"{name} fit: {q['points']} points, R2 {q['r2']:.2f}, rel. RMSE {q['rel_rmse']:.2f}")
    print(f"calibration written to {args.out}")


RUN_COSTS = ("gen_batch_s", "gen_step_s", "gen_seq_step_s", "train_step_s", "train_token_s")
"""What `validate --per-run` takes from each run's own fit (the rest from the calibration)."""


def cmd_validate(args: argparse.Namespace) -> None:
    """Measured vs predicted async/sync ratio of each bench_pipeline record. With --per-run,
    each run is simulated with the generation and training costs fitted from that run alone
    (which then carry whatever the machine's load did to it): a check of the pipeline's
    dynamics rather than of how costs carry over from one run to another."""
    calibrated = load_costs(args.calibration)
    print(
        "| record | sync meas./pred. samples/s | async meas./pred. | ratio meas. | pred. | error |"
    )
    print("|---|---|---|---|---|---|")
    by_config: dict[str, list[tuple[float, float]]] = {}
    for path in args.bench:
        bench = json.loads(path.read_text())
        meas, pred = {}, {}
        for mode, run in bench["runs"].items():
            costs = calibrated
            if args.per_run:
                own, _ = fit_costs([{"warmup": bench["warmup"], "runs": {mode: run}}], (mode,))
                costs = dataclasses.replace(costs, **{k: getattr(own, k) for k in RUN_COSTS})
            steps = run["config"]["total_steps"]
            fleet = fleet_of_run(run)
            pred[mode] = mean_result(fleet, costs, steps, bench["warmup"], args.seeds).samples_per_s
            meas[mode] = run["measured"]["samples_per_s"]
        m, p = meas["async"] / meas["sync"], pred["async"] / pred["sync"]
        print(
            f"| {path.name} | {meas['sync']:.1f} / {pred['sync']:.1f} "
            f"| {meas['async']:.1f} / {pred['async']:.1f} | {m:.2f} | {p:.2f} "
            f"| {100 * (p - m) / m:+.0f}% |"
        )
        c = bench["runs"]["async"]["config"]
        key = ", ".join(f"{k}={c[k]}" for k in CONFIG_KEYS)
        by_config.setdefault(key, []).append((m, p))
    for key, pairs in by_config.items():
        m, p = (statistics.fmean(x) for x in zip(*pairs, strict=True))
        spread = max(x for x, _ in pairs) - min(x for x, _ in pairs)
        print(
            f"mean of {len(pairs)} at {key}: measured {m:.2f} (range {spread:.2f}), "
            f"predicted {p:.2f} ({100 * (p - m) / m:+.0f}%)"
        )


CONFIG_KEYS: tuple[str, ...] = ("num_servers", "n", "train_batch_size", "max_concurrent_groups")
CONFIG_KEYS += ("max_new_tokens", "max_staleness")


SCENARIO = (
    "rollout.num_servers=64",
    "learner.world_size=8",
    "rollout.n=8",
    "data.train_batch_size=256",
    "rollout.max_concurrent_groups=4",
    "replay.capacity_groups=4096",
    "rollout.hf.max_batch_size=256",
    "rollout.max_new_tokens=2048",
    "rollout.engine=vllm",
    "learner.packing=false",
)
"""`predict`'s fleet without --config (over configs/default.yaml): docs/simulator.md's 64
servers and 8 learner ranks, training padded (the built-in calibration prices a padded token)."""

FLAG_KEYS = {
    "servers": "rollout.num_servers",
    "learner_ranks": "learner.world_size",
    "n": "rollout.n",
    "batch_size": "data.train_batch_size",
    "concurrent": "rollout.max_concurrent_groups",
    "capacity": "replay.capacity_groups",
    "max_batch_size": "rollout.hf.max_batch_size",
    "max_new_tokens": "rollout.max_new_tokens",
    "packed": "learner.packing",
}
"""The config field each of `predict`'s shorthand flags sets."""


def predict_config(args: argparse.Namespace, staleness: int) -> Config:
    """--config (else configs/default.yaml with `SCENARIO`), then the flags given, the
    `section.key=value` overrides, and `replay.max_staleness` (the bound `predict` sweeps)."""
    given = [
        f"{key}={getattr(args, dest)}"
        for dest, key in FLAG_KEYS.items()
        if getattr(args, dest) is not None
    ]
    base = () if args.config else SCENARIO
    return load_config(
        args.config, [*base, *given, *args.overrides, f"replay.max_staleness={staleness}"]
    )


def cmd_predict(args: argparse.Namespace) -> None:
    costs = dataclasses.replace(load_costs(args.calibration), **dict(args.cost or []))
    lengths = Lengths.parse(args.lengths)
    fleets = [
        (s, Fleet(predict_config(args, s), lengths, args.engine, args.rank_efficiency))
        for s in args.staleness
    ]
    fleet = fleets[0][1]
    print(f"fleet: {fleet.describe()}")
    print(f"costs: {costs}")
    rows = []
    for s, f in fleets:
        rows.append((s, mean_result(f, costs, args.steps, args.warmup, args.seeds)))
    print(
        "| max_staleness | samples/s | x first | step s | learner idle | server idle "
        "| mean staleness | staleness histogram (% of samples) | groups dropped stale |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    trained = args.seeds * args.steps * fleet.cfg.data.train_batch_size
    for s, r in rows:
        hist = " ".join(f"{100 * c / sum(r.staleness_hist):.0f}" for c in r.staleness_hist)
        dropped = 100 * r.stale_dropped / (r.stale_dropped + trained)
        print(
            f"| {s} | {r.samples_per_s:.1f} | {r.samples_per_s / rows[0][1].samples_per_s:.2f} "
            f"| {r.step_time_s:.2f} | {r.learner_idle:.2f} | {r.server_idle:.2f} "
            f"| {r.staleness_mean:.2f} | {hist} | {dropped:.1f}% |"
        )
    best = max(r.samples_per_s for _, r in rows)
    ok = [s for s, r in rows if r.samples_per_s >= args.within * best]
    ok = [s for s, r in rows if s in ok and r.stale_dropped < 0.01 * trained] or ok
    print(
        f"suggested max_staleness: {ok[0]} (the smallest within {args.within:.0%} of the best "
        "throughput that drops under 1% of the groups as stale)"
    )


def cmd_modes(args: argparse.Namespace) -> None:
    bench = json.loads(args.bench.read_text())
    engine = args.engine or bench.get("engine", "continuous")
    costs, recompute = fit_mode_costs(bench)
    print(f"costs: {costs}")
    print(f"recompute: {recompute.recompute_s:.4g} s + {recompute.recompute_token_s:.3g} s/token")
    print(f"engine batching modelled: {engine}")
    print_modes(bench, predict_modes(bench, engine, args.seeds, args.steps))


def _cost_override(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    if name not in {f.name for f in dataclasses.fields(Costs)}:
        raise argparse.ArgumentTypeError(f"unknown cost {name!r}")
    return name, float(value)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("calibrate", help="fit costs from bench_pipeline.py --json records")
    c.add_argument("bench", nargs="+", type=Path)
    c.add_argument("-o", "--out", type=Path, required=True)
    c.add_argument("--sync-only", action="store_true", help="fit from the synchronous runs only")
    c.set_defaults(fn=cmd_calibrate)
    v = sub.add_parser("validate", help="predicted vs measured async/sync ratio")
    v.add_argument("bench", nargs="+", type=Path)
    v.add_argument("--calibration", type=Path, required=True)
    v.add_argument("--seeds", type=int, default=5)
    v.add_argument(
        "--per-run", action="store_true", help="each run's own generation/training costs"
    )
    v.set_defaults(fn=cmd_validate)
    m = sub.add_parser("modes", help="drain vs inflight: a bench_pipeline --modes record")
    m.add_argument("bench", type=Path)
    m.add_argument("--engine", choices=("static", "continuous"), help="default: the record's")
    m.add_argument("--seeds", type=int, default=3)
    m.add_argument("--steps", type=int, default=80, help="simulated steps (at least the run's)")
    m.set_defaults(fn=cmd_modes)
    p = sub.add_parser(
        "predict",
        help="throughput, idle ratios, staleness for a fleet",
        description="The fleet is --config FILE (default: configs/default.yaml with the 64-server "
        "fleet of docs/simulator.md, the defaults in brackets), then the flags given, then the "
        "section.key=value overrides; --staleness sweeps replay.max_staleness.",
    )
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.add_argument("--config", type=Path, help="a run's config YAML")
    p.add_argument("--calibration", type=Path, help="a calibrate output (default: built in)")
    scenario = dict(text.split("=") for text in SCENARIO)
    for dest, key in FLAG_KEYS.items():
        if dest != "packed":
            p.add_argument(f"--{dest.replace('_', '-')}", type=int, help=f"{key} [{scenario[key]}]")
    p.add_argument("--lengths", default="lognormal:256:1.0", help="fixed:L | lognormal:MED:SIGMA")
    p.add_argument(
        "--engine",
        choices=("static", "continuous"),
        help="engine batching [as rollout.engine batches: vllm, continuous]",
    )
    p.add_argument(
        "--packed", action="store_const", const=True, help="learner.packing=true [false]"
    )
    p.add_argument("--rank-efficiency", type=float, default=0.9)
    p.add_argument(
        "--staleness", type=lambda t: [int(x) for x in t.split(",")], default=[0, 1, 2, 4, 8]
    )
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--within", type=float, default=0.95, help="see 'suggested' in the output")
    p.add_argument(
        "--cost",
        type=_cost_override,
        action="append",
        metavar="NAME=SECONDS",
        help="override one calibrated cost (e.g. broadcast_per_server_s=0.005)",
    )
    p.set_defaults(fn=cmd_predict)
    return ap


def main() -> int:
    args = build_parser().parse_args()
    try:
        args.fn(args)
    except ConfigError as e:
        print(f"simulate.py {args.command}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
