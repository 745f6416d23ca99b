"""Tokens/s of the learner's forward + backward, chunked log-probs against the full-logits path,
side by side in one process (`learner.logprobs`; issue 28: packed tokens/s not below before).

    python tools/bench_logprob_speed.py [--layers 4] [--tokens 2048] [--reps 3] [--threads 2]
                                        [--dtype float32|bfloat16]

A random Llama of SmolLM2-135M's shape (576 hidden, 49,152 vocabulary; `--layers` of its 30)
and one packed micro-batch of `--tokens` tokens (rows of 512, groups of 4 sharing a 64-token
prompt: the learner's default "shared" layout) run `policy_forward` (entropy as a statistic)
and the backward of a loss over every target token, alternating the two paths `--reps` times
each, so load on the machine falls on both alike. Prints each path's median seconds and real
tokens/s, and chunked / full. Everything but the log-probs (model, attention, packing) is the
same code on both sides (the chunked path forced: by default a micro-batch whose logits are as
small as these takes the full one, `learner.forward.WHOLE_LOGITS_MAX_BYTES`). bfloat16 runs the
forward under autocast, as a bf16 learner computes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]  # this checkout's learner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from learner.batch import TrainBatch
    from learner.forward import policy_forward
    from learner.logprobs import default_chunk_tokens
    from learner.packing import register_packed_attention

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=args.layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = register_packed_attention()
    rows, width = max(1, args.tokens // 512), min(args.tokens, 512)
    ids = torch.randint(1, config.vocab_size, (rows, width))
    group = torch.arange(rows) // 4
    ids[:, :64] = ids[group * 4, :64]
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
        prompt_lengths=torch.full((rows,), 64),
    )
    bf16 = args.dtype == "bfloat16"

    def step(chunked: bool) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            chunk = default_chunk_tokens(config.vocab_size) if chunked else None  # forced
            logp, _ = policy_forward(model, mb, 1.0, True, "shared", chunked, chunk_tokens=chunk)
        logp.sum().backward()
        return time.perf_counter() - start

    step(True), step(False)  # warm-up: allocator, kernels
    times: dict[str, list[float]] = {"full": [], "chunked": []}
    for _ in range(args.reps):
        times["full"].append(step(False))
        times["chunked"].append(step(True))
    real = rows * width
    print(
        f"model: random SmolLM2 shape, {args.layers} layers, vocab {config.vocab_size}; "
        f"{real} tokens ({rows} rows of {width}, shared prompts), {args.dtype}, "
        f"{args.threads} threads, {args.reps} alternated reps"
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, seconds in med.items():
        print(f"  {name:8s} median {seconds:7.2f} s  {real / seconds:8.1f} tokens/s  {times[name]}")
    print(f"  chunked / full tokens/s: {med['full'] / med['chunked']:.2f}x")


if __name__ == "__main__":
    main()
