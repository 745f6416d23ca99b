"""Throughput of the whole pipeline, two configurations side by side in one run.

    python tools/bench_pipeline.py [--steps 14] [--warmup 4] [--hidden 256] [--layers 4]
                                   [--new-tokens 48] [--n 4] [--batch-size 8] [--concurrent 8]
                                   [--servers 1] [--async-staleness 2] [--json OUT.json]
                                   [--lengths eos|lognormal [--median 32] [--p99 512]]
                                   [--modes drain,inflight] [--sim-engine continuous]
                                   [override ...]

Runs the same config twice, `replay.max_staleness=0` (synchronous: generation and training take
turns) and `replay.max_staleness=2` (asynchronous: they overlap), and prints samples/s of each,
their ratio, the ideal ratio (T_gen + T_train) / max(T_gen, T_train) from the synchronous run's
phase times, and peak RSS per process. Target: async/sync >= 0.8 x ideal.

The model is a randomly initialised Llama with the embedded tokenizer, sized by the flags so
that generation and training both cost real compute; a random model emits EOS now and then
(about half the responses reach `--new-tokens` at the default 48), from the same distribution
in both runs, so both do the same work per sample on average.

`--modes drain,inflight` instead runs the asynchronous config (`--async-staleness`) once per
`rollout.weight_update_mode`, same seed, and prints for each: samples/s, server idle, stall per
sync (the mean `apply_weights` span: in drain mode from the version's arrival until it is
applied, in inflight mode the apply's pause), the multi-version fraction and the reward, then
the inflight/drain ratio next to `tools/simulate.py`'s prediction from this very run (`simulate
.py modes`, engine batching `--sim-engine`). With long-tailed lengths drain waits at every sync
for the longest response in flight; inflight does not, but recomputes the live rows' cache.

`--lengths lognormal` samples every response to an exact length (`tools/bench_agents.py`:
`ignore_eos`, lengths lognormal with `--median` and `--p99`, the same per prompt row in both
runs), capped at `--new-tokens` (default 2 x p99).

`--json OUT.json` also writes what `tools/simulate.py calibrate` fits its costs from: each run's
config, its per-step metrics and its trace spans (generation batches, weight applies, learner
stages), with the machine's load average before and after each run; per run a `reward_curve` (step,
cumulative samples, mean reward: reward against samples for both runs), and with `--modes`
the bench model's measured costs, from which the simulator prices them: a forward over
rows x tokens (`prefill`: the inflight recompute) and the HF engine's sampling (`decode`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from asyncrl.config import load_config
from asyncrl.launch.fleet import threads_per_process
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def build_bench_model(out: Path, hidden: int, layers: int, context: int = 256) -> str:
    """A random Llama of the given size whose context holds `context` tokens."""
    from asyncrl.demo.model_cache import TinyModelSpec
    from asyncrl.demo.tiny_model import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    spec = TinyModelSpec(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        max_position_embeddings=context,
    )
    model = build_tiny_model(tokenizer, spec, seed=0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine has been busy, including time stolen by the hypervisor;
    CPU seconds of this process and of its children that have exited)."""
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    busy += getattr(t, "steal", 0.0)
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        own += r.ru_utime + r.ru_stime
    return busy, own


def measure(run_dir: Path, warmup: int) -> dict[str, Any]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steady = rows[warmup:]
    if len(steady) < 2:
        raise SystemExit(f"{run_dir}: too few steps after warm-up ({len(rows)} in all)")
    span = steady[-1]["time"] - rows[warmup - 1]["time"]
    samples = sum(r["samples"] for r in steady)
    train = [
        r["time_update_s"]
        + r["time_broadcast_weights_s"]
        + r["time_compute_advantages_s"]
        + r["time_publish_version_s"]
        for r in steady
    ]
    fetch = [r["time_fetch_batch_s"] for r in steady]
    rss = {}
    for f in sorted((run_dir / "stats").glob("*.json")):
        rss[f.stem] = json.loads(f.read_text()).get("peak_rss_mb", float("nan"))
    applies = [
        s["dur"]
        for s in read_spans(run_dir)
        if s["name"] == "apply_weights" and s["ts"] >= rows[warmup - 1]["time"]
    ]
    rewards = [r["reward_mean"] for r in rows[len(rows) // 2 :]]
    return {
        "samples_per_s": samples / span,
        "stall_per_sync_s": sum(applies) / len(applies) if applies else 0.0,
        "multi_version_frac": sum(r.get("multi_version_frac", 0.0) for r in steady) / len(steady),
        "reward_last_half": float(np.mean(rewards)),
        "reward_last_half_se": float(np.std(rewards) / np.sqrt(len(rewards))),
        "t_train": sum(train) / len(train),
        "t_fetch": sum(fetch) / len(fetch),
        "rss": rss,
        "staleness": sum(r["staleness_mean"] for r in steady) / len(steady),
        "learner_idle": sum(r["learner_idle_ratio"] for r in steady) / len(steady),
        "server_idle": sum(r.get("server_idle_ratio", 0.0) for r in steady) / len(steady),
    }


def read_spans(run_dir: Path) -> list[dict[str, Any]]:
    """Every process's trace spans, in time order, each with its process's name."""
    spans = []
    for f in sorted((run_dir / "trace").glob("*.jsonl")):
        spans += [{**s, "proc": f.stem} for s in read_jsonl(f)]
    return sorted(spans, key=lambda s: s["ts"])


def measure_prefill(model_path: str, threads: int) -> dict[str, float]:
    """Seconds of one forward over rows x tokens of the bench model (the cache filled, as the
    HF engine's prefill and its in-flight recompute do), fitted as fixed_s + token_s * tokens
    over a few shapes, each the fastest of three tries, on the servers' thread count."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    x, y = [], []
    with torch.inference_mode():
        for rows, length in ((1, 16), (4, 32), (8, 64), (16, 64), (16, 128), (32, 96)):
            ids = torch.randint(0, model.config.vocab_size, (rows, length))
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                cache = DynamicCache(config=model.config)
                model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
                best = min(best, time.perf_counter() - start)
            x.append([1.0, rows * length])
            y.append(best)
    torch.set_num_threads(before)
    coef = np.linalg.lstsq(np.asarray(x), np.asarray(y), rcond=None)[0]
    return {"fixed_s": max(0.0, float(coef[0])), "token_s": max(0.0, float(coef[1]))}


def measure_decode(model_path: str, threads: int) -> dict[str, float]:
    """The HF engine's sampling cost, measured on the bench model: `rows` requests of exactly
    `length` tokens at once take gen_batch_s + gen_step_s * length + gen_seq_step_s * rows *
    length (the simulator's decode costs; the runs' `generate` spans are busy periods of a
    continuous engine, from which they cannot be told apart). Fastest of two tries per shape."""
    import asyncio

    import torch

    from asyncrl.analysis.pipeline_calibration import nnls
    from rollout_servers.engines.base import SamplingParams
    from rollout_servers.engines.hf import HFEngine

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    engine = HFEngine(model_path)
    prompt = list(range(3, 10))

    async def timed(rows: int, length: int) -> float:
        params = SamplingParams(max_new_tokens=length, ignore_eos=True)
        start = time.perf_counter()
        await asyncio.gather(*(engine.generate(prompt, params) for _ in range(rows)))
        return time.perf_counter() - start

    async def run() -> tuple[list[list[float]], list[float]]:
        x, y = [], []
        for rows, length in ((1, 16), (1, 64), (8, 32), (16, 64), (32, 32), (32, 64)):
            x.append([1.0, float(length), float(rows * length)])
            y.append(min([await timed(rows, length) for _ in range(2)]))
        await engine.close()
        return x, y

    coef = nnls(*asyncio.run(run()))
    torch.set_num_threads(before)
    return {"gen_batch_s": coef[0], "gen_step_s": coef[1], "gen_seq_step_s": coef[2]}


def calibration_record(run_dir: Path, cfg: Any, result: dict[str, Any], loads: list) -> dict:
    """Everything `tools/simulate.py calibrate` needs from one run (see the module docstring)."""
    spans = read_spans(run_dir)
    steps = read_jsonl(run_dir / "metrics.jsonl")
    cumulative = np.cumsum([r["samples"] for r in steps]).tolist()
    lengths = [r["response_len"] for r in read_jsonl(run_dir / "rollout_metrics.jsonl")]
    return {
        "run_dir": str(run_dir),
        "config": {
            "num_servers": cfg.rollout.num_servers,
            "world_size": cfg.learner.world_size,
            "n": cfg.rollout.n,
            "train_batch_size": cfg.data.train_batch_size,
            "max_concurrent_groups": cfg.rollout.max_concurrent_groups,
            "max_batch_size": cfg.rollout.hf.max_batch_size,
            "reward_workers": cfg.reward.workers,
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "max_staleness": cfg.replay.max_staleness,
            "capacity_groups": cfg.replay.capacity_groups,
            "total_steps": cfg.trainer.total_steps,
        },
        "measured": {k: v for k, v in result.items() if k != "rss"},
        "load_avg": loads,
        "steps": steps,
        "spans": spans,
        "reward_curve": [
            {"step": i + 1, "samples": c, "reward_mean": r["reward_mean"]}
            for i, (c, r) in enumerate(zip(cumulative, steps, strict=True))
        ],
        "response_lengths": lengths,
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--new-tokens", type=int, help="rollout.max_new_tokens (48; lognormal: 2 x p99)"
    )
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (rollout.n)")
    ap.add_argument("--batch-size", type=int, default=8, help="groups per learner step")
    ap.add_argument("--concurrent", type=int, default=8, help="rollout.max_concurrent_groups")
    ap.add_argument("--servers", type=int, default=1, help="rollout.num_servers")
    ap.add_argument("--async-staleness", type=int, default=2, help="the async runs' bound")
    ap.add_argument("--lengths", choices=("eos", "lognormal"), default="eos")
    ap.add_argument("--median", type=float, default=32.0, help="lognormal: median new tokens")
    ap.add_argument("--p99", type=float, default=512.0, help="lognormal: 99th percentile")
    ap.add_argument(
        "--modes",
        type=lambda t: t.split(","),
        help="weight update modes to compare (drain,inflight) instead of sync vs async",
    )
    ap.add_argument(
        "--sim-engine",
        choices=("static", "continuous"),
        default="continuous",
        help="the engine batching the simulator models (the HF engine's, for --modes)",
    )
    ap.add_argument("--json", type=Path, help="write both runs' calibration records here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.modes is not None and sorted(args.modes) != ["drain", "inflight"]:
        ap.error("--modes: want drain,inflight")
    if args.new_tokens is None:
        args.new_tokens = 48 if args.lengths == "eos" else round(2 * args.p99)
    return args


def length_overrides(args: argparse.Namespace) -> list[str]:
    """With lognormal lengths: the benchmark agent loop, which the servers import from the
    repository root (on PYTHONPATH, inherited by the launcher's processes)."""
    if args.lengths == "eos":
        return []
    os.environ["ASYNCRL_BENCH_LENGTHS"] = f"{args.median}:{args.p99}"
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)
    return ["rollout.agent_loop=tools.bench_agents:LognormalLengthAgent"]


def run_one(args: argparse.Namespace, name: str, model: str, work: Path, extra: list[str]):
    """One launch of the bench config; returns (measured, calibration record, config)."""
    cfg = load_config(
        overrides=[
            f"trainer.model_path={model}",
            f"trainer.run_dir={work / name}",
            f"trainer.total_steps={args.steps}",
            f"rollout.max_new_tokens={args.new_tokens}",
            f"rollout.n={args.n}",
            f"data.train_batch_size={args.batch_size}",
            f"rollout.max_concurrent_groups={args.concurrent}",
            f"rollout.num_servers={args.servers}",
            "learner.micro_batch_size=32",
            "learner.lr=1e-5",
            "trainer.save_final=false",
            "launch.progress=none",
            *extra,
            *args.overrides,
        ]
    )
    print(f"bench: running {name} ({' '.join(extra)}) ...", flush=True)
    load_before, cpu_before, started = os.getloadavg(), cpu_seconds(), time.monotonic()
    run_dir = launch(cfg)
    cpu_after, wall = cpu_seconds(), time.monotonic() - started
    result = measure(run_dir, args.warmup)
    result["other_cpu_cores"] = max(
        0.0, ((cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1])) / wall
    )
    record = calibration_record(run_dir, cfg, result, [load_before, os.getloadavg()])
    return result, record, cfg


def report_sync_async(results: dict[str, dict[str, Any]]) -> None:
    sync, asyn = results["sync"], results["async"]
    t_train = sync["t_train"]
    t_gen = sync["t_fetch"]  # synchronous: the learner waits exactly for one batch of generation
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    ratio = asyn["samples_per_s"] / sync["samples_per_s"]
    print()
    print(f"{'':24}{'sync':>12}{'async':>12}")
    print(f"{'samples/s':24}{sync['samples_per_s']:12.2f}{asyn['samples_per_s']:12.2f}")
    print(f"{'mean staleness':24}{sync['staleness']:12.2f}{asyn['staleness']:12.2f}")
    report_resources(results)
    print(f"sync phase times: T_gen {t_gen:.3f}s  T_train {t_train:.3f}s per step")
    print(
        f"async/sync ratio {ratio:.2f}; ideal {ideal:.2f}; achieved {ratio / ideal:.2f} x ideal "
        f"(target >= 0.80)"
    )


def report_resources(results: dict[str, dict[str, Any]]) -> None:
    a, b = results.values()
    for proc in sorted(set(a["rss"]) | set(b["rss"])):
        print(
            f"{'peak RSS MiB ' + proc:24}{a['rss'].get(proc, float('nan')):12.0f}"
            f"{b['rss'].get(proc, float('nan')):12.0f}"
        )
    print(
        f"{'other processes, cores':24}{a['other_cpu_cores']:12.2f}"
        f"{b['other_cpu_cores']:12.2f}   (CPU the rest of the machine used meanwhile)"
    )


def report_modes(results: dict[str, dict[str, Any]], bench: dict[str, Any]) -> None:
    """The modes side by side, measured and as the simulator predicts them from this run."""
    from simulate import predict_modes, print_modes  # tools/ is this script's sys.path[0]

    drain, inflight = results["drain"], results["inflight"]
    print()
    print(f"{'':24}{'drain':>12}{'inflight':>12}")
    for label, key in (("mean staleness", "staleness"), ("reward, last half", "reward_last_half")):
        print(f"{label:24}{drain[key]:12.3f}{inflight[key]:12.3f}")
    print(
        f"{'  standard error':24}{drain['reward_last_half_se']:12.3f}"
        f"{inflight['reward_last_half_se']:12.3f}"
    )
    report_resources(results)
    print(f"\nsimulator (engine batching: {bench['engine']}), from this run's costs:")
    print_modes(bench, predict_modes(bench, bench["engine"]))


def main() -> int:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="asyncrl-bench-"))
    context = max(256, args.new_tokens + 128)  # the prompt and the longest response
    model = build_bench_model(work / "model", args.hidden, args.layers, context)
    extra = length_overrides(args)
    if args.modes is None:
        runs = {
            "sync": ["replay.max_staleness=0"],
            "async": [f"replay.max_staleness={args.async_staleness}"],
        }
    else:
        runs = {
            m: [f"replay.max_staleness={args.async_staleness}", f"rollout.weight_update_mode={m}"]
            for m in args.modes
        }
    results, records, cfg = {}, {}, None
    for name, overrides in runs.items():
        results[name], records[name], cfg = run_one(args, name, model, work, overrides + extra)
    bench: dict[str, Any] = {"warmup": args.warmup, "runs": records, "engine": args.sim_engine}
    bench["lengths"] = {"kind": args.lengths, "median": args.median, "p99": args.p99}
    if args.modes is None:
        report_sync_async(results)
    else:
        assert cfg is not None  # the modes name at least one run
        bench["prefill"] = measure_prefill(model, threads_per_process(cfg))
        bench["decode"] = measure_decode(model, threads_per_process(cfg))
        report_modes(results, bench)
    if args.json is not None:
        args.json.write_text(json.dumps(bench))
        print(f"calibration record written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
