"""Drained against in-flight weight updates in the transformers engine, measured on the device
(CUDA or the CPU): tokens/s and what each version holds generation back, while versions arrive
every `--interval` seconds during the generation of many rows.

    python tools/bench_update_modes.py [--device cuda] [--model smollm2-shape] [--rows 32]
                                       [--min-new-tokens 16] [--max-new-tokens 128]
                                       [--interval 1.0] [--seconds 10]
                                       [--modes none,drain,inflight] [--json OUT.json]

The open question it answers (`rollout.weight_update_mode`, docs/pipeline.md): on a GPU a decode
step of a small model costs about the same for 1 row as for 32, so `drain` (stop admitting, let
the live rows finish, then apply) wastes more there than on a CPU: while it drains, each step
samples for ever fewer rows at the same price. `inflight` applies the version between two decode
steps and rebuilds the live rows' KV cache (`rollout.inflight_kv=recompute`).

One process, no sockets: `--rows` closed-loop callers on one event loop keep the engine full, as
a rollout server's agent loops do (each asks again as soon as its response is done; response
lengths drawn between `--min-new-tokens` and `--max-new-tokens` with `ignore_eos`, the same
draws for every mode), while a second thread hands the engine a new version every `--interval`
seconds through the path its weight receiver takes (`HFVersionGate._hand_over`, the version
applied entirely by whichever thread gets there first, then the delivery probe scored), two
weight sets taking turns. Per mode, over `--seconds` of generation:
- `tokens_per_s`: tokens of the responses finished inside the window, over the window;
- `stall_mean_s`, `stall_max_s`: what each version held generation back, as the server reports
  it (`AppliedVersion.apply_s`: drain, from arrival until applied; inflight, the copy and the
  probe), and `apply_mean_s`, the copy and probe alone;
- `mean_live_rows`: rows in the batch, sampled every 5 ms (drain empties it before applying);
- `multi_version_frac`: responses whose tokens span two versions (inflight only);
- `versions`: versions applied (a drain that outlasts the interval delays the next one).
`none` is the same load with no version at all: the ceiling both modes are compared against.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: bench_gpu_engine
from bench_gpu_engine import build_model, default_dtype, device_name, make_prompts  # noqa: E402

MODES = ("none", "drain", "inflight")


@dataclass
class ModeFigure:
    mode: str
    requests: int
    tokens: int
    tokens_per_s: float
    versions: int
    stall_mean_s: float
    stall_max_s: float
    apply_mean_s: float
    mean_live_rows: float
    multi_version_frac: float
    busy_frac: float
    """Share of the window the sampling loop was admitting or stepping rows."""


@dataclass
class Load:
    """What every mode is given alike."""

    prompts: list[list[int]]
    lengths: list[list[int]]
    """Per caller, the max_new_tokens of its successive requests."""
    seconds: float
    interval: float


def weight_sets(engine, seed: int):
    """Two versions' weights (the loaded ones, and the same with 1% noise), each with the
    delivery probe the engine must reproduce after applying it."""
    import torch

    from asyncrl.weights.probe import DeliveryProbe, probe_ids

    base = [(name, t.detach().clone()) for name, t in engine.named_weights()]
    gen = torch.Generator(device=base[0][1].device).manual_seed(seed)
    noisy = []
    for name, t in base:
        noise = torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32)
        spread = t.float().std() if t.numel() > 1 else torch.tensor(0.0, device=t.device)
        noisy.append((name, (t.float() + 0.01 * spread * noise).to(t.dtype)))
    ids = probe_ids(engine.model.config.vocab_size)
    sets = []
    for weights in (noisy, base):  # the loaded weights last: version 0 stays what was loaded
        engine.update_weights(weights, 0)
        sets.append((weights, DeliveryProbe(engine.probe_logprobs(ids).float().cpu(), 1e-2)))
    return sets  # version v gets sets[v % 2]: odd versions the noisy weights


def updater(engine, sets, interval: float, stop: threading.Event, applied: list):
    """Thread: version v arrives at v * interval (or as soon as the previous one is applied, if
    later) and is handed over as the weight receiver does; (held, apply) seconds per version."""
    from rollout_servers.engines.hf_versions import _Incoming

    start, version = time.perf_counter(), 0
    while not stop.is_set():
        version += 1
        delay = start + version * interval - time.perf_counter()
        if delay > 0 and stop.wait(delay):
            return
        weights, probe = sets[version % 2]
        incoming = _Incoming(weights, version, probe, False, None)
        arrived = time.perf_counter()
        engine._hand_over(incoming)
        if incoming.error is not None:
            raise incoming.error
        held = time.perf_counter() - arrived
        if engine.weight_update_mode == "inflight":
            held = incoming.seconds  # what follow_learner reports: generation paused only here
        applied.append((held, incoming.seconds))


async def drive(engine, load: Load, sets, mode: str) -> ModeFigure:
    """The closed-loop callers for `load.seconds`, the updater thread unless mode is none."""
    from rollout_servers.engines.base import SamplingParams

    finished: list[tuple[int, bool]] = []  # (tokens, spans versions) inside the window
    live: list[int] = []
    applied: list[tuple[float, float]] = []
    stop = threading.Event()
    thread: threading.Thread | None = None
    errors: list[BaseException] = []
    busy0, start = engine.busy_s, time.perf_counter()
    deadline = start + load.seconds

    async def caller(i: int) -> None:
        for length in load.lengths[i]:
            if time.perf_counter() >= deadline:
                return
            params = SamplingParams(temperature=1.0, max_new_tokens=length, ignore_eos=True)
            out = await engine.generate(load.prompts[i], params)
            if time.perf_counter() <= deadline:
                finished.append((len(out.token_ids), len(set(out.versions)) > 1))

    async def watch_rows() -> None:
        while time.perf_counter() < deadline:
            live.append(engine.live_rows)
            await asyncio.sleep(0.005)

    if mode != "none":

        def run_updater() -> None:
            try:
                updater(engine, sets, load.interval, stop, applied)
            except BaseException as e:  # reported by the bench, not lost in the thread
                errors.append(e)

        thread = threading.Thread(target=run_updater, name="bench-updater")
        thread.start()
    try:
        await asyncio.gather(watch_rows(), *(caller(i) for i in range(len(load.prompts))))
    finally:
        stop.set()
        if thread is not None:
            await asyncio.to_thread(thread.join)
    if errors:
        raise errors[0]
    window = load.seconds
    tokens = sum(t for t, _ in finished)
    holds = [h for h, _ in applied]
    return ModeFigure(
        mode=mode,
        requests=len(finished),
        tokens=tokens,
        tokens_per_s=round(tokens / window, 1),
        versions=len(applied),
        stall_mean_s=round(sum(holds) / len(holds), 4) if holds else 0.0,
        stall_max_s=round(max(holds), 4) if holds else 0.0,
        apply_mean_s=round(sum(a for _, a in applied) / len(applied), 4) if applied else 0.0,
        mean_live_rows=round(sum(live) / len(live), 2) if live else 0.0,
        multi_version_frac=round(sum(m for _, m in finished) / max(1, len(finished)), 3),
        busy_frac=round(min(1.0, (engine.busy_s - busy0) / window), 3),
    )


def run_mode(model_dir: Path, args, dtype: str, load: Load, mode: str) -> ModeFigure:
    """A fresh engine in `mode` (none runs as drain with no version), warmed up, then driven."""
    from rollout_servers.engines.base import SamplingParams
    from rollout_servers.engines.hf import HFEngine

    engine = HFEngine(
        model_dir,
        device=args.device,
        max_batch_size=args.rows,
        seed=args.seed,
        dtype=dtype,
        weight_update_mode="inflight" if mode == "inflight" else "drain",
    )
    sets = weight_sets(engine, args.seed)

    async def warm_then_drive() -> ModeFigure:
        warm = SamplingParams(max_new_tokens=8, ignore_eos=True)
        await asyncio.gather(*(engine.generate(p, warm) for p in load.prompts))
        try:
            return await drive(engine, load, sets, mode)
        finally:
            await engine.close()

    return asyncio.run(warm_then_drive())


def make_load(model_dir: Path, args) -> Load:
    prompts = make_prompts(model_dir, args.rows, args.prompt_len, args.seed)
    rng = random.Random(args.seed)
    most = int(args.seconds * 1000) + 1  # more requests than any caller can finish
    lengths = [
        [rng.randint(args.min_new_tokens, args.max_new_tokens) for _ in range(most)]
        for _ in prompts
    ]
    return Load(prompts, lengths, args.seconds, args.interval)


def print_figure(f: ModeFigure, ceiling: float | None) -> None:
    rel = f" ({f.tokens_per_s / ceiling:.2f} of none)" if ceiling else ""
    print(
        f"{f.mode}: {f.tokens_per_s:.0f} tokens/s{rel}, {f.requests} responses, "
        f"{f.versions} versions, stall/version mean {f.stall_mean_s * 1000:.1f} ms max "
        f"{f.stall_max_s * 1000:.1f} ms (apply {f.apply_mean_s * 1000:.1f} ms), live rows "
        f"{f.mean_live_rows:.1f}, multi-version {f.multi_version_frac:.2f}, busy {f.busy_frac:.2f}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--model", default="smollm2-shape", help="tiny, smollm2-shape or a dir")
    parser.add_argument("--dtype", default=None, help="default: float32 for tiny, else bfloat16")
    parser.add_argument("--rows", type=int, default=32, help="concurrent callers (batch rows)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--min-new-tokens", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between versions")
    parser.add_argument("--seconds", type=float, default=10.0, help="window per mode")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        sys.exit(f"--modes: {bad[0]!r} is not one of {', '.join(MODES)}")
    if not 1 <= args.min_new_tokens <= args.max_new_tokens:
        sys.exit("--min-new-tokens must be in [1, --max-new-tokens]")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda but torch sees no CUDA device (use --device cpu)")
    started = time.perf_counter()
    dtype = args.dtype or default_dtype(args.model)
    figures: list[ModeFigure] = []

    def save() -> None:  # after each mode: a run cut short keeps what it measured
        report = {
            "device": device_name(args.device),
            "model": Path(args.model).name,
            "dtype": dtype,
            "rows": args.rows,
            "new_tokens": [args.min_new_tokens, args.max_new_tokens],
            "interval_s": args.interval,
            "seconds": args.seconds,
            "results": [asdict(f) for f in figures],
            "wall_s": round(time.perf_counter() - started, 1),
        }
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="bench-update-modes-") as tmp:
        model_dir = build_model(args.model, dtype, Path(tmp), args.seed)
        load = make_load(model_dir, args)
        print(
            f"{args.model} {dtype} on {device_name(args.device)}: {args.rows} callers, responses "
            f"of {args.min_new_tokens}-{args.max_new_tokens} tokens, a version every "
            f"{args.interval}s, {args.seconds}s per mode",
            flush=True,
        )
        for mode in modes:
            figures.append(run_mode(model_dir, args, dtype, load, mode))
            save()
            ceiling = next((f.tokens_per_s for f in figures if f.mode == "none"), None)
            print_figure(figures[-1], ceiling if mode != "none" else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
