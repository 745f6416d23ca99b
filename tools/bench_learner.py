"""Learner throughput, memory and weight-sync cost, configurations side by side in one run.

    python tools/bench_learner.py [--model DIR | --shape smollm2|llama1b|llama3b] [--tiny]
                                  [--device cpu|cuda] [--rows 16] [--batch-rows 256] [--n 4]
                                  [--steps 1] [--max-tokens 4096] [--micro-rows 2] [--threads N]
                                  [--forward-tokens 0] [--bare-row-tokens 2048]
                                  [--peak-tflops T] [--configs fp32-padded,fp32-packed,...]
                                  [--sync-dtypes float32,bfloat16] [--sync-reps 5]
                                  [--json OUT.json]

The batch: a whole batch of `--batch-rows` samples (groups of `--n` sharing a prompt) gets
long-tailed response lengths: lognormal, median 128 and p99 1024 tokens (sigma = ln 8 /
2.326), clipped to [1, 1024]; prompts lognormal around 96 tokens, clipped to [64, 128]. The
learner trains its first `--rows` samples (random token ids and advantages), right-padded to
the longest row of the whole batch, as a padded learner pads them (a 16-row batch of its own
would rarely hold a row near the cap). Length statistics and padding waste (1 - real tokens /
(rows x longest)) are printed first.

Then each configuration, in a fresh learner process (world size 1; gloo on `--device cpu`,
NCCL on `cuda`; `--threads`):
1. `fp32-padded`: right-padded rows, `--micro-rows` rows per micro-batch; `bf16-padded`: the
   same with bf16 compute;
2. `fp32-packed-rows`: packed rows, each row whole (`learner.share_prompts=false`), token-budget
   micro-batches of `--max-tokens`;
3. `fp32-packed`: packed rows whose groups share one copy of their prompt (the default);
4. `bf16-packed`: the same with bf16 compute (fp32 master weights);
5. `bf16-ckpt`: and activation checkpointing;
6. `bf16-offload`: and CPU offload (on a CPU learner the weights are in host memory already,
   so this measures the offload policy's own overhead only);
7. `bf16-lora`: `bf16-packed` training LoRA adapters of rank 16 on every linear layer of the
   blocks (`learner.lora`), with the bytes one version's sync then carries next to a full one;
8. `bare`: the floor, no learner: the same real tokens through plain transformers (sdpa,
   causal) forward + backward + fused AdamW, as dense rows of `--bare-row-tokens` (the samples
   end to end, cut; no padding, no mask), `--max-tokens` per micro-batch, bf16 autocast over
   float32 weights, the next-token loss (no RL loss).
Each learner configuration recomputes the batch's log-probs first (the recompute plan,
`learner.max_tokens_per_forward` = `--forward-tokens`), then runs one warm-up `Updater.run`
(PPO, behaviour log-probs = the model's own plus noise) and `--steps` timed ones; `bare` its
warm-up and timed updates. Figures: tokens/s (real, unpadded tokens per second of update),
seconds per update, peak memory (on CUDA the device's `max_memory_allocated`, on CPU the
process's peak RSS) and MFU: FLOPs per update = 6 x N x tokens + 6 x layers x hidden x sum(len^2)
(N: the weights of the linear layers, the LM head's included; len: each sample's length, a dense
row's for `bare`; the second term is causal attention's QK^T and AV, forward and backward, at
half of 12 x layers x hidden x len^2), over seconds per update and the peak of `--peak-tflops`
(on CUDA by default the bf16 dense peak of a known device: H100 and H200 989, A100 312; on CPU
only when given). Targets: packed >= 2x padded tokens/s; checkpointing lowers peak memory
(reported in MiB and % against `bf16-packed`); bf16 log-probs stay close to fp32 (mean and max
abs difference on response tokens, before any update); on a GPU, `bf16-packed` reaches at least
0.9x `bare`'s tokens/s with at most 1.1x its peak memory (issue 28).

Weight sync: a learner process sends full versions of the model to one receiver process over
the real path (`iter_full_tensors` -> `WeightBroadcaster` -> `WeightReceiver`, a `SyncGroup`
on loopback gloo) in each `--sync-dtypes`; bytes and median seconds per version of
`--sync-reps`, next to the copy floor: one gloo broadcast of one contiguous buffer of the same
bytes between the same two processes. Target: sync / floor <= 2x.

The model is `--model`, else a random Llama of `--shape` (`SHAPES`: SmolLM2-135M's;
Llama-3.2-1B's, 1.24B parameters; Llama-3.2-3B's, 3.2B; both with a 128k vocabulary), else the
SmolLM2-135M import (`asyncrl model import-smollm2 --output models/smollm2-135m-instruct`) when
it is there, else a random Llama of its shape. `--tiny` shrinks model and lengths to a few
seconds' work (for tests). The weight sync is measured on the CPU whatever `--device` says. The
defaults took about ten minutes on an idle 2-core CPU before `bf16-padded` and `bare` joined
them (SmolLM2 fwd+bwd: ~200 tokens/s fp32; a padded run, about 4.7x the tokens of a packed one,
takes most of it). Worker processes come from a fork server
(`setup_workers`). Other work on the machine skews every figure (the load average is printed):
compare figures of one run only; with more threads than free cores, OpenMP's barriers make
small ops orders of magnitude slower.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# this checkout's asyncrl and learner (not an installed one), and the worker module
sys.path[:0] = [str(REPO), str(REPO / "tools")]

import bench_learner_worker  # noqa: E402  (tools/, next to this file)
import torch  # noqa: E402
from bench_learner_model import (  # noqa: E402
    SHAPES,
    add_mfu,
    flops_shape,
    matmul_params,
    peak_tflops,
    shape_config,
)
from bench_learner_report import report  # noqa: E402

from asyncrl.wire.sockets import free_port  # noqa: E402

DEFAULT_MODEL = REPO / "models" / "smollm2-135m-instruct"
CONFIGS: dict[str, dict[str, Any]] = {
    "fp32-padded": {"packing": False, "dtype": "float32"},
    "bf16-padded": {"packing": False, "dtype": "bfloat16"},
    "fp32-packed-rows": {"packing": True, "share_prompts": False, "dtype": "float32"},
    "fp32-packed": {"packing": True, "dtype": "float32"},
    "bf16-packed": {"packing": True, "dtype": "bfloat16"},
    "bf16-ckpt": {"packing": True, "dtype": "bfloat16", "activation_checkpointing": True},
    "bf16-offload": {"packing": True, "dtype": "bfloat16", "offload": True},
    "bf16-lora": {"packing": True, "dtype": "bfloat16", "lora": {"rank": 16, "alpha": 32.0}},
    "bare": {"bare": True, "dtype": "bfloat16"},
}
P99_Z = 2.326  # standard normal quantile of 0.99


# ----- the driver ---------------------------------------------------------------------------


def setup_model_dir(args, work: Path) -> tuple[str, str, int]:
    """(model directory, what it is, vocabulary size)."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    imported = DEFAULT_MODEL.is_dir() and not args.tiny and not args.shape
    model = args.model or (DEFAULT_MODEL if imported else None)
    if model is not None:
        return (
            str(model),
            f"{model}" if args.model else f"SmolLM2-135M from {model}",
            AutoConfig.from_pretrained(model).vocab_size,
        )
    name = args.shape or ("tiny" if args.tiny else "smollm2")
    config = shape_config(name, args.layers)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(work / "model")
    params = f"{config.hidden_size} hidden, {config.num_hidden_layers} layers, vocab "
    params += f"{config.vocab_size}, {matmul_params(config) / 1e9:.3g}B linear weights"
    what = f"random Llama of the {name} shape ({params})"
    return str(work / "model"), what, config.vocab_size


def draw_lengths(args) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(prompt, response) lengths of the first `args.rows` samples of a whole batch of
    `args.batch_rows`, and that batch's statistics: a padded learner pads every row to the
    longest of its whole batch (`learner.batch.from_message`), which a small sample would not
    reach (the longest of 16 draws is about 5x the median, of 256 the 1024 cap)."""
    g = torch.Generator().manual_seed(args.seed)
    total, cap = max(args.batch_rows, args.rows), args.response_max
    sigma = math.log(8) / P99_Z
    response = (math.log(cap / 8) + sigma * torch.randn(total, generator=g)).exp()
    response = response.round().clamp(1, cap).long()
    pm = args.prompt_median
    prompt = (math.log(pm) + 0.15 * torch.randn((total + args.n - 1) // args.n, generator=g)).exp()
    prompt = prompt.round().clamp(round(pm * 2 / 3), round(pm * 4 / 3)).long()
    prompt = prompt[torch.arange(total) // args.n]  # a group shares its prompt
    whole = {
        "batch_rows": total,
        "response_median": float(response.float().median()),
        "response_p99": float(torch.quantile(response.float(), 0.99)),
        "response_max": int(response.max()),
        "prompt_median": float(prompt.float().median()),
        "longest_row": int((prompt + response).max()),
    }
    return prompt[: args.rows], response[: args.rows], whole


def make_batch(args, vocab: int):
    """(TrainBatch, advantages [B, T], statistics) as the module docstring describes."""
    from learner.batch import TrainBatch

    prompt, response, whole = draw_lengths(args)
    g = torch.Generator().manual_seed(args.seed + 1)
    rows, width = args.rows, whole["longest_row"]
    lengths = prompt + response
    group_index = torch.arange(rows) // args.n
    pos = torch.arange(width)[None]
    attention = (pos < lengths[:, None]).long()
    loss_mask = ((pos >= prompt[:, None]) & (pos < lengths[:, None])).float()
    ids = torch.randint(1, vocab, (rows, width), generator=g)
    for r in range(rows):  # a group shares its prompt
        ids[r, : prompt[r]] = ids[int(group_index[r]) * args.n, : prompt[r]]
    batch = TrainBatch(
        input_ids=ids * attention,
        attention_mask=attention,
        loss_mask=loss_mask,
        old_logprobs=torch.zeros(rows, width),
        versions=torch.zeros(rows, width, dtype=torch.int64),
        rewards=torch.rand(rows, generator=g),
        group_index=group_index,
        baseline_rewards=torch.full((rows,), float("nan")),
        prompt_lengths=prompt,
    )
    advantages = torch.randn(rows, 1, generator=g) * loss_mask[:, 1:]
    real = int(attention.sum())
    stats = {
        "whole_batch": whole,
        "rows": rows,
        "rows_response_median": float(response.float().median()),
        "rows_response_max": int(response.max()),
        "real_tokens": real,
        "attention_sq": int((lengths**2).sum()),
        "padded_tokens": rows * width,
        "padding_waste": 1 - real / (rows * width),
    }
    return batch, advantages, stats


def start_worker(ctx, role: str, job: dict):
    """`bench_learner_worker.run_job(role, job)` in a fresh process of the fork server."""
    proc = ctx.Process(target=bench_learner_worker.run_job, args=(role, job), name=job["name"])
    proc.start()
    return proc


def finish(proc, job: dict, timeout: float) -> dict:
    """The worker's result file, or {"error": why it has none}."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"error": f"timed out after {timeout:.0f}s"}
    out = Path(job["out"])
    result = json.loads(out.read_text()) if out.exists() else {}
    if proc.exitcode != 0 and "error" not in result:
        why = f"killed by signal {-proc.exitcode}" if proc.exitcode < 0 else "no traceback"
        result = {"error": f"exit status {proc.exitcode} ({why}; out of memory?)"}
    return result


def bench_learner(ctx, args, model: str, work: Path, saved=None) -> dict:
    """Every configuration of `args.configs`, one after the other, each in its own process;
    `saved(results so far)` after each (a run cut short keeps what it measured)."""
    results: dict = {}
    for name in args.configs:
        print(f"bench: {name} ...", flush=True)
        config = CONFIGS[name]
        job = {
            "name": name,
            "model": model,
            "batch": str(work / "batch.pt"),
            "out": str(work / f"result_{name}.json"),
            "logprobs": str(work / f"logprobs_{name}.pt"),
            "device": args.device,
            "steps": args.steps,
            "threads": args.threads,
            "master_port": free_port(),
        }
        if config.get("bare"):
            role = "bare"
            job.update(dtype=config["dtype"], row_tokens=args.bare_row_tokens)
            job.update(max_tokens=args.max_tokens)
        else:
            role = "learner"
            job["lc"] = {
                **config,
                "device": args.device,
                "max_tokens_per_micro_batch": args.max_tokens if config["packing"] else 0,
                "micro_batch_size": args.micro_rows,
                "max_tokens_per_forward": args.forward_tokens,
            }
        start = time.perf_counter()
        results[name] = finish(start_worker(ctx, role, job), job, args.timeout)
        print(f"bench: {name} took {time.perf_counter() - start:.1f}s", flush=True)
        if "error" in results[name]:
            print(f"bench: {name} FAILED: {results[name]['error']}", flush=True)
        if saved is not None:
            saved(results)
    return results


def bench_sync(ctx, args, model: str, work: Path) -> dict:
    """Both sides of the weight sync, each in a process of its own."""
    print("bench: weight sync ...", flush=True)
    job = {
        "name": "sync",
        "model": model,
        "port": free_port(),
        "dtypes": args.sync_dtypes,
        "reps": args.sync_reps,
        "threads": args.threads,
        "master_port": free_port(),
        "out": str(work / "result_sync_send.json"),
    }
    job_recv = dict(job, name="sync-recv", out=str(work / "result_sync_recv.json"))
    send, recv = start_worker(ctx, "sync-send", job), start_worker(ctx, "sync-recv", job_recv)
    sent, got = finish(send, job, args.timeout), finish(recv, job_recv, args.timeout)
    for side in (sent, got):
        if "error" in side:
            print(f"bench: weight sync FAILED: {side['error']}", flush=True)
            return {"error": side["error"]}
    return {d: {**sent[d], "apply_s": got[d]["apply_s"]} for d in args.sync_dtypes}


def compare_logprobs(work: Path, batch, a: str, b: str) -> dict | None:
    fa, fb = work / f"logprobs_{a}.pt", work / f"logprobs_{b}.pt"
    if not (fa.exists() and fb.exists()):
        return None
    mask = batch.loss_mask[:, 1:] > 0
    diff = (torch.load(fa) - torch.load(fb))[mask].abs()
    return {"mean": float(diff.mean()), "max": float(diff.max())}


def summarize(results: dict, work: Path, batch) -> dict:
    """The derived figures: speed and memory ratios, log-prob differences."""
    ok = {k: v for k, v in results.items() if "error" not in v}
    out: dict = {}
    for name, key in (("bf16-packed", "packed_over_bare"), ("bf16-padded", "padded_over_bare")):
        if "bare" in ok and name in ok:
            out[f"{key}_tokens_per_s"] = ok[name]["tokens_per_s"] / ok["bare"]["tokens_per_s"]
            out[f"{key}_peak_mem"] = ok[name]["peak_mem_mib"] / ok["bare"]["peak_mem_mib"]
    if "bf16-packed" in ok and "bf16-padded" in ok:
        bf16 = ok["bf16-packed"]["tokens_per_s"] / ok["bf16-padded"]["tokens_per_s"]
        out["bf16_packed_over_padded"] = bf16
    for name, key in (
        ("fp32-packed", "packed_over_padded"),
        ("fp32-packed-rows", "rows_over_padded"),
    ):
        if "fp32-padded" in ok and name in ok:
            out[key] = ok[name]["tokens_per_s"] / ok["fp32-padded"]["tokens_per_s"]
    if "bf16-packed" in ok and "bf16-ckpt" in ok:
        base, ckpt = ok["bf16-packed"]["peak_rss_mb"], ok["bf16-ckpt"]["peak_rss_mb"]
        out["ckpt_rss_saved_mb"] = base - ckpt
        out["ckpt_rss_saved_frac"] = (base - ckpt) / base
    for key, a, b in (
        ("bf16_vs_fp32_logprobs", "fp32-packed", "bf16-packed"),
        ("packed_vs_padded_logprobs", "fp32-padded", "fp32-packed"),
    ):
        diff = compare_logprobs(work, batch, a, b)
        if diff is not None:
            out[key] = diff
    return out


def lora_sync_bytes(model: str, lora: dict) -> dict:
    """Bytes of one version's sync in float32: the adapters (`asyncrl.weights.lora`) and every weight."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.config.learner import LoraConfig
    from asyncrl.weights.lora import adapter_specs

    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    adapters = sum(s.numel for s in adapter_specs(shapes, LoraConfig(**lora), torch.float32)) * 4
    full = sum(t.numel() for t in shapes.state_dict().values()) * 4
    return {"adapter_bytes": adapters, "full_bytes": full, "ratio": adapters / full}


# ----- entry point ---------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, help="a model directory (default: the SmolLM2 import)")
    ap.add_argument("--shape", choices=SHAPES, help="a random Llama of this shape")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--peak-tflops", type=float, help="the device's peak, for MFU")
    ap.add_argument(
        "--forward-tokens",
        type=int,
        default=0,
        help="learner.max_tokens_per_forward (0: its default, twice the update's budget)",
    )
    ap.add_argument("--bare-row-tokens", type=int, help="bare: dense row length (default 2048)")
    ap.add_argument("--tiny", action="store_true", help="tiny random model and lengths (tests)")
    ap.add_argument("--layers", type=int, default=0, help="override the random model's depth")
    ap.add_argument("--rows", type=int, help="samples in the batch (default 16; --tiny 8)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument(
        "--batch-rows", type=int, default=256, help="the whole batch the rows are drawn from"
    )
    ap.add_argument("--response-max", type=int, help="longest response (default 1024; p99)")
    ap.add_argument("--prompt-median", type=int, help="median prompt tokens (default 96)")
    ap.add_argument("--steps", type=int, default=1, help="timed updates per configuration")
    ap.add_argument("--max-tokens", type=int, help="packed token budget (default 4096)")
    ap.add_argument(
        "--micro-rows",
        type=int,
        default=2,
        help="rows per padded micro-batch (4 x 1148 tokens peaked at 23 GiB: padded SDPA with a "
        "mask takes the math kernel, which keeps every layer's attention weights)",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    ap.add_argument("--sync-dtypes", default="float32,bfloat16", help="comma-separated, or ''")
    ap.add_argument("--sync-reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="per worker process, s")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args()
    small = {"rows": 8, "response_max": 64, "prompt_median": 12, "max_tokens": 256}
    small["bare_row_tokens"] = 64
    full = {"rows": 16, "response_max": 1024, "prompt_median": 96, "max_tokens": 4096}
    full["bare_row_tokens"] = 2048
    for key, value in (small if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configs {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    args.sync_dtypes = [d for d in args.sync_dtypes.split(",") if d]
    if args.model and args.shape:
        ap.error("--model or --shape, not both")
    return args


def setup_workers():
    """Worker processes are forked by a fork server that imports torch, transformers and the
    learner once (seconds per process otherwise); each is still a fresh process with its own
    peak RSS, and none has run any torch work before its job. The server finds the worker
    module on PYTHONPATH (Python 3.11's fork server ignores the parent's sys.path)."""
    paths = [str(REPO), str(REPO / "tools"), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["bench_learner_worker"])
    return ctx


def main() -> int:
    args = parse_args()
    started, load_before = time.perf_counter(), os.getloadavg()
    ctx = setup_workers()
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-learner-") as tmp:
        work = Path(tmp)
        model, what, vocab = setup_model_dir(args, work)
        print(f"bench: model {what}", flush=True)
        batch, advantages, stats = make_batch(args, vocab)
        stats["flops"] = flops_shape(model)
        torch.save({**vars(batch), "advantages": advantages}, work / "batch.pt")
        record = {"model": what, "device": args.device, "threads": args.threads, "batch": stats}
        record.update(args=_jsonable(vars(args)), partial=True)

        def saved(results: dict) -> None:  # (whole or not at all: renamed into place)
            if args.json:
                partial = args.json.with_name(args.json.name + ".partial")
                partial.write_text(json.dumps({**record, "configs": results}, indent=1))
                partial.replace(args.json)

        results = bench_learner(ctx, args, model, work, saved)
        peak = peak_tflops(args.peak_tflops, results)
        add_mfu(results, stats, stats["flops"], peak)
        derived = summarize(results, work, batch)
        if "bf16-lora" in results:
            derived["lora_sync"] = lora_sync_bytes(model, CONFIGS["bf16-lora"]["lora"])
        sync = bench_sync(ctx, args, model, work) if args.sync_dtypes else {}
    report(what, stats, results, derived, sync, args, peak)
    took, load_after = time.perf_counter() - started, os.getloadavg()
    print(
        f"\nbench: {took:.0f}s in all, {args.threads} threads per process; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after (other work skews timings)"
    )
    if args.json:
        record.update(configs=results, peak_tflops=peak, derived=derived, sync=sync, partial=False)
        record.update(seconds=took, load_average=[load_before, load_after])
        args.json.write_text(json.dumps(record, indent=1))
    failed = [n for n, r in results.items() if "error" in r] + (["sync"] if "error" in sync else [])
    return 1 if failed else 0


def _jsonable(d: dict) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}


if __name__ == "__main__":
    sys.exit(main())
