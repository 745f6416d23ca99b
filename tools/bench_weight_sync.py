"""Weight-sync cost of each transport against the copy floor, side by side in one run.

    python tools/bench_weight_sync.py [--device cpu|cuda] [--dtype float32] [--reps 5]
                                      [--transports shm,gloo] [--json OUT.json]
                                      [--shape smollm2-135m|qwen2.5-1.5b|tiny]

One version of SmolLM2-135M's shape (30 layers, hidden 576, vocab 49152: its state dict, every
tensor, in the engine's `--dtype`; `--shape` for Qwen2.5-1.5B's, or a 2-layer toy) goes from
this process, as learner rank 0, to a receiver process of its own (the real `WeightBroadcaster` -> `WeightReceiver` path,
over a plain 2-member group of the transport named), `--reps` times after one warm-up version
(the first version also makes the slot and maps it). Each time is the learner's `broadcast`, from
the header to the acknowledgement: the receiver holds the whole version then. The floor is one
copy of the same bytes from one flat buffer to another on the learner's device (`memcpy`; on a
GPU the device-to-device copy), the least any transport must do; next to it, the learner's
packing alone (what a staged sync copies, without its control messages). Figures: median
seconds, GB/s,
and each transport's ratio to the floor (targets: `shm` at most 1.5x on CPU, `cuda_ipc` at most
2x on a GPU).

Transports: `shm` and `gloo` on CPU (both ends on the CPU); on `--device cuda`: `cuda_ipc` (the
receiver on the same GPU), `shm` (a CPU receiver beside the GPU learner: host staging) and
`gloo`. NCCL needs two GPUs and is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.weights.group import SyncGroup  # noqa: E402
from asyncrl.weights.layout import ParamSpec, plan_buckets, tensor_views  # noqa: E402
from asyncrl.weights.packing import copy_into
from asyncrl.weights.receiver import WeightReceiver  # noqa: E402
from asyncrl.weights.sync import WeightBroadcaster
from asyncrl.weights.transports import bucket_view, slot_offsets  # noqa: E402
from asyncrl.wire.sockets import free_port  # noqa: E402

BUCKET_BYTES = 64 * 2**20  # learner.bucket_mb's default
SHAPES = {
    "smollm2-135m": dict(layers=30, hidden=576, inter=1536, heads=9, kv_heads=3, vocab=49152),
    "qwen2.5-1.5b": dict(layers=28, hidden=1536, inter=8960, heads=12, kv_heads=2, vocab=151936),
    "tiny": dict(layers=2, hidden=64, inter=128, heads=4, kv_heads=2, vocab=512),
}


def model_specs(shape: str, dtype: torch.dtype) -> list[ParamSpec]:
    """A Llama state dict's layout (tied embeddings) of one of `SHAPES`, in `dtype`."""
    c = SHAPES[shape]
    h, kv = c["hidden"], c["hidden"] // c["heads"] * c["kv_heads"]
    specs = [ParamSpec("model.embed_tokens.weight", (c["vocab"], h), dtype)]
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        specs += [
            ParamSpec(p + "self_attn.q_proj.weight", (h, h), dtype),
            ParamSpec(p + "self_attn.k_proj.weight", (kv, h), dtype),
            ParamSpec(p + "self_attn.v_proj.weight", (kv, h), dtype),
            ParamSpec(p + "self_attn.o_proj.weight", (h, h), dtype),
            ParamSpec(p + "mlp.gate_proj.weight", (c["inter"], h), dtype),
            ParamSpec(p + "mlp.up_proj.weight", (c["inter"], h), dtype),
            ParamSpec(p + "mlp.down_proj.weight", (h, c["inter"]), dtype),
            ParamSpec(p + "input_layernorm.weight", (h,), dtype),
            ParamSpec(p + "post_attention_layernorm.weight", (h,), dtype),
        ]
    return specs + [ParamSpec("model.norm.weight", (h,), dtype)]


def receiver(args: argparse.Namespace) -> None:
    """The receiver process: takes versions until the learner shuts the group down."""
    torch.set_num_threads(1)
    device = torch.device(args.receiver_device)
    group = SyncGroup("127.0.0.1", args.port, 1, 2, device, 300.0, transport=args.transport)
    specs = model_specs(args.shape, getattr(torch, args.dtype))
    rx = WeightReceiver(group, specs)
    while (got := rx.receive()) is not None:
        got.release()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def floor_s(nbytes: int, device: torch.device, reps: int) -> float:
    """Median seconds of one copy of `nbytes` between two flat buffers on `device`."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def pack_s(
    specs: list[ParamSpec], tensors: list[torch.Tensor], device: torch.device, reps: int
) -> float:
    """Median seconds of the learner's packing alone (`copy_into`, into a slot-shaped buffer of
    its device, bucket by bucket): the part of a staged sync that is not control."""
    buckets = plan_buckets(specs, BUCKET_BYTES)
    offsets, nbytes = slot_offsets(buckets)
    slot = torch.empty(nbytes, dtype=torch.uint8, device=device)
    views = [
        [v for _, v in tensor_views(b, bucket_view(slot, b, o))]
        for b, o in zip(buckets, offsets, strict=True)
    ]
    times = []
    for _ in range(reps + 1):
        parts = iter(tensors)
        _sync(device)
        start = time.perf_counter()
        for bucket, bucket_views in zip(buckets, views, strict=True):
            copy_into(bucket_views, [next(parts) for _ in bucket.params])
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def transport_s(args: argparse.Namespace, transport: str, tensors: list[torch.Tensor]) -> float:
    """Median seconds of one version's broadcast over `transport` to a receiver process."""
    device = torch.device(args.device)
    receiver_device = args.device if transport == "cuda_ipc" else "cpu"
    port = free_port("127.0.0.1")
    cmd = [sys.executable, __file__, "--role", "receiver", "--port", str(port)]
    cmd += ["--transport", transport, "--receiver-device", receiver_device, "--dtype", args.dtype]
    cmd += ["--shape", args.shape]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        group = SyncGroup("127.0.0.1", port, 0, 2, device, 300.0, transport=transport)  # type: ignore[arg-type]
        sender = WeightBroadcaster(group, BUCKET_BYTES, device)
        specs = model_specs(args.shape, getattr(torch, args.dtype))
        times = []
        for version in range(args.reps + 1):  # the first makes and maps the slot: not timed
            _sync(device)
            start = time.perf_counter()
            failed = sender.broadcast(specs, iter(tensors), version)
            times.append(time.perf_counter() - start)
            if failed:
                raise RuntimeError(f"{transport}: {failed}")
        sender.shutdown()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="engine dtype (default: fp32 CPU, bf16 GPU)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--transports", default=None)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--role", default="learner", choices=["learner", "receiver"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--receiver-device", default="cpu")
    args = ap.parse_args()
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.role == "receiver":
        return receiver(args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    names = args.transports or ("cuda_ipc,shm,gloo" if cuda else "shm,gloo")
    specs = model_specs(args.shape, getattr(torch, args.dtype))
    tensors = [torch.randn(s.shape, device=device).to(s.dtype) for s in specs]
    nbytes = sum(s.numel * s.dtype.itemsize for s in specs)
    floor = floor_s(nbytes, device, args.reps)
    what = "device-to-device copy" if cuda else "memcpy"
    results = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "shape": args.shape,
        "version_bytes": nbytes,
        "floor": {"what": what, "seconds": floor, "GBps": nbytes / floor / 1e9},
        "transports": {},
    }
    print(f"one version: {len(specs)} tensors, {nbytes / 1e6:.0f} MB of {args.dtype} on {device}")
    print(f"{what:>24}: {floor * 1e3:8.1f} ms  {nbytes / floor / 1e9:7.2f} GB/s   (the floor)")
    packing = pack_s(specs, tensors, device, args.reps)
    results["pack"] = {"seconds": packing, "x_floor": packing / floor}
    print(f"{'packing alone':>24}: {packing * 1e3:8.1f} ms  {packing / floor:5.2f}x the floor")
    for name in names.split(","):
        try:
            s = transport_s(args, name, tensors)
        except Exception as e:  # report it and go on with the others
            print(f"{name:>24}: failed: {e!r}")
            results["transports"][name] = {"error": repr(e)}
            continue
        ratio = s / floor
        print(
            f"{name:>24}: {s * 1e3:8.1f} ms  {nbytes / s / 1e9:7.2f} GB/s   {ratio:5.2f}x the floor"
        )
        results["transports"][name] = {"seconds": s, "GBps": nbytes / s / 1e9, "x_floor": ratio}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
