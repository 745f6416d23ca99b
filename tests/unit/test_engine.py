"""The transformers engine: log-prob parity with the learner, batching, stopping, weight swaps
(continuous batching itself: tests/unit/test_hf_continuous.py)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from asyncrl.demo.model_cache import TinyModelSpec
from asyncrl.demo.tiny_model import build_tiny_model, build_tokenizer
from rollout_servers.engines.base import GenerationOutput, SamplingParams
from rollout_servers.engines.hf import HFEngine

EMIT_ID = 50  # the token the "always emits" model samples; not EOS


def _save(model: LlamaForCausalLM, tokenizer, path: Path) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _always_emit(model: LlamaForCausalLM, token_id: int) -> LlamaForCausalLM:
    """Weights that make `token_id` the next token with probability ~1 after any input: the
    layers add nothing to the residual stream, every embedding is the ones vector, so the final
    hidden state is constant and only `token_id`'s output row is non-zero (logit 128 vs 0)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[token_id] = 1.0
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def random_model_path(tokenizer, tmp_path_factory) -> Path:
    model = build_tiny_model(tokenizer, TinyModelSpec(), seed=0)
    return _save(model, tokenizer, tmp_path_factory.mktemp("random"))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Prompts of different lengths, so left padding matters."""
    texts = ["1+2=", "the sum of 3 and 4 is ", "9+9=", "x" * 37, "a\nb", "5"]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _recompute_logprobs(
    model_path: Path, prompts: list[list[int]], outputs: list[GenerationOutput], temps: list[float]
) -> list[torch.Tensor]:
    """The learner's recomputation: one right-padded forward of prompt + response with the
    default attention, log_softmax(logits / T) gathered at each response token."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    seqs = [p + o.token_ids for p, o in zip(prompts, outputs, strict=True)]
    width = max(len(s) for s in seqs)
    input_ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    result = []
    for i, (p, o, t) in enumerate(zip(prompts, outputs, temps, strict=True)):
        logp = torch.log_softmax(logits[i] / (t or 1.0), dim=-1)
        logp = logp.gather(-1, input_ids[i, 1:, None]).squeeze(-1)
        result.append(logp[len(p) - 1 : len(p) - 1 + len(o.token_ids)])
    return result


async def _generate_all(
    engine: HFEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> list[GenerationOutput]:
    return await asyncio.gather(
        *(engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True))
    )


async def test_behaviour_logprobs_match_right_padded_recompute(random_model_path, prompts):
    engine = HFEngine(random_model_path, seed=0)
    rows = [
        (p, sp)
        for p in prompts
        for sp in (
            SamplingParams(temperature=1.0, max_new_tokens=12),
            SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=9),
            SamplingParams(temperature=0.0, max_new_tokens=5),
        )
    ]
    outputs = await _generate_all(engine, [p for p, _ in rows], [sp for _, sp in rows])
    await engine.close()
    assert engine.batches_run == 1  # one batch, rows with different parameters
    temps = [sp.temperature for _, sp in rows]
    expected = _recompute_logprobs(random_model_path, [p for p, _ in rows], outputs, temps)
    for out, ref, (_, sp) in zip(outputs, expected, rows, strict=True):
        assert 1 <= len(out.token_ids) <= sp.max_new_tokens
        assert len(out.logprobs) == len(out.token_ids) and out.version == 0
        diff = (torch.tensor(out.logprobs) - ref).abs().max().item()
        assert diff < 1e-4


async def test_concurrent_requests_are_batched(random_model_path, prompts):
    """Concurrent callers share one sampling loop: one busy period, all rows together (rows
    joining a running loop and max_batch_size: tests/unit/test_hf_continuous.py)."""
    engine = HFEngine(random_model_path, seed=0)
    params = SamplingParams(max_new_tokens=4)
    outputs = await _generate_all(engine, [prompts[i % 6] for i in range(32)], [params] * 32)
    assert len(outputs) == 32 and engine.batches_run == 1
    outputs = await _generate_all(engine, [prompts[i % 6] for i in range(20)], [params] * 20)
    assert len(outputs) == 20 and engine.batches_run == 2  # idle in between: a new period
    await engine.close()


async def test_eos_and_stop_ids_stop_and_max_new_tokens_is_length(tokenizer, tmp_path):
    eos = tokenizer.eos_token_id
    emits_eos = _always_emit(build_tiny_model(tokenizer, TinyModelSpec(), 0), eos)
    emits_other = _always_emit(build_tiny_model(tokenizer, TinyModelSpec(), 0), EMIT_ID)
    prompt = tokenizer.encode("1+2=", add_special_tokens=False)

    engine = HFEngine(_save(emits_eos, tokenizer, tmp_path / "eos"))
    out = await engine.generate(prompt, SamplingParams(max_new_tokens=5))
    assert (out.token_ids, out.finish_reason) == ([eos], "stop")
    assert out.logprobs[0] == pytest.approx(0.0, abs=1e-6)
    out = await engine.generate(prompt, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert (out.token_ids, out.finish_reason) == ([eos] * 5, "length")  # exact lengths
    await engine.close()

    engine = HFEngine(_save(emits_other, tokenizer, tmp_path / "other"))
    stopped, capped = await _generate_all(
        engine,
        [prompt, prompt],
        [SamplingParams(stop_token_ids=(EMIT_ID,)), SamplingParams(max_new_tokens=3)],
    )
    assert (stopped.token_ids, stopped.finish_reason) == ([EMIT_ID], "stop")
    assert (capped.token_ids, capped.finish_reason) == ([EMIT_ID] * 3, "length")
    await engine.close()


async def test_greedy_is_deterministic_and_tiny_top_p_is_greedy(random_model_path, prompts):
    greedy = [SamplingParams(temperature=0.0, max_new_tokens=8)] * len(prompts)
    nucleus = [SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=8)] * len(prompts)
    a, b = HFEngine(random_model_path, seed=1), HFEngine(random_model_path, seed=2)
    first = await _generate_all(a, prompts, greedy)
    second = await _generate_all(b, prompts, greedy)
    narrow = await _generate_all(b, prompts, nucleus)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert [o.token_ids for o in first] == [o.token_ids for o in narrow]
    for g, n in zip(first, narrow, strict=True):  # both report the T = 1 log-probs
        assert g.logprobs == pytest.approx(n.logprobs, abs=1e-6)
    await a.close()
    await b.close()


async def test_same_seed_samples_the_same(random_model_path, prompts):
    params = [SamplingParams(max_new_tokens=8)] * len(prompts)
    a, b = HFEngine(random_model_path, seed=5), HFEngine(random_model_path, seed=5)
    first, second = await _generate_all(a, prompts, params), await _generate_all(b, prompts, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    await a.close()
    await b.close()


async def test_update_weights_applies_whole_versions_between_batches(
    tokenizer, random_model_path, prompts, tmp_path
):
    """Weights alternate between two models while requests run (update_weights waits for the
    sampling loop to stop); every output's log-probs must match the model of the version it
    is tagged with (a torn or mis-tagged batch would not)."""
    other_path = _save(build_tiny_model(tokenizer, TinyModelSpec(), seed=1), tokenizer, tmp_path)
    weights = {
        0: dict(AutoModelForCausalLM.from_pretrained(random_model_path).state_dict()),
        1: dict(AutoModelForCausalLM.from_pretrained(other_path).state_dict()),
    }
    engine = HFEngine(random_model_path, seed=0)
    params = SamplingParams(max_new_tokens=6)

    async def swap_weights() -> None:
        for version in range(1, 7):
            await asyncio.to_thread(engine.update_weights, weights[version % 2].items(), version)
            await asyncio.sleep(0.002)

    swapper = asyncio.create_task(swap_weights())
    rows: list[tuple[list[int], GenerationOutput]] = []
    while not swapper.done():
        outputs = await _generate_all(engine, prompts, [params] * len(prompts))
        rows += zip(prompts, outputs, strict=True)
    await swapper
    rows.append((prompts[0], await engine.generate(prompts[0], params)))
    assert engine.version == 6 and rows[-1][1].version == 6
    versions = {o.version for _, o in rows}
    assert len(versions) >= 2
    for version in versions:
        mine = [(p, o) for p, o in rows if o.version == version]
        path = other_path if version % 2 else random_model_path
        expected = _recompute_logprobs(
            path, [p for p, _ in mine], [o for _, o in mine], [params.temperature] * len(mine)
        )
        for (_, out), ref in zip(mine, expected, strict=True):
            assert (torch.tensor(out.logprobs) - ref).abs().max().item() < 1e-4
    for name, tensor in engine.named_weights():
        assert torch.equal(tensor, weights[0][name])
    await engine.close()


async def test_update_weights_rejects_mismatch_and_applies_nothing(tokenizer, random_model_path):
    engine = HFEngine(random_model_path)
    before = {n: t.clone() for n, t in engine.named_weights()}
    new = [(n, torch.randn_like(t)) for n, t in before.items()]
    last_name, last = new[-1]  # last, so a copy-as-you-go engine would already have changed others
    with pytest.raises(ValueError, match=re.escape(repr(last_name))):
        engine.update_weights([*new[:-1], (last_name, last[:-1])], version=1)
    with pytest.raises(ValueError, match="float64"):
        engine.update_weights([*new[:-1], (last_name, last.double())], version=1)
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        engine.update_weights([*new, ("nope", last)], version=1)
    with pytest.raises(ValueError, match="missing parameter"):
        engine.update_weights(new[:-1], version=1)
    assert engine.version == 0
    for n, t in engine.named_weights():
        assert torch.equal(t, before[n])

    engine.update_weights(iter(new), version=4)
    assert engine.version == 4
    for (name, t), (new_name, expected) in zip(engine.named_weights(), new, strict=True):
        assert name == new_name and torch.equal(t, expected)
    out = await engine.generate([5, 6, 7], SamplingParams(max_new_tokens=2))
    assert out.version == 4
    await engine.close()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_engine_dtype_and_device(random_model_path, prompts, device, dtype):
    """rollout.dtype: the engine holds its weights in that dtype (the learner sends them so:
    a bf16 engine takes half the bytes) and its behaviour log-probs stay close to the fp32
    recompute (float32: 1e-4 as on CPU; bfloat16: loosely, its rounding is real)."""
    engine = HFEngine(random_model_path, device=device, seed=0, dtype=dtype)
    assert {t.dtype for _, t in engine.named_weights()} == {getattr(torch, dtype)}
    params = [SamplingParams(temperature=1.0, max_new_tokens=8) for _ in prompts]
    outputs = await _generate_all(engine, prompts, params)
    await engine.close()
    expected = _recompute_logprobs(random_model_path, prompts, outputs, [1.0] * len(prompts))
    bound = 1e-4 if dtype == "float32" else 0.1
    for out, ref in zip(outputs, expected, strict=True):
        assert (torch.tensor(out.logprobs) - ref).abs().max().item() < bound


async def test_a_response_cut_by_the_context_is_counted_and_logged(random_model_path, caplog):
    """A prompt that leaves less room in the context than max_new_tokens: the response ends at
    the context ("length"), and the engine says so instead of cutting it silently."""
    engine = HFEngine(random_model_path, seed=0)
    context = engine._context
    prompt = [5] * (context - 3)
    with caplog.at_level("WARNING", logger="asyncrl.rollout"):
        out = await engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=10))
        await engine.generate([5, 6], SamplingParams(temperature=0.0, max_new_tokens=3))
    await engine.close()
    assert len(out.token_ids) <= 3
    assert engine.responses_capped_by_context == 1
    assert "end at the context" in caplog.text
