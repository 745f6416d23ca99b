"""Synchronous vs asynchronous throughput of the whole pipeline, side by side in one run.

    python tools/bench_pipeline.py [--steps 14] [--warmup 4] [--hidden 256] [--layers 4]
                                   [--new-tokens 48] [override ...]

Runs the same config twice, `replay.max_staleness=0` (synchronous: generation and training take
turns) and `replay.max_staleness=2` (asynchronous: they overlap), and prints samples/s of each,
their ratio, the ideal ratio (T_gen + T_train) / max(T_gen, T_train) from the synchronous run's
phase times, and peak RSS per process. Target: async/sync >= 0.8 x ideal.

The model is a randomly initialised Llama with the embedded tokenizer, sized by the flags so
that generation and training both cost real compute; a random model rarely emits EOS, so every
response is `--new-tokens` long and both runs do identical work per sample.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.launcher import launch
from asyncrl.metrics import read_jsonl


def build_bench_model(out: Path, hidden: int, layers: int) -> str:
    from asyncrl.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer

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


def measure(run_dir: Path, warmup: int) -> dict[str, float]:
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
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="asyncrl-bench-"))
    model = build_bench_model(work / "model", args.hidden, args.layers)
    results = {}
    for name, staleness in (("sync", 0), ("async", 2)):
        cfg = load_config(
            overrides=[
                f"trainer.model_path={model}",
                f"trainer.run_dir={work / name}",
                f"trainer.total_steps={args.steps}",
                f"replay.max_staleness={staleness}",
                f"rollout.max_new_tokens={args.new_tokens}",
                "rollout.n=4",
                "data.train_batch_size=8",
                "rollout.max_concurrent_groups=8",
                "learner.micro_batch_size=32",
                "learner.lr=1e-5",
                "trainer.save_final=false",
                "launch.progress=none",
                *args.overrides,
            ]
        )
        print(f"bench: running {name} (max_staleness={staleness}) ...", flush=True)
        results[name] = measure(launch(cfg), args.warmup)
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
    print(f"sync phase times: T_gen {t_gen:.3f}s  T_train {t_train:.3f}s per step")
    print(
        f"async/sync ratio {ratio:.2f}; ideal {ideal:.2f}; achieved {ratio / ideal:.2f} x ideal "
        f"(target >= 0.80)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
