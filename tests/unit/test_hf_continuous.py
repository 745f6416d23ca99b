"""Continuous batching in the transformers engine: requests join the running sampling loop
between decode steps, each caller gets its response as soon as its row finishes, slots freed by
finished rows are refilled (at most max_batch_size live rows), and a row's log-probs are those
of an unpadded forward whatever rows it shared the batch with.

Steps are driven by a hook between decode steps (`_between_steps`) that can hold the sampling
loop until the test has queued what it wants, so nothing here depends on timing: a deadline
only bounds how long a broken engine makes a test wait before it fails."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from rollout_servers.engines.base import GenerationOutput, SamplingParams
from rollout_servers.engines.hf import HFEngine
from rollout_servers.engines.hf_sampling import LiveBatch

DEADLINE_S = 60.0


class Pause:
    """Holds the sampling loop after decode step `at` until `resume` (or the deadline)."""

    def __init__(self, at: int):
        self.at, self.reached, self.resume = at, threading.Event(), threading.Event()

    def __call__(self, step: int) -> None:
        if step == self.at:
            self.reached.set()
            self.resume.wait(DEADLINE_S)


class HookedEngine(HFEngine):
    """Counts decode steps, records the most rows live at once, and runs the pauses."""

    pauses: tuple[Pause, ...] = ()
    steps = 0
    peak_rows = 0

    def _between_steps(self):
        self.steps += 1
        self.peak_rows = max(self.peak_rows, self.live_rows)
        for pause in self.pauses:
            pause(self.steps)
        return super()._between_steps()


def exact(n: int) -> SamplingParams:
    """Temperature 1, exactly n tokens (a random model may sample EOS)."""
    return SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True)


async def join_at(
    engine: HFEngine, pause: Pause, requests: list[tuple[list[int], SamplingParams]]
) -> list[asyncio.Task[GenerationOutput]]:
    """Queue `requests` while the loop is held at `pause`, then let it go on: they join at the
    next admission, between that step and the next."""
    assert await asyncio.to_thread(pause.reached.wait, DEADLINE_S), "the loop never got there"
    queued = len(engine._pending)
    tasks = [asyncio.create_task(engine.generate(p, sp)) for p, sp in requests]
    while len(engine._pending) < queued + len(requests):
        await asyncio.sleep(0)
    pause.resume.set()
    return tasks


def unpadded_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


async def test_a_request_arriving_mid_loop_joins_it_and_finishes_first(model_path):
    engine = HookedEngine(model_path, seed=0)
    periods: list[tuple[int, int]] = []
    engine.on_batch = lambda start, seconds, n, version: periods.append((n, version))
    arrive, hold = Pause(3), Pause(20)
    engine.pauses = (arrive, hold)
    long = asyncio.create_task(engine.generate([5, 6, 7], exact(40)))
    (short,) = await join_at(engine, arrive, [([9, 10], exact(3))])
    # the loop is held at step 20, the long row 20 tokens short of its end
    out = await asyncio.wait_for(short, DEADLINE_S)
    assert not long.done()
    hold.resume.set()
    assert len((await long).token_ids) == 40 and len(out.token_ids) == 3
    await engine.close()  # the loop reports its busy period as it stops
    assert engine.batches_run == 1 and periods == [(2, 0)]  # the short request joined it
    assert engine.busy_s > 0


async def test_a_row_whose_caller_gave_up_leaves_the_loop(model_path):
    engine = HookedEngine(model_path, seed=0)
    hold = Pause(5)
    engine.pauses = (hold,)
    task = asyncio.create_task(engine.generate([5, 6], exact(1000)))
    assert await asyncio.to_thread(hold.reached.wait, DEADLINE_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    hold.resume.set()
    await asyncio.wait_for(engine.close(), DEADLINE_S)
    assert engine.steps == 5  # dropped at the next step, no forward for it


async def test_early_rows_return_before_the_long_row_ends(model_path):
    engine = HookedEngine(model_path, seed=0)
    hold = Pause(10)
    engine.pauses = (hold,)
    long = asyncio.create_task(engine.generate([5, 6, 7], exact(30)))
    short = asyncio.create_task(engine.generate([3], exact(2)))
    out = await asyncio.wait_for(short, DEADLINE_S)  # while the loop is held at step 10
    assert not long.done() and len(out.token_ids) == 2
    hold.resume.set()
    assert len((await long).token_ids) == 30
    await engine.close()


async def test_rows_admitted_mid_loop_have_the_logprobs_of_an_unpadded_forward(model_path):
    """Rows join with prompts shorter and longer than the running cache (either side is
    left-padded), and after rows with long prompts left (their padding columns trimmed); each
    row's log-probs equal a forward of that row alone."""
    engine = HookedEngine(model_path, seed=0)
    second, third = Pause(4), Pause(12)
    engine.pauses = (second, third)
    waves = [
        [(list(range(3, 43)), exact(8)), ([7, 8], exact(30))],
        [(list(range(10, 20)), exact(20)), (list(range(40, 100)), exact(6)), ([4], exact(3))],
        [([11, 12, 13], exact(10)), (list(range(20, 45)), exact(5))],
    ]
    tasks = [asyncio.create_task(engine.generate(p, sp)) for p, sp in waves[0]]
    tasks += await join_at(engine, second, waves[1])
    tasks += await join_at(engine, third, waves[2])
    outs = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
    await engine.close()
    assert engine.batches_run == 1  # every wave joined the running loop
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    requests = [r for wave in waves for r in wave]
    for (prompt, params), out in zip(requests, outs, strict=True):
        assert len(out.token_ids) == params.max_new_tokens
        expected = unpadded_logprobs(model, prompt, out.token_ids)
        assert (torch.tensor(out.logprobs) - expected).abs().max().item() < 1e-5


async def test_max_batch_size_is_respected_and_freed_slots_are_refilled(model_path):
    """One 12-token row and eight 2-token rows through 3 slots: the short rows flow through the
    two other slots while the long one runs, so all end with it after 12 steps (static batches
    of 3 would take 12 + 2 + 2)."""
    engine = HookedEngine(model_path, seed=0, max_batch_size=3)
    requests = [([5, 6], exact(12))] + [([i, i + 1], exact(2)) for i in range(8)]
    outs = await asyncio.gather(*(engine.generate(p, sp) for p, sp in requests))
    await engine.close()
    assert [len(o.token_ids) for o in outs] == [sp.max_new_tokens for _, sp in requests]
    assert engine.peak_rows == 3
    assert engine.steps == 11  # hooks run between steps: 12 steps


def test_padding_columns_leave_with_the_rows_that_needed_them(model_path):
    """After the row with the long prompt finishes, the cache shrinks to the live row's own
    length: it never grows with the rows that came and went."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    batch = LiveBatch(model, frozenset(), 0, torch.Generator().manual_seed(0))
    with torch.inference_mode():
        batch.admit([(list(range(3, 43)), exact(2), None), ([5], exact(6), None)])
        assert len(batch.cohorts) == 1 and batch.cohorts[0].mask.shape[1] == 40
        batch.sample(0)
        batch.advance()
        finished = batch.sample(0)  # the long-prompt row's second and last token
        assert len(finished) == 1 and len(batch) == 1
        cohort = batch.cohorts[0]
        assert cohort.mask.shape[1] == 2  # the short row: its prompt and first token
        assert cohort.cache.layers[0].keys.shape[-2] == 2
        batch.advance()
        assert cohort.mask.shape[1] == 3 and bool(cohort.mask.all())


def test_sliding_window_caches_are_not_merged():
    """A sliding-window cache cannot be left-padded and merged: rows join an empty batch only
    (the model batches statically, as before continuous batching)."""
    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    )
    batch = LiveBatch(MistralForCausalLM(config).eval(), frozenset(), 0, torch.Generator())
    assert not batch.merges and batch.can_admit()
    with torch.inference_mode():
        batch.admit([([1, 2, 3], exact(4), None)])
        assert not batch.can_admit()
        batch.sample(0)
        batch.advance()
        assert not batch.can_admit()


def test_prefill_chunks_long_tailed_lengths_and_stays_exact(model_path, monkeypatch):
    """Rows of very different lengths (a recompute after an in-flight version, or prompts
    admitted together) are prefilled in chunks of similar length: the compute spent on padding
    stays within PAD_WASTE of the real tokens, and each row's logits equal an unpadded
    forward's."""
    from rollout_servers.engines import hf_sampling

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    seqs = [[5 + k % 20 for k in range(n)] for n in (3, 120, 4, 110, 2, 60)]
    shapes = []
    forward = hf_sampling.forward_whole

    def counting(model, ids, mask):
        shapes.append(tuple(ids.shape))
        return forward(model, ids, mask)

    monkeypatch.setattr(hf_sampling, "forward_whole", counting)
    with torch.no_grad():
        chunks = hf_sampling._prefill(model, seqs, 0, torch.device("cpu"))
    order = [i for indices, _ in chunks for i in indices]
    assert sorted(order) == list(range(len(seqs))) and len(shapes) > 1
    real = sum(len(s) for s in seqs)
    assert sum(r * w for r, w in shapes) <= (1 + hf_sampling.PAD_WASTE) * real, shapes
    for indices, (logits, _, mask) in chunks:
        for j, i in enumerate(indices):
            assert int(mask[j].sum()) == len(seqs[i])
            with torch.no_grad():
                alone = model(torch.tensor([seqs[i]])).logits[0, -1].float()
            assert (logits[j] - alone).abs().max() < 1e-5


async def test_generate_after_close_raises(model_path):
    engine = HFEngine(model_path)
    await engine.generate([5, 6], SamplingParams(max_new_tokens=2))
    await engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(engine.generate([5, 6], SamplingParams(max_new_tokens=2)), 10)


async def test_a_version_whose_copy_fails_midway_fails_every_later_request(model_path):
    """A copy that fails after the checks passed (a device fault; a meta tensor here: same
    shape and dtype, no data) leaves the first tensors of the new version in the model: the
    engine must not sample from that mix, now or later."""
    from rollout_servers.engines.base import DeliveryError

    engine = HFEngine(model_path)
    try:
        weights = [(n, t.clone() + 1) for n, t in engine.named_weights()]
        weights[1] = (weights[1][0], torch.empty_like(weights[1][1], device="meta"))
        with pytest.raises(DeliveryError, match="version 1 was applied only in part"):
            engine.update_weights(weights, version=1)
        for _ in range(2):
            with pytest.raises(DeliveryError, match="applied only in part"):
                await asyncio.wait_for(engine.generate([5, 6], exact(2)), DEADLINE_S)
    finally:
        await engine.close()


def test_short_rows_joining_a_long_one_get_a_cohort_of_their_own(model_path):
    """Short rows joining a batch that holds one long row would each attend over its padding at
    every step: they form a cohort of their own (one forward each per step), and every row's
    log-probs still equal an unpadded forward's."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    batch = LiveBatch(model, frozenset(), 0, torch.Generator().manual_seed(0))
    long_prompt = [5 + k % 40 for k in range(150)]
    shorts = [[3 + i, 4 + i, 5 + i] for i in range(8)]
    done = []
    with torch.inference_mode():
        batch.admit([(long_prompt, exact(20), "long")])
        for _ in range(2):
            done += batch.sample(0)
            batch.advance()
        batch.admit([(p, exact(10), f"short{i}") for i, p in enumerate(shorts)])
        assert len(batch.cohorts) == 2
        assert [len(c.rows) for c in batch.cohorts] == [1, 8]
        assert batch.cohorts[1].mask.shape[1] == 3  # not padded to the long row's 152
        while batch:
            done += batch.sample(0)
            if batch:
                batch.advance()
    prompts = {"long": long_prompt} | {f"short{i}": p for i, p in enumerate(shorts)}
    assert sorted(r.owner for r in done) == sorted(prompts)
    for row in done:
        expected = unpadded_logprobs(model, prompts[row.owner], row.tokens)
        assert (torch.tensor(row.logprobs) - expected).abs().max().item() < 1e-5


def test_cohorts_are_capped_and_rows_beyond_join_the_cheapest(model_path):
    from rollout_servers.engines.hf_sampling import MAX_COHORTS

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    batch = LiveBatch(model, frozenset(), 0, torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for wave, length in enumerate((2, 40, 90, 160, 250)):
            batch.admit([([3 + (k % 30) for k in range(length)], exact(2), wave)] * 30)
            assert len(batch.cohorts) == min(wave + 1, MAX_COHORTS)
    widths = sorted(c.mask.shape[1] for c in batch.cohorts)
    assert widths[-1] == 250 and len(batch) == 150


def test_decode_steps_append_to_the_cache_in_place(model_path):
    """A decode step writes its token into the cache's spare room (`GrowingLayer`) instead of
    copying the whole cache, and rows leaving, trims and merges keep the contents exact."""
    from rollout_servers.engines.hf_kv_cache import GrowingLayer

    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    batch = LiveBatch(model, frozenset(), 0, torch.Generator().manual_seed(0))
    prompts = {"a": [5, 6, 7], "b": list(range(3, 30))}
    done = []
    with torch.inference_mode():
        batch.admit([(prompts["a"], exact(12), "a"), (prompts["b"], exact(4), "b")])
        batch.sample(0)
        batch.advance()
        layer = batch.cohorts[0].cache.layers[0]
        assert isinstance(layer, GrowingLayer)
        buffer = layer._keys_buf.data_ptr()
        for _ in range(2):
            done += batch.sample(0)
            batch.advance()
        assert layer._keys_buf.data_ptr() == buffer  # no new buffer: written in place
        while batch:
            done += batch.sample(0)  # "b" leaves after 4 tokens: its padding is trimmed
            if batch:
                batch.advance()
    for row in done:
        expected = unpadded_logprobs(model, prompts[row.owner], row.tokens)
        assert (torch.tensor(row.logprobs) - expected).abs().max().item() < 1e-5


async def test_a_prompt_whose_prefill_fails_fails_alone(model_path, monkeypatch):
    """Rows joining a live batch whose prefill raises fail with that error; the rows already
    live go on to their ends (the batch is untouched until the prefill succeeds)."""
    from rollout_servers.engines import hf_sampling

    prefill = hf_sampling._prefill

    def fragile(model, seqs, *args, **kwargs):
        if any(99 in s for s in seqs):
            raise RuntimeError("prefill exploded")
        return prefill(model, seqs, *args, **kwargs)

    monkeypatch.setattr(hf_sampling, "_prefill", fragile)
    engine = HookedEngine(model_path, seed=0)
    arrive = Pause(3)
    engine.pauses = (arrive,)
    long = asyncio.create_task(engine.generate([5, 6, 7], exact(20)))
    (bad,) = await join_at(engine, arrive, [([98, 99], exact(3))])
    with pytest.raises(RuntimeError, match="prefill exploded"):
        await asyncio.wait_for(bad, DEADLINE_S)
    assert len((await asyncio.wait_for(long, DEADLINE_S)).token_ids) == 20
    await engine.close()


async def test_out_of_vocabulary_prompt_ids_are_refused_by_name(model_path):
    engine = HFEngine(model_path)
    with pytest.raises(ValueError, match="token id 100000 is outside"):
        await engine.generate([5, 100000], exact(2))
    await engine.close()


async def test_a_sampling_loop_that_dies_fails_the_queued_callers(model_path, monkeypatch):
    """An error outside the per-row handling stops the loop: every caller queued behind it is
    failed with it instead of waiting forever."""
    from rollout_servers.engines import hf

    def broken(*args, **kwargs):
        raise RuntimeError("no batch today")

    monkeypatch.setattr(hf, "LiveBatch", broken)
    engine = HFEngine(model_path)
    calls = [engine.generate([5, 6], exact(2)) for _ in range(3)]
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), DEADLINE_S)
    assert all(isinstance(r, RuntimeError) and "no batch today" in str(r) for r in results)


async def test_a_response_ends_at_the_model_context(model_path):
    """Prompt plus response never exceed the model's positions (256 for the tiny model): the
    response stops there with finish reason 'length'; a prompt filling the context is refused."""
    engine = HFEngine(model_path)
    prompt = [5 + k % 40 for k in range(250)]
    out = await engine.generate(prompt, exact(20))
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="no room to sample in the model's context of 256"):
        await engine.generate(prompt + [5] * 6, exact(2))
    await engine.close()
