"""The SGLang engine for real (SGLang's CPU engine here, tools/install_sglang_cpu.sh), on the
tiny model: generation, weight versions from the learner's broadcaster, the version gate, the
delivery check and in-flight versions (the cases shared with vLLM: engine_cases.py), and the
sampling parameters SGLang refuses.

Run by the SGLang step of .ci/run (`-m sglang`); the default test command deselects them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_cases import (
    PROMPT,
    check_delivery_check_stops_the_engine,
    check_follows_two_broadcast_versions,
    check_inflight_versions,
    check_sampling_parameters,
    closed_after,
    save_tiny_model,
)

from asyncrl.config import SGLangConfig
from rollout_servers.engines.base import SamplingParams
from rollout_servers.engines.sglang import SGLangEngine

pytestmark = [pytest.mark.integration, pytest.mark.sglang]

OPTIONS = SGLangConfig(max_total_tokens=8192)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


async def test_engine_follows_two_broadcast_versions(model_path):
    async with closed_after(SGLangEngine(model_path, OPTIONS, seed=0)) as engine:
        await check_follows_two_broadcast_versions(engine, model_path)


async def test_engine_maps_sampling_parameters(model_path):
    async with closed_after(SGLangEngine(model_path, OPTIONS, seed=1)) as engine:
        await check_sampling_parameters(engine)
        # SGLang returns the untruncated softmax's log-probs: top-p would break the invariant
        with pytest.raises(ValueError, match="top_p"):
            await engine.generate(PROMPT, SamplingParams(top_p=0.9))


async def test_delivery_check_stops_an_engine_whose_weights_are_not_the_version(model_path):
    async with closed_after(SGLangEngine(model_path, OPTIONS, seed=3)) as engine:
        await check_delivery_check_stops_the_engine(engine, model_path)


async def test_inflight_versions_land_mid_request_and_every_token_is_its_versions(model_path):
    inflight = SGLangEngine(model_path, OPTIONS, seed=4, weight_update_mode="inflight")
    async with closed_after(inflight) as engine:
        await check_inflight_versions(engine, model_path, requests=16, head_start_s=0.3)
