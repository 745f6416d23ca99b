"""Log-prob parity of the vLLM engine with the learner on a real pretrained model (SmolLM2-135M-
Instruct, imported from its GGUF), after a weight sync, in float32.

The learner recomputes each sampled token's log-prob with one full-sequence forward of its own
(transformers) model; vLLM computed it while sampling, with its own kernels and KV cache. The
mean absolute difference must be at most 1e-3 (the issue's bound) for a full sync, 1e-4 for a
LoRA sync (the LoRA issue's bound); the figures, sync bytes and seconds are printed. The case
is shared with SGLang (engine_cases.py).
"""

from __future__ import annotations

import pytest
from engine_cases import check_smollm2_parity, closed_after

from asyncrl.config import VLLMConfig
from asyncrl.config.learner import LoraConfig
from rollout_servers.engines.vllm import VLLMEngine

pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.mark.parametrize("lora", [None, LoraConfig(rank=16, alpha=32.0)], ids=["full", "lora16"])
async def test_smollm2_logprob_parity_after_sync(smollm2_dir, lora):
    engine = VLLMEngine(smollm2_dir, VLLMConfig(cpu_kvcache_space_gib=1), seed=0, lora=lora)
    async with closed_after(engine):
        await check_smollm2_parity(engine, smollm2_dir, lora, questions=8, samples_each=1)
