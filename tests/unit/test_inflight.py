"""In-flight weight updates in the transformers engine (`rollout.weight_update_mode=inflight`):
a version that arrives mid-batch is applied between two decode steps, later tokens carry it,
and every token's log-prob is that of the weights that sampled it (exactly with
`inflight_kv=recompute`; `keep` reuses the old cache and is measurably off)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config import ConfigError, load_config
from asyncrl.config.learner import LearnerConfig
from asyncrl.weights.group import SyncGroup
from asyncrl.weights.layout import specs_of
from asyncrl.weights.sync import WeightBroadcaster
from asyncrl.wire.sockets import free_port
from learner.delivery import delivery_probe
from rollout_servers.engines.base import (
    DeliveryError,
    GenerationOutput,
    SamplingParams,
    SyncTarget,
)
from rollout_servers.engines.hf import HFEngine

SWITCH_AT = 4  # the version lands after this many decode steps of the first rows
JOIN_AT = 2  # late rows join the running loop after this many decode steps
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [3], [20, 21]]
CPU = torch.device("cpu")


class SteppedEngine(HFEngine):
    """Lands the learner's next version at chosen decode steps of the first rows, and holds
    the sampling loop after step `JOIN_AT` until the test queued the rows that join there."""

    deliver = None  # set by the test: starts the next broadcast, returns once the engine has it
    switch_at: tuple[int, ...] = (SWITCH_AT,)
    steps = 0
    joining: tuple[threading.Event, threading.Event] | None = None  # (held, go on)

    def _between_steps(self):
        self.steps += 1
        if self.steps == JOIN_AT and self.joining is not None:
            self.joining[0].set()
            self.joining[1].wait(60)
        if self.steps in self.switch_at and self.deliver is not None:
            self.deliver()
        return super()._between_steps()


def token_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def versions_of(model_path: Path, n: int) -> list[torch.nn.Module]:
    """Version 0 (the checkpoint) and n versions, each a perturbation of the one before."""
    models = [AutoModelForCausalLM.from_pretrained(model_path).eval()]
    for _ in range(n):
        models.append(AutoModelForCausalLM.from_pretrained(model_path).eval())
        with torch.no_grad():
            for p, q in zip(models[-1].parameters(), models[-2].parameters(), strict=True):
                p.copy_(q + torch.randn_like(q) * 0.05)
    return models


@dataclass
class LearnerLink:
    """A learner's side of the weight sync with `engine`, whose receiver runs in a thread as
    the server's does; `errors` holds what the receiver raised."""

    broadcaster: WeightBroadcaster
    receiver: threading.Thread
    errors: list[BaseException]
    sending: list[threading.Thread] = field(default_factory=list)

    def send(self, model, version: int, prober) -> None:
        """Start broadcasting `model` as `version`, with the delivery probe of `prober`."""
        named = list(model.state_dict().items())
        probe = delivery_probe(prober, LearnerConfig(packing=False), "float32", CPU)
        args = (specs_of(named), iter(t for _, t in named), version, probe)
        self.sending.append(
            threading.Thread(target=self.broadcaster.broadcast, args=args, daemon=True)
        )
        self.sending[-1].start()

    async def close(self) -> None:
        if not self.errors:
            for thread in self.sending:  # one broadcast at a time on the group
                await asyncio.to_thread(thread.join, 30)
            await asyncio.to_thread(self.broadcaster.shutdown)
        await asyncio.to_thread(self.receiver.join, 30)


async def link(engine: HFEngine) -> LearnerLink:
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
    return LearnerLink(WeightBroadcaster(group, bucket_bytes=1 << 20), receiver, errors)


async def run_switch(
    model_path: Path,
    mode: str,
    kv: str = "recompute",
    switch_at: tuple[int, ...] = (SWITCH_AT,),
    bad_probe: bool = False,
    late: tuple[list[int], ...] = (),
):
    """Sample PROMPTS (and `late` prompts, which join the running loop after decode step
    JOIN_AT) while versions 1, 2, ... arrive mid-loop at decode steps `switch_at`; the outputs
    (or exceptions) of PROMPTS + late, every version's model and the receiver's errors.
    `bad_probe`: each version carries the probe of the previous version's weights."""
    engine = SteppedEngine(model_path, seed=0, weight_update_mode=mode, inflight_kv=kv)
    engine.switch_at = switch_at
    models = versions_of(model_path, len(switch_at))
    learner = await link(engine)
    sent = iter(range(1, len(models)))

    def deliver():
        version = next(sent)
        learner.send(models[version], version, models[version - 1 if bad_probe else version])
        deadline = time.monotonic() + 30
        while mode == "inflight" and time.monotonic() < deadline:
            incoming = engine._incoming
            if incoming is not None and incoming.version == version:
                return
            time.sleep(0.01)

    engine.deliver = deliver
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    try:
        calls = [asyncio.create_task(engine.generate(p, params)) for p in PROMPTS]
        if late:
            engine.joining = (threading.Event(), threading.Event())
            assert await asyncio.to_thread(engine.joining[0].wait, 60)
            calls += [asyncio.create_task(engine.generate(p, params)) for p in late]
            while len(engine._pending) < len(late):
                await asyncio.sleep(0)
            engine.joining[1].set()
        outs = await asyncio.gather(*calls, return_exceptions=bad_probe)
        deadline = time.monotonic() + 30
        # a version failing its check is already the engine's version before the receiver
        # raises: with bad_probe wait for the receiver's error, else shutdown would wait on a
        # receiver about to stop
        while (
            mode == "inflight"
            and not learner.errors
            and (bad_probe or engine.version != len(switch_at))
        ):
            assert time.monotonic() < deadline, "the version never applied (or never failed)"
            await asyncio.sleep(0.01)
        await learner.close()
    finally:
        await engine.close()
    return outs, models, learner.errors


def errors_by_version(outs, models, prompts=PROMPTS) -> dict[int, float]:
    """Largest |recorded - recomputed| log-prob over the tokens of each version, each token
    recomputed by the weights of the version it is tagged with."""
    worst = dict.fromkeys(range(len(models)), 0.0)
    for prompt, out in zip(prompts, outs, strict=True):
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


async def test_recompute_is_exact_for_rows_that_joined_at_different_steps(model_path):
    """Rows that joined the running loop later have sampled fewer tokens when the version
    lands: the rebuilt cache holds each row's own prompt and tokens, left-padded."""
    late = ([30, 31, 32, 33, 34, 35, 36], [8])
    outs, models, _ = await run_switch(model_path, "inflight", "recompute", late=late)
    old = SWITCH_AT - JOIN_AT  # tokens a late row sampled before the version landed
    for o in outs[len(PROMPTS) :]:
        assert o.versions == [0] * old + [1] * (len(o.token_ids) - old), o.versions
    for o in outs[: len(PROMPTS)]:
        assert o.versions[: SWITCH_AT + 1] == [0] * SWITCH_AT + [1], o.versions
    assert max(errors_by_version(outs, models, [*PROMPTS, *late]).values()) < 1e-5


async def test_keep_reuses_the_old_cache_and_is_not_exact(model_path):
    outs, models, _ = await run_switch(model_path, "inflight", "keep")
    assert any(len(set(o.versions)) == 2 for o in outs)
    worst = errors_by_version(outs, models)
    assert worst[0] < 1e-5  # before the switch nothing changed
    assert worst[1] > 1e-4, worst  # after it, the old version's keys and values still count


async def test_drain_applies_only_with_no_row_in_flight(model_path):
    outs, _, _ = await run_switch(model_path, "drain")
    assert all(o.versions == [0] * len(o.token_ids) for o in outs)


class CountingEngine(HFEngine):
    """Counts the rows that joined the running loop while a version waited."""

    joined_while_waiting = 0

    def _admit(self, batch, loop):
        waiting = self._version_waiting()  # only the sampling loop, holding the lock, applies
        joined = super()._admit(batch, loop)
        self.joined_while_waiting += joined if waiting else 0
        return joined


async def test_drain_is_not_starved_by_a_steady_stream_of_requests(model_path):
    """Drain mode with requests always queued (16 callers, 4 slots): the sampling loop never
    runs out of work, yet a version that arrives is applied once the rows in flight finish,
    because no new row joins while it waits. No response mixes versions, and each one's
    log-probs are those of its version."""
    engine = CountingEngine(model_path, seed=0, max_batch_size=4, weight_update_mode="drain")
    models = versions_of(model_path, 1)
    learner = await link(engine)
    done: list[tuple[list[int], GenerationOutput]] = []
    stop = asyncio.Event()

    async def caller(i: int) -> None:
        while not stop.is_set():  # lengths differ, so rows never all finish together
            n = len(done)
            params = SamplingParams(max_new_tokens=3 + (5 * i + n) % 11, ignore_eos=True)
            prompt = [3 + (i + n) % 50, 7]
            done.append((prompt, await engine.generate(prompt, params)))

    async def until(condition, what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    callers = [asyncio.create_task(caller(i)) for i in range(16)]
    try:
        await until(lambda: len(done) >= 8, "no response")
        learner.send(models[1], 1, models[1])
        await until(lambda: engine.version == 1, "the version was never applied")
        applied_at = len(done)
        await until(lambda: len(done) >= applied_at + 8, "no response after the version")
    finally:
        stop.set()
        await asyncio.gather(*callers)
        await learner.close()
        await engine.close()
    assert not learner.errors and engine.joined_while_waiting == 0
    assert all(len(set(o.versions)) == 1 for _, o in done)
    assert {o.version for _, o in done} == {0, 1}
    prompts, outs = [p for p, _ in done], [o for _, o in done]
    assert max(errors_by_version(outs, models, prompts).values()) < 1e-5


async def test_a_version_failing_its_delivery_check_mid_loop_fails_the_live_rows(model_path):
    """Nothing sampled after a failed check reaches a caller: every live row (those that joined
    mid-loop too) fails with DeliveryError (the weights are not the version's), and the
    receiver raises it too."""
    outs, _, errors = await run_switch(model_path, "inflight", bad_probe=True, late=([8],))
    assert all(isinstance(o, DeliveryError) for o in outs), outs
    assert len(errors) == 1 and isinstance(errors[0], DeliveryError)
    assert "version 1" in str(errors[0])


def test_vllm_updates_in_flight_only_exactly():
    inflight = ["rollout.weight_update_mode=inflight", "rollout.engine=vllm"]
    assert load_config(None, inflight).rollout.inflight_kv == "recompute"
    with pytest.raises(ConfigError, match="inflight_kv=keep with rollout.engine=vllm"):
        load_config(None, [*inflight, "rollout.inflight_kv=keep"])
