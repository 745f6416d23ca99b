"""Peak memory of the learner's log-probs, full-logits path against chunked (`learner.logprobs`).

    python tools/bench_logprob_memory.py [--vocab 128256] [--tokens 4096,8192,16384]
                                         [--chunk-tokens N] [--threads 1] [--json OUT.json]

A random Llama with a large vocabulary and a tiny body (hidden 64, one layer), so the vocabulary
is what costs memory. For each path (`full`, then `chunked`) and each micro-batch size, a fresh
process builds the model and one packed micro-batch (rows of 512 tokens, groups of 4 sharing a
64-token prompt, the learner's default layout) and runs `learner.forward.policy_forward` (with
the entropy as a statistic, as an update does) and the backward of a loss over every target
token, in float32 on CPU.

What it measures: the process's peak resident memory (`getrusage` ru_maxrss) after the forward
and backward minus its value just before them (model, batch, imports and allocator already in
place): the extra memory one micro-batch's log-probs need. Freed buffers are returned to the
system by glibc (large blocks are mmapped), so the figure is the high-water mark, not a sum.
Printed next to it: the size of one float32 copy of the logits [tokens x vocabulary] and the
fall from full to chunked.

It never exhausts the machine: sizes run small to large; the full path's need is predicted in
proportion to tokens from its largest case so far (a 1k-token calibration case first) and a
case that would not fit in the memory available now (less 1.5 GiB) is skipped and said so
(the chunked path's need is bounded by its chunk, not predicted); a watchdog kills any case
whose resident memory passes that budget. Other work on the machine changes timings, not
peaks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]  # this checkout's learner, not an installed one

GiB = 2**30
MARGIN = int(1.5 * GiB)
CALIBRATION = 1024  # tokens: the full path's first case
ROW_TOKENS = 512


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo: what the kernel could give without swapping."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# ----- one case, in its own process ------------------------------------------------------


def run_case(path: str, tokens: int, vocab: int, chunk_tokens: int | None) -> dict:
    """Build, then one forward + backward; the peak RSS it added and its seconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from learner.batch import TrainBatch
    from learner.forward import policy_forward
    from learner.logprobs import default_chunk_tokens
    from learner.packing import register_packed_attention

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=ROW_TOKENS,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = register_packed_attention()
    rows = max(1, tokens // ROW_TOKENS)
    width = min(tokens, ROW_TOKENS)
    ids = torch.randint(1, vocab, (rows, width))
    group = torch.arange(rows) // 4
    prompt = min(64, width // 2)
    ids[:, :prompt] = ids[group * 4, :prompt]
    ones, zeros = torch.ones(rows, width), torch.zeros(rows, width)
    mb = TrainBatch(
        input_ids=ids,
        attention_mask=ones.long(),
        loss_mask=ones,
        old_logprobs=zeros,
        versions=zeros.long(),
        rewards=zeros[:, 0],
        group_index=group,
        baseline_rewards=zeros[:, 0],
        prompt_lengths=torch.full((rows,), prompt),
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    # the chunked path forced (by default small micro-batches take the full one)
    chunk = chunk_tokens or default_chunk_tokens(vocab)
    logp, entropy = policy_forward(
        model, mb, 1.0, True, "shared", chunked=path == "chunked", chunk_tokens=chunk
    )
    logp.sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert entropy is not None and model.lm_head.weight.grad is not None
    return {"extra_peak": peak - before, "seconds": seconds, "targets": rows * (width - 1)}


def measure(
    path: str, tokens: int, vocab: int, chunk_tokens: int | None, threads: int, budget: int
) -> dict:
    """`run_case` in a fresh process under a watchdog that kills it past `budget` bytes."""
    cmd = [sys.executable, __file__, "--case", path, str(tokens), "--vocab", str(vocab)]
    cmd += ["--chunk-tokens", str(chunk_tokens or 0)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    killed = 0
    while proc.poll() is None:
        try:
            rss = rss_bytes(proc.pid)
        except FileNotFoundError:
            break
        if rss > budget:
            proc.kill()
            killed = rss
        time.sleep(0.05)
    out, _ = proc.communicate()
    if killed:
        return {"stopped": f"killed at {killed / GiB:.1f} GiB resident, past the budget"}
    if proc.returncode != 0:
        return {"stopped": f"exit status {proc.returncode}"}
    return json.loads(out.strip().splitlines()[-1])


def _gib(result: dict) -> str:
    if "extra_peak" in result:
        return f"{result['extra_peak'] / GiB:.2f}"
    if "predicted" in result:
        return f"~{result['predicted'] / GiB:.1f} (pred.)"
    return "stopped"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--tokens", default="4096,8192,16384")
    parser.add_argument("--chunk-tokens", type=int, default=0, help="0: learner.logprobs' own")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--case", nargs=2, metavar=("PATH", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    chunk = args.chunk_tokens or None
    if args.case:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.vocab, chunk)))
        return
    sizes = sorted(int(t) for t in args.tokens.split(","))
    print(f"vocabulary {args.vocab}, float32, {args.threads} thread(s), load {os.getloadavg()}")
    results: dict = {}
    for path in ("full", "chunked"):
        per_token = 0.0  # the full path's extra bytes per token, from its largest case so far
        for tokens in sorted({CALIBRATION, *sizes}) if path == "full" else sizes:
            budget = available_bytes() - MARGIN
            need = int(per_token * tokens)
            r: dict
            if need > budget:
                skip = f"skipped: needs ~{need / GiB:.1f} GiB, {budget / GiB:.1f} free"
                r = {"stopped": skip, "predicted": need}
            else:
                r = measure(path, tokens, args.vocab, chunk, args.threads, budget)
            results[f"{path}/{tokens}"] = r
            if path == "full" and "extra_peak" in r:
                per_token = r["extra_peak"] / tokens
            print(path, tokens, r, flush=True)
    print(f"\n{'tokens':>7} {'fp32 logits':>12} {'full':>14} {'chunked':>9} {'fall':>9}  (GiB)")
    for tokens in sizes:
        logits = tokens * args.vocab * 4
        full, chunked = results[f"full/{tokens}"], results[f"chunked/{tokens}"]
        f, c = full.get("extra_peak"), chunked.get("extra_peak")
        fall = f"{(f - c) / GiB:.2f}" if f and c else "-"
        print(f"{tokens:>7} {logits / GiB:>12.2f} {_gib(full):>14} {_gib(chunked):>9} {fall:>9}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
