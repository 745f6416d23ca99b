"""The SGLang engine for real (SGLang's CPU engine here, tools/install_sglang_cpu.sh), on the
tiny model: generation, weight versions from the learner's broadcaster, the version gate and
the delivery check.

Run by the SGLang step of .ci/run (`-m sglang`); the default test command deselects them.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config import SGLangConfig
from asyncrl.demo.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer
from asyncrl.learner_config import LearnerConfig
from asyncrl.transport import free_port
from asyncrl.weight_sync import SyncGroup, WeightBroadcaster, specs_of
from learner.delivery import delivery_probe
from rollout_servers.engines.base import DeliveryError, SamplingParams, SyncTarget
from rollout_servers.engines.sglang import SGLangEngine

pytestmark = [pytest.mark.integration, pytest.mark.sglang]

PROMPT = [1, 5, 6, 7, 8, 9, 10, 11]
OPTIONS = SGLangConfig(max_total_tokens=8192)
PADDED = LearnerConfig(packing=False)  # the learner's forward on a plain (unregistered) model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    """The embedded tiny Llama (head_dim 32), random weights."""
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelSpec(), seed=0)
    out = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def learner_logprobs(model, prompt: list[int], tokens: list[int], t: float = 1.0) -> torch.Tensor:
    """What the learner recomputes: log_softmax(logits / T) of one full-sequence forward."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / t
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def perturbed(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


async def sample(engine, n: int, max_new: int = 12, temperature: float = 1.0):
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new)
    return await asyncio.gather(*(engine.generate(PROMPT, params) for _ in range(n)))


def max_logprob_error(learner, outputs, t: float = 1.0) -> float:
    return max(
        (learner_logprobs(learner, PROMPT, o.token_ids, t) - torch.tensor(o.logprobs))
        .abs()
        .max()
        .item()
        for o in outputs
    )


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


async def test_engine_follows_two_broadcast_versions(model_path):
    """Generation at version 0, then two versions from the learner's broadcaster (with the
    delivery probe): after each, every sampled token's log-prob is the learner's within 1e-4
    (float32), and requests in flight while a version arrives finish on, and carry, the old
    version."""
    engine = SGLangEngine(model_path, OPTIONS, seed=0)
    learner = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    worst = []
    try:
        broadcaster, receiver, applied, errors = await joined(engine, 64 * 1024)  # many buckets
        specs = specs_of(learner.state_dict().items())

        outs = await sample(engine, 8)
        assert all(o.version == 0 for o in outs)
        worst.append(max_logprob_error(learner, outs))
        greedy = await sample(engine, 2, temperature=0.0)  # greedy: the T = 1 softmax
        assert greedy[0].token_ids == greedy[1].token_ids
        worst.append(max_logprob_error(learner, greedy))
        cool = await sample(engine, 4, temperature=0.7)
        worst.append(max_logprob_error(learner, cool, t=0.7))

        for version in (1, 2):
            perturbed(learner, seed=version)
            tensors = iter(t for _, t in learner.state_dict().items())
            probe = delivery_probe(learner, PADDED, "float32", torch.device("cpu"))
            # requests in flight while the version arrives finish on the old version
            in_flight = asyncio.ensure_future(sample(engine, 4, max_new=48))
            while engine._inflight < 4:
                await asyncio.sleep(0.005)
            await asyncio.to_thread(broadcaster.broadcast, specs, tensors, version, probe)
            while engine.version != version and not errors:
                await asyncio.sleep(0.05)
            assert not errors, errors
            old = await in_flight
            assert all(o.version == version - 1 and o.versions[-1] == version - 1 for o in old)

            outs = await sample(engine, 8)
            assert all(o.version == version for o in outs)
            worst.append(max_logprob_error(learner, outs))
            assert worst[-1] < 1e-4, f"version {version}: {worst[-1]}"

        await asyncio.to_thread(broadcaster.shutdown)
        receiver.join(timeout=30)
        assert [a.version for a in applied] == [1, 2] and not errors
        assert not receiver.is_alive()
    finally:
        await engine.close()
    print(f"max |engine - learner| log-prob per check: {[f'{w:.2e}' for w in worst]}")
    assert max(worst) < 1e-4, worst


async def test_engine_maps_sampling_parameters(model_path):
    engine = SGLangEngine(model_path, OPTIONS, seed=1)
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
        # ignore_eos samples exactly max_new_tokens
        long = SamplingParams(max_new_tokens=40, ignore_eos=True)
        assert len((await engine.generate(PROMPT, long)).token_ids) == 40
        with pytest.raises(ValueError, match="prompt_ids"):
            await engine.generate([], params)
        with pytest.raises(ValueError, match="top_p"):
            await engine.generate(PROMPT, SamplingParams(top_p=0.9))
    finally:
        await engine.close()


async def test_delivery_check_stops_an_engine_whose_weights_are_not_the_version(model_path):
    """The version's probe comes from other weights than the ones sent, as the learner's would
    when the engine's load never reached the weights it samples with: the engine raises
    DeliveryError naming the version, and the gate stays closed on the old version."""
    engine = SGLangEngine(model_path, OPTIONS, seed=3)
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
        ids = list(range(3, 19))
        mine = engine.probe_logprobs(ids)
        assert (mine - learner_logprobs(sent, ids[:1], ids[1:])).abs().max() < 1e-4
    finally:
        await engine.close()


async def test_inflight_versions_land_mid_request_and_every_token_is_its_versions(model_path):
    """`weight_update_mode=inflight`: a version arriving while requests run aborts them and
    resumes them under the new weights, prefix recomputed. Each token's recorded version is
    the version whose weights give its recorded log-prob (≤1e-4, a full forward of prompt and
    tokens), and some responses span two versions."""
    engine = SGLangEngine(model_path, OPTIONS, seed=4, weight_update_mode="inflight")
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
            running = [asyncio.ensure_future(engine.generate(PROMPT, params)) for _ in range(16)]
            while engine._inflight < len(running):  # all admitted under the old version
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.3)  # some tokens sampled, far from all
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
    print(
        f"in flight: {len(spanning)}/{len(outs)} responses span two versions; max error {worst:.2e}"
    )
    assert worst < 1e-4, worst
