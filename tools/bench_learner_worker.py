"""The processes of tools/bench_learner.py, one per measurement (so peak memory is its own).

The driver forks each from a fork server that has imported this module (torch, transformers,
the learner) and calls `run_job(role, job)`:
- `learner`: one learner configuration (world size 1; gloo on CPU, NCCL on CUDA, as
  `setup_distributed` picks) as `Learner` sets it up: FSDP2 model, fused AdamW, `Updater`; it
  recomputes the batch's log-probs in the recompute plan (written to a file, so the driver
  compares dtypes and layouts), then times `Updater.run`.
- `bare`: the floor: the same real tokens through plain transformers (sdpa, causal), forward,
  backward and fused AdamW, as dense rows (`dense_micro_batches`), no RL loss.
- `sync-send` / `sync-recv`: the two ends of the weight sync, as `Learner.broadcast_weights`
  and `HFEngine.follow_learner` do it, then the copy floor between the same two processes.
Each writes its figures, or its error and traceback, as JSON to the job's `out`. Peak memory is
the process's: on CUDA `torch.cuda.max_memory_allocated` (and reserved), on CPU the peak RSS;
each job is a fresh process, so each configuration's counters start at zero. On CUDA every
timed interval ends with `torch.cuda.synchronize` (kernels are asynchronous).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's asyncrl and learner, not an installed one

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from asyncrl.config import AlgorithmConfig, LearnerConfig  # noqa: E402
from asyncrl.dtypes import torch_dtype  # noqa: E402
from asyncrl.metrics import peak_rss_mb  # noqa: E402
from asyncrl.weights.group import SyncGroup  # noqa: E402
from asyncrl.weights.layout import specs_of  # noqa: E402
from asyncrl.weights.receiver import WeightReceiver  # noqa: E402
from asyncrl.weights.sync import WeightBroadcaster  # noqa: E402
from learner.batch import TrainBatch  # noqa: E402
from learner.forward import layout_of, policy_forward  # noqa: E402
from learner.fsdp import (  # noqa: E402
    iter_full_tensors,
    param_specs,
    setup_distributed,
    setup_model,
)
from learner.optim import setup_optimizer  # noqa: E402
from learner.packing import pack_rows  # noqa: E402
from learner.update import UpdateInputs, Updater, recompute  # noqa: E402


def run_job(role: str, job: dict) -> None:
    """The process's one job; an error is written to `out` (then raised: exit status 1)."""
    os.environ.update(
        RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["master_port"])
    )
    torch.set_num_threads(job["threads"])
    hf_logging.disable_progress_bar()
    try:
        WORKERS[role](job)
    except Exception as e:
        error = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        Path(job["out"]).write_text(json.dumps(error, indent=1))
        raise


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA runs them asynchronously): before a clock is
    read, so the interval holds the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_figures(device: torch.device) -> dict:
    """Peak memory of this process (on CUDA: since the last `reset_peak_memory_stats`):
    `peak_mem_mib` is the figure configurations are compared by (device memory on CUDA,
    resident memory on CPU)."""
    out: dict[str, Any] = {"peak_rss_mb": peak_rss_mb()}
    if device.type == "cuda":
        out["peak_mem_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        out["peak_reserved_mib"] = torch.cuda.max_memory_reserved(device) / 2**20
        out["device_name"] = torch.cuda.get_device_name(device)
    else:
        out["peak_mem_mib"] = out["peak_rss_mb"]
    return out


def timed_updates(device: torch.device, steps: int, update) -> tuple[list[float], object]:
    """One warm-up `update()`, then the seconds of `steps` timed ones (and the last's result)."""
    result = update()
    seconds = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        result = update()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds, result


def load_batch(job: dict, device: torch.device) -> tuple[TrainBatch, torch.Tensor]:
    saved = torch.load(job["batch"])
    advantages = saved.pop("advantages")
    return TrainBatch(**saved).to(device), advantages.to(device)


def learner_worker(job: dict) -> None:
    """One configuration: set up, recompute log-probs, warm up, time `steps` updates."""

    rank, world, device = setup_distributed(job["lc"]["device"])
    lc = LearnerConfig(**job["lc"])
    batch, advantages = load_batch(job, device)
    start = time.perf_counter()
    model = setup_model(job["model"], device, lc)
    optimizer = setup_optimizer(model, 1e-6, lc)
    updater = Updater(model, optimizer, AlgorithmConfig(), lc, 1.0, world, rank, device)
    setup_s, setup_memory = time.perf_counter() - start, memory_figures(device)
    every_row = torch.arange(batch.size, device=device)
    plan, forward_plan = updater.plan(batch, every_row), updater.recompute_plan(batch, every_row)

    def logp(m, b):
        return policy_forward(m, b, 1.0, False, layout_of(lc, device))[0]

    synchronize(device)
    start = time.perf_counter()
    logprobs = recompute(model, batch, logp, forward_plan, world, device)
    synchronize(device)
    recompute_s, recompute_memory = time.perf_counter() - start, memory_figures(device)
    if device.type == "cuda":  # from here the update's own peak (RSS cannot be reset)
        torch.cuda.reset_peak_memory_stats(device)
    torch.save(logprobs.cpu(), job["logprobs"])
    mask = batch.loss_mask[:, 1:]
    noise = 0.05 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    behaviour = (logprobs + noise.to(device)) * mask  # near the policy's own: some ratios clip
    inputs = UpdateInputs(advantages, behaviour, None, None, None, None, None, None)
    seconds, stats = timed_updates(device, job["steps"], lambda: updater.run(batch, inputs, 1, 0))
    per_update = statistics.median(seconds)
    tokens = int(batch.attention_mask.sum())
    memory = memory_figures(device)
    if device.type == "cuda":
        memory["update_peak_mem_mib"] = memory["peak_mem_mib"]
    for key in ("peak_mem_mib", "peak_reserved_mib"):  # the whole process's
        if key in memory:
            memory[key] = max(memory[key], recompute_memory[key])
    result = {
        "tokens_per_s": tokens / per_update,
        "seconds_per_update": per_update,
        "seconds": seconds,
        **memory,
        "setup_peak_mem_mib": setup_memory["peak_mem_mib"],
        "recompute_peak_mem_mib": recompute_memory["peak_mem_mib"],
        "setup_s": setup_s,
        "recompute_s": recompute_s,
        "micro_batches": len(plan),
        "recompute_micro_batches": len(forward_plan),
        "threads": torch.get_num_threads(),
        "real_tokens": tokens,
        "computed_tokens": computed_tokens(batch, plan, updater.layout),
        "update_stats": stats,
    }
    Path(job["out"]).write_text(json.dumps(result, indent=1))


def dense_micro_batches(batch: TrainBatch, row_tokens: int, max_tokens: int) -> list:
    """The batch's real tokens end to end (each sample's, in row order), cut into dense rows of
    `row_tokens` (the last one shorter), `max_tokens // row_tokens` rows per micro-batch (at
    least one; the short row in one of its own): as a pretraining loop packs documents, with
    no padding and no attention mask."""
    ids = batch.input_ids[batch.attention_mask.bool()]
    full = len(ids) // row_tokens
    rows = ids[: full * row_tokens].view(full, row_tokens)
    per_micro = max(1, max_tokens // row_tokens)
    micro = list(rows.split(per_micro)) if full else []
    if len(ids) > full * row_tokens + 1:  # (a last token alone has no target: dropped)
        micro.append(ids[full * row_tokens :][None])
    return micro


def bare_worker(job: dict) -> None:
    """The floor: plain transformers forward + backward + fused AdamW on the batch's real
    tokens as dense rows (`dense_micro_batches`), the next-token loss summed over every token
    (one optimizer step per update, as the learner's); float32 weights and optimizer, the
    forward and backward under bf16 autocast for `dtype` bfloat16 (the learner's bf16: bf16
    compute, float32 master weights)."""
    device = torch.device("cuda", 0) if job["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    batch, _ = load_batch(job, device)
    start = time.perf_counter()
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        job["model"], dtype=torch.float32, attn_implementation="sdpa"
    )
    model.to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    setup_s = time.perf_counter() - start
    micro = dense_micro_batches(batch, job["row_tokens"], job["max_tokens"])
    targets = sum(mb.numel() - mb.shape[0] for mb in micro)
    bf16 = job["dtype"] == "bfloat16"

    def update() -> float:
        total = torch.zeros((), device=device)
        for mb in micro:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=mb, labels=mb).loss  # mean over mb's targets
            weighted = loss * ((mb.numel() - mb.shape[0]) / targets)
            weighted.backward()
            total += weighted.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(total)

    seconds, loss = timed_updates(device, job["steps"], update)
    per_update = statistics.median(seconds)
    tokens = sum(mb.numel() for mb in micro)
    result = {
        "tokens_per_s": tokens / per_update,
        "seconds_per_update": per_update,
        "seconds": seconds,
        **memory_figures(device),
        "setup_s": setup_s,
        "micro_batches": len(micro),
        "threads": torch.get_num_threads(),
        "real_tokens": tokens,
        "computed_tokens": tokens,
        "attention_sq": sum(mb.shape[0] * mb.shape[1] ** 2 for mb in micro),
        "loss": loss,
    }
    Path(job["out"]).write_text(json.dumps(result, indent=1))


def computed_tokens(batch, plan, layout: str) -> int:
    """Tokens the forwards of `plan` run on: padded rows, or the packed rows (less the prompt
    copies a shared layout saves)."""
    if layout == "padded":
        return sum(len(mb.rows) for mb in plan) * batch.input_ids.shape[1]
    total = 0
    for mb in plan:
        b = batch.select(mb.rows)
        shared = layout == "shared"
        args = (b.prompt_lengths, b.group_index) if shared else (None, None)
        total += pack_rows(b.input_ids, b.attention_mask, *args).input_ids.shape[1]
    return total


def ack(group) -> None:
    """Both sides reach this point (a one-element all-reduce on the sync group's own gloo
    group): a broadcast timed on the sender alone ends when its bytes leave, not arrive."""
    group._pg.allreduce([torch.zeros(1)]).wait()


def median_timed(reps: int, group, fn, after=None) -> float:
    """Median seconds of `fn` between two acks, over `reps` runs after one warm-up run;
    `after` runs after each second ack (untimed)."""
    seconds = []
    for _ in range(reps + 1):
        ack(group)
        start = time.perf_counter()
        fn()
        ack(group)
        seconds.append(time.perf_counter() - start)
        if after is not None:
            after()
    return statistics.median(seconds[1:])


def floor_s(group, nbytes: int, reps: int) -> float:
    """The transport alone: one broadcast of one contiguous buffer of `nbytes`."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    return median_timed(reps, group, lambda: group.broadcast(buffer))


def tied_duplicates(model) -> list[str]:
    """State-dict names whose storage an earlier name already holds (tied weights)."""
    seen, dup = set(), []
    for name, t in model.state_dict().items():
        ptr = (t.to_local() if hasattr(t, "to_local") else t).data_ptr()
        if ptr in seen:
            dup.append(name)
        seen.add(ptr)
    return dup


def send_versions(model, broadcaster, group, dtype: torch.dtype, reps: int) -> dict:
    """`reps` + 1 full versions in `dtype`, as `Learner.broadcast_weights` sends them."""

    specs = param_specs(model, dtype)
    nbytes = sum(s.numel * s.dtype.itemsize for s in specs)
    versions = iter(range(1, 1 << 30))

    def sync():
        tensors = (t for _, t in iter_full_tensors(model))
        broadcaster.broadcast(specs, tensors, next(versions))

    sync_s = median_timed(reps, group, sync)
    floor = floor_s(group, nbytes, reps)
    gather = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in iter_full_tensors(model):
            pass
        gather.append(time.perf_counter() - start)
    return {
        "bytes": nbytes,
        "params": len(specs),
        "sync_s": sync_s,
        "floor_s": floor,
        "ratio": sync_s / floor,
        "gather_s": statistics.median(gather),
        "tied_duplicate_names": tied_duplicates(model),
    }


def sync_send_worker(job: dict) -> None:
    """The learner side: an FSDP2 model (world size 1) broadcasting full versions."""

    _, _, device = setup_distributed("cpu")
    lc = LearnerConfig(device="cpu")
    model = setup_model(job["model"], device, lc)
    group = SyncGroup("127.0.0.1", job["port"], 0, 2, device)
    broadcaster = WeightBroadcaster(group, int(lc.bucket_mb * 2**20))
    out = {
        name: send_versions(model, broadcaster, group, torch_dtype(name), job["reps"])
        for name in job["dtypes"]
    }
    broadcaster.shutdown()
    Path(job["out"]).write_text(json.dumps(out, indent=1))


def receive_versions(model_path: str, group, dtype: torch.dtype, reps: int) -> dict:
    """The receiving end of `send_versions`, then of its floor; times the apply (the copy
    into the model, `HFEngine.update_weights`' work) apart from the sync."""

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    params = dict(model.state_dict())
    receiver = WeightReceiver(group, specs_of(params.items()))
    apply, received = [], []

    def receive():
        received.append(receiver.receive())

    def apply_received():
        got = received.pop()
        assert got is not None, "the receiver closed before the version arrived"
        start = time.perf_counter()
        with torch.no_grad():
            for key, tensor in got.weights:
                params[key].copy_(tensor)
        got.release()  # as HFEngine does: the next version reuses the staging memory
        apply.append(time.perf_counter() - start)

    median_timed(reps, group, receive, after=apply_received)
    floor_s(group, sum(s.numel * s.dtype.itemsize for s in receiver.specs), reps)
    return {"apply_s": statistics.median(apply[1:])}


def sync_recv_worker(job: dict) -> None:
    """The rollout-server side, as `HFEngine.follow_learner` does it."""

    group = SyncGroup("127.0.0.1", job["port"], 1, 2, torch.device("cpu"))
    out = {
        name: receive_versions(job["model"], group, torch_dtype(name), job["reps"])
        for name in job["dtypes"]
    }
    if WeightReceiver(group, []).receive() is not None:  # the learner's shutdown comes last
        raise RuntimeError("expected the learner's shutdown after the last version")
    Path(job["out"]).write_text(json.dumps(out, indent=1))


WORKERS = {
    "learner": learner_worker,
    "bare": bare_worker,
    "sync-send": sync_send_worker,
    "sync-recv": sync_recv_worker,
}
