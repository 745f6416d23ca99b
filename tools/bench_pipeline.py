"""Synchronous vs asynchronous throughput of the whole pipeline, side by side in one run.

    python tools/bench_pipeline.py [--steps 14] [--warmup 4] [--hidden 256] [--layers 4]
                                   [--new-tokens 48] [--n 4] [--batch-size 8] [--concurrent 8]
                                   [--servers 1] [--async-staleness 2] [--json OUT.json]
                                   [override ...]

Runs the same config twice, `replay.max_staleness=0` (synchronous: generation and training take
turns) and `replay.max_staleness=2` (asynchronous: they overlap), and prints samples/s of each,
their ratio, the ideal ratio (T_gen + T_train) / max(T_gen, T_train) from the synchronous run's
phase times, and peak RSS per process. Target: async/sync >= 0.8 x ideal.

The model is a randomly initialised Llama with the embedded tokenizer, sized by the flags so
that generation and training both cost real compute; a random model emits EOS now and then
(about half the responses reach `--new-tokens` at the default 48), from the same distribution
in both runs, so both do the same work per sample on average.

`--json OUT.json` also writes what `tools/simulate.py calibrate` fits its costs from: each run's
config, its per-step metrics and its trace spans (generation batches, weight applies, learner
stages), with the machine's load average before and after each run.
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

import psutil

from asyncrl.config import load_config
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl


def build_bench_model(out: Path, hidden: int, layers: int) -> str:
    from asyncrl.demo.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    spec = TinyModelSpec(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
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
    return {
        "samples_per_s": samples / span,
        "t_train": sum(train) / len(train),
        "t_fetch": sum(fetch) / len(fetch),
        "rss": rss,
        "staleness": sum(r["staleness_mean"] for r in steady) / len(steady),
        "learner_idle": sum(r["learner_idle_ratio"] for r in steady) / len(steady),
        "server_idle": sum(r.get("server_idle_ratio", 0.0) for r in steady) / len(steady),
    }


def calibration_record(run_dir: Path, cfg: Any, result: dict[str, Any], loads: list) -> dict:
    """Everything `tools/simulate.py calibrate` needs from one run (see the module docstring)."""
    spans = []
    for f in sorted((run_dir / "trace").glob("*.jsonl")):
        spans += [{**s, "proc": f.stem} for s in read_jsonl(f)]
    spans.sort(key=lambda s: s["ts"])
    lengths = [r["response_len"] for r in read_jsonl(run_dir / "rollout_metrics.jsonl")]
    return {
        "run_dir": str(run_dir),
        "config": {
            "num_servers": cfg.rollout.num_servers,
            "world_size": cfg.learner.world_size,
            "n": cfg.rollout.n,
            "train_batch_size": cfg.data.train_batch_size,
            "max_concurrent_groups": cfg.rollout.max_concurrent_groups,
            "max_batch_size": cfg.rollout.max_batch_size,
            "reward_workers": cfg.reward.workers,
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "max_staleness": cfg.replay.max_staleness,
            "capacity_groups": cfg.replay.capacity_groups,
            "total_steps": cfg.trainer.total_steps,
        },
        "measured": {k: v for k, v in result.items() if k != "rss"},
        "load_avg": loads,
        "steps": read_jsonl(run_dir / "metrics.jsonl"),
        "spans": spans,
        "response_lengths": lengths,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (rollout.n)")
    ap.add_argument("--batch-size", type=int, default=8, help="groups per learner step")
    ap.add_argument("--concurrent", type=int, default=8, help="rollout.max_concurrent_groups")
    ap.add_argument("--servers", type=int, default=1, help="rollout.num_servers")
    ap.add_argument("--async-staleness", type=int, default=2, help="the async run's bound")
    ap.add_argument("--json", type=Path, help="write both runs' calibration records here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="asyncrl-bench-"))
    model = build_bench_model(work / "model", args.hidden, args.layers)
    results, records = {}, {}
    for name, staleness in (("sync", 0), ("async", args.async_staleness)):
        cfg = load_config(
            overrides=[
                f"trainer.model_path={model}",
                f"trainer.run_dir={work / name}",
                f"trainer.total_steps={args.steps}",
                f"replay.max_staleness={staleness}",
                f"rollout.max_new_tokens={args.new_tokens}",
                f"rollout.n={args.n}",
                f"data.train_batch_size={args.batch_size}",
                f"rollout.max_concurrent_groups={args.concurrent}",
                f"rollout.num_servers={args.servers}",
                "learner.micro_batch_size=32",
                "learner.lr=1e-5",
                "trainer.save_final=false",
                "launch.progress=none",
                *args.overrides,
            ]
        )
        print(f"bench: running {name} (max_staleness={staleness}) ...", flush=True)
        load_before, cpu_before, started = os.getloadavg(), cpu_seconds(), time.monotonic()
        run_dir = launch(cfg)
        cpu_after, wall = cpu_seconds(), time.monotonic() - started
        results[name] = measure(run_dir, args.warmup)
        results[name]["other_cpu_cores"] = max(
            0.0, ((cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1])) / wall
        )
        loads = [load_before, os.getloadavg()]
        records[name] = calibration_record(run_dir, cfg, results[name], loads)
    sync, asyn = results["sync"], results["async"]
    t_train = sync["t_train"]
    t_gen = sync["t_fetch"]  # synchronous: the learner waits exactly for one batch of generation
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    ratio = asyn["samples_per_s"] / sync["samples_per_s"]
    print()
    print(f"{'':24}{'sync':>12}{'async':>12}")
    print(f"{'samples/s':24}{sync['samples_per_s']:12.2f}{asyn['samples_per_s']:12.2f}")
    print(f"{'mean staleness':24}{sync['staleness']:12.2f}{asyn['staleness']:12.2f}")
    for proc in sorted(set(sync["rss"]) | set(asyn["rss"])):
        print(
            f"{'peak RSS MiB ' + proc:24}{sync['rss'].get(proc, float('nan')):12.0f}"
            f"{asyn['rss'].get(proc, float('nan')):12.0f}"
        )
    print(
        f"{'other processes, cores':24}{sync['other_cpu_cores']:12.2f}"
        f"{asyn['other_cpu_cores']:12.2f}   (CPU the rest of the machine used meanwhile)"
    )
    print(f"sync phase times: T_gen {t_gen:.3f}s  T_train {t_train:.3f}s per step")
    print(
        f"async/sync ratio {ratio:.2f}; ideal {ideal:.2f}; achieved {ratio / ideal:.2f} x ideal "
        f"(target >= 0.80)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"warmup": args.warmup, "runs": records}))
        print(f"calibration record written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
