"""In-flight weight updates in the transformers engine (`rollout.weight_update_mode=inflight`):
a version that arrives mid-batch is applied between two decode steps, later tokens carry it,
and every token's log-prob is that of the weights that sampled it (exactly with
`inflight_kv=recompute`; `keep` reuses the old cache and is measurably off)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config import ConfigError, load_config
from asyncrl.demo.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer
from asyncrl.learner_config import LearnerConfig
from asyncrl.transport import free_port
from asyncrl.weight_sync import SyncGroup, WeightBroadcaster, specs_of
from learner.delivery import delivery_probe
from rollout_servers.engines.base import DeliveryError, SamplingParams, SyncTarget
from rollout_servers.engines.hf import HFEngine

SWITCH_AT = 4  # the version lands after this many decode steps of the first batch
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [3], [20, 21]]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    tokenizer = build_tokenizer()
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(tokenizer, TinyModelSpec(), seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class SteppedEngine(HFEngine):
    """Lands the learner's next version at chosen decode steps of the first batch."""

    deliver = None  # set by the test: starts the next broadcast, returns once the engine has it
    switch_at: tuple[int, ...] = (SWITCH_AT,)
    steps = 0

    def _between_steps(self):
        self.steps += 1
        if self.steps in self.switch_at and self.deliver is not None:
            self.deliver()
        return super()._between_steps()


def token_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


async def run_switch(
    model_path: Path,
    mode: str,
    kv: str = "recompute",
    switch_at: tuple[int, ...] = (SWITCH_AT,),
    bad_probe: bool = False,
):
    """Sample PROMPTS while versions 1, 2, ... arrive mid-batch at decode steps `switch_at`;
    the outputs (or exceptions), every version's model and the receiver's errors.
    `bad_probe`: each version carries the probe of the previous version's weights."""
    engine = SteppedEngine(model_path, seed=0, weight_update_mode=mode, inflight_kv=kv)
    engine.switch_at = switch_at
    models = [AutoModelForCausalLM.from_pretrained(model_path).eval()]
    for _ in switch_at:
        models.append(AutoModelForCausalLM.from_pretrained(model_path).eval())
        with torch.no_grad():
            for p, q in zip(models[-1].parameters(), models[-2].parameters(), strict=True):
                p.copy_(q + torch.randn_like(q) * 0.05)
    port = free_port("127.0.0.1")

    errors: list[BaseException] = []

    def server_side():
        target = SyncTarget("127.0.0.1", port, 1, 2, torch.device("cpu"), timeout_s=60)
        try:
            list(engine.follow_learner(target))
        except BaseException as e:  # the server's main loop would stop on it
            errors.append(e)

    receiver = threading.Thread(target=server_side, daemon=True)
    receiver.start()
    group = await asyncio.to_thread(SyncGroup, "127.0.0.1", port, 0, 2, torch.device("cpu"), 60.0)
    broadcaster = WeightBroadcaster(group, bucket_bytes=1 << 20)
    sent = iter(range(1, len(models)))
    sending: list[threading.Thread] = []

    def deliver():
        version = next(sent)
        named = list(models[version].state_dict().items())
        prober = models[version - 1] if bad_probe else models[version]
        probe = delivery_probe(prober, LearnerConfig(packing=False), "float32", CPU)
        args = (specs_of(named), iter(t for _, t in named), version, probe)
        sending.append(threading.Thread(target=broadcaster.broadcast, args=args, daemon=True))
        sending[-1].start()
        deadline = time.monotonic() + 30
        while mode == "inflight" and time.monotonic() < deadline:
            incoming = engine._incoming
            if incoming is not None and incoming.version == version:
                return
            time.sleep(0.01)

    engine.deliver = deliver
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    try:
        calls = (engine.generate(p, params) for p in PROMPTS)
        outs = await asyncio.gather(*calls, return_exceptions=bad_probe)
        deadline = time.monotonic() + 30
        # a version failing its check is already the engine's version before the receiver
        # raises: with bad_probe wait for the receiver's error, else shutdown would wait on a
        # receiver about to stop
        while mode == "inflight" and not errors and (bad_probe or engine.version != len(switch_at)):
            assert time.monotonic() < deadline, "the version never applied (or never failed)"
            await asyncio.sleep(0.01)
        if errors:
            await asyncio.to_thread(receiver.join, 30)
            return outs, models, errors
        for thread in sending:  # one broadcast at a time on the group
            await asyncio.to_thread(thread.join, 30)
        await asyncio.to_thread(broadcaster.shutdown)
        await asyncio.to_thread(receiver.join, 30)
    finally:
        await engine.close()
    return outs, models, errors


def errors_by_version(outs, models) -> dict[int, float]:
    """Largest |recorded - recomputed| log-prob over the tokens of each version, each token
    recomputed by the weights of the version it is tagged with."""
    worst = dict.fromkeys(range(len(models)), 0.0)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        lps = [token_logprobs(m, prompt, out.token_ids) for m in models]
        for i, v in enumerate(out.versions):
            worst[v] = max(worst[v], abs(out.logprobs[i] - float(lps[v][i])))
    return worst


async def test_a_version_lands_between_decode_steps_and_recompute_is_exact(model_path):
    outs, models, _ = await run_switch(model_path, "inflight", "recompute")
    spanning = [o for o in outs if len(set(o.versions)) == 2]
    assert spanning, [o.versions for o in outs]
    for o in spanning:  # versions only go up, and switch exactly where the version landed
        assert o.versions == [0] * SWITCH_AT + [1] * (len(o.token_ids) - SWITCH_AT)
        assert o.version == 0  # the oldest token's, which staleness is judged by
    worst = errors_by_version(outs, models)
    assert worst[0] < 1e-5 and worst[1] < 1e-5, worst


async def test_two_versions_land_in_one_batch(model_path):
    """The receiver goes back to receiving once the batch took a version: a second version can
    land in the same batch, without waiting for it to end."""
    outs, models, _ = await run_switch(model_path, "inflight", switch_at=(3, 7))
    longest = max(outs, key=lambda o: len(o.token_ids))
    assert len(longest.token_ids) > 7, [len(o.token_ids) for o in outs]
    assert longest.versions[:8] == [0, 0, 0, 1, 1, 1, 1, 2]
    assert all(o.versions == sorted(o.versions) for o in outs)  # versions only go up
    assert max(errors_by_version(outs, models).values()) < 1e-5


async def test_keep_reuses_the_old_cache_and_is_not_exact(model_path):
    outs, models, _ = await run_switch(model_path, "inflight", "keep")
    assert any(len(set(o.versions)) == 2 for o in outs)
    worst = errors_by_version(outs, models)
    assert worst[0] < 1e-5  # before the switch nothing changed
    assert worst[1] > 1e-4, worst  # after it, the old version's keys and values still count


async def test_drain_applies_only_between_batches(model_path):
    outs, _, _ = await run_switch(model_path, "drain")
    assert all(o.versions == [0] * len(o.token_ids) for o in outs)


async def test_a_version_failing_its_delivery_check_mid_batch_fails_the_batch(model_path):
    """Nothing sampled after a failed check reaches a caller: the batch in flight fails with
    DeliveryError (the weights are not the version's), and the receiver raises it too."""
    outs, _, errors = await run_switch(model_path, "inflight", bad_probe=True)
    assert all(isinstance(o, DeliveryError) for o in outs), outs
    assert len(errors) == 1 and isinstance(errors[0], DeliveryError)
    assert "version 1" in str(errors[0])


def test_inflight_is_refused_for_vllm_until_built():
    assert load_config(None, ["rollout.weight_update_mode=inflight"]).rollout.inflight_kv == (
        "recompute"
    )
    with pytest.raises(ConfigError, match="only the hf engine updates weights in flight"):
        load_config(None, ["rollout.weight_update_mode=inflight", "rollout.engine=vllm"])
