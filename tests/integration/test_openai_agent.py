"""The `openai` agent loop with the tiny HF model behind the endpoint (the real `openai`
client, a real socket), and the server's use of an episode's own reward."""

from __future__ import annotations

import dataclasses
from typing import Any

import openai
import pytest

from asyncrl.config import load_config
from asyncrl.config.rollout import OpenAIConfig
from asyncrl.demo.tiny_model import build_tokenizer
from asyncrl.run_spec import RunSpec
from asyncrl.wire.protocol import ChatMessage, PromptItem
from rollout_servers.agents.base import AgentResult
from rollout_servers.agents.openai_agent import OpenAIAgentLoop
from rollout_servers.agents.turn_renderer import render_ids
from rollout_servers.engines.base import SamplingParams
from rollout_servers.server import RolloutServer

pytestmark = pytest.mark.integration

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=200)


def prompt() -> PromptItem:
    question = [ChatMessage("user", "What is 2+3?")]
    return PromptItem("g", 1, "test", question, "5", {})


async def greedy_turns(client: openai.AsyncOpenAI, row: dict[str, Any]) -> list[Any]:
    """Two greedy turns of the tiny model with a tool message between; the first stops on
    the stop string the row names (its first greedy token), so the second continues it."""
    messages: list[Any] = list(row["messages"])
    for stop in (row["extra_info"]["stop"], None):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, temperature=0, max_tokens=6, stop=stop
        )
        messages += [reply.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "tool", "content": "42"}] if stop else []
    return messages


async def test_the_hf_engine_behind_the_endpoint_records_its_own_ids_and_logprobs(model_path):
    """The tiny model through the endpoint: the trajectory's sampled ids are what the engine
    samples for the same prompts, and their log-probs are the model's own (recomputed)."""
    from rollout_servers.engines.hf import HFEngine

    tokenizer = build_tokenizer()
    engine = HFEngine(str(model_path), seed=0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    question = [{"role": "user", "content": "What is 2+3?"}]
    first = await engine.generate(render_ids(tokenizer, question), greedy)
    row = dataclasses.replace(prompt(), extra_info={"stop": tokenizer.decode(first.token_ids[:1])})
    config = OpenAIConfig(enabled=True, agent=f"{__name__}:greedy_turns")
    run_params = dataclasses.replace(greedy, max_new_tokens=200)  # the run samples greedily
    loop = OpenAIAgentLoop(engine, tokenizer, run_params, config)
    try:
        result = await loop.run(row)
        assert result.metrics["openai_completions"] == 2 and result.metrics["openai_drift"] == 0
        mask = result.loss_mask
        turns = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
        assert len(turns) == 2 and turns[0] == 0 and mask[1] == 0  # one id, then the tool turn
        assert result.response_ids[0] == first.token_ids[0]
        second_prompt = result.prompt_ids + result.response_ids[: turns[1]]
        again = await engine.generate(second_prompt, greedy)
        assert result.response_ids[turns[1] :] == again.token_ids
        full = result.prompt_ids + result.response_ids
        recomputed = engine.probe_logprobs(full)
        assert recomputed is not None
        p = len(result.prompt_ids)
        for i, m in enumerate(mask):
            if m:
                assert abs(result.logprobs[i] - float(recomputed[p + i - 1])) < 1e-4
            else:
                assert (result.logprobs[i], result.versions[i]) == (0.0, -1)
    finally:
        await loop.endpoint.close()
        await engine.close()


RUN_TEMPERATURE = 0.7
REFUSED: list[tuple[float, str]] = []


async def other_temperatures(client: openai.AsyncOpenAI, row: dict[str, Any]) -> list[Any]:
    """Two turns, each first asked at a temperature the run does not sample at (1.0, then
    0, greedy: log-probs of the T = 1 softmax); when refused, asked again at the run's."""
    messages: list[Any] = list(row["messages"])
    for asked, fallback in ((1.0, None), (0.0, RUN_TEMPERATURE)):
        try:
            reply = await client.chat.completions.create(
                model="policy", messages=messages, temperature=asked, max_tokens=8
            )
        except openai.BadRequestError as e:
            REFUSED.append((asked, e.body["code"]))
            reply = await client.chat.completions.create(
                model="policy", messages=messages, temperature=fallback, max_tokens=8
            )
        messages += [reply.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "tool", "content": "42"}]
    return messages[:-1]


async def test_every_trained_logprob_is_taken_at_the_runs_temperature(model_path):
    """The run samples at 0.7 and the learner recomputes there: a request asking for another
    temperature used to be sampled at it, its behaviour log-probs of another softmax (wrong
    importance ratios). Now it is refused (400), and every trained token's behaviour log-prob
    equals the learner's recomputation at the run's temperature (a full-sequence forward)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_servers.engines.hf import HFEngine

    tokenizer = build_tokenizer()
    engine = HFEngine(str(model_path), seed=0)
    config = OpenAIConfig(enabled=True, agent=f"{__name__}:other_temperatures")
    run_params = SamplingParams(temperature=RUN_TEMPERATURE, max_new_tokens=200)
    loop = OpenAIAgentLoop(engine, tokenizer, run_params, config)
    REFUSED.clear()
    try:
        result = await loop.run(prompt())
    finally:
        await loop.close()
        await engine.close()
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    full = result.prompt_ids + result.response_ids
    with torch.no_grad():
        logits = model(torch.tensor([full])).logits[0, :-1].float() / RUN_TEMPERATURE
    learner = logits.log_softmax(-1).gather(1, torch.tensor(full[1:])[:, None])[:, 0]
    p = len(result.prompt_ids)
    sampled = [i for i, v in enumerate(result.versions) if v >= 0]
    assert len(sampled) > 2
    worst = max(abs(result.logprobs[i] - float(learner[p + i - 1])) for i in sampled)
    assert worst < 1e-4, f"behaviour and learner log-probs differ by up to {worst:.4f}"
    assert REFUSED == [(1.0, "unsupported_value"), (0.0, "unsupported_value")]
    assert result.metrics["openai_completions"] == 2 and result.metrics["openai_drift"] == 0
    assert [i for i, m in enumerate(result.loss_mask) if m] == sampled  # all of them trained


async def test_the_server_takes_an_episodes_own_reward_instead_of_scoring(tmp_path):
    class Loop:
        async def run(self, prompt, params=None) -> AgentResult:
            return AgentResult([1], [2], [1], [-0.5], [0], "text", "stop", reward=0.75)

    class Rewards:
        async def score(self, *args: Any) -> tuple[float, dict[str, float]]:
            raise AssertionError("an episode with its own reward is not scored")

    class Client:
        sent: list[Any] = []

        async def put(self, traj: Any) -> None:
            self.sent.append(traj)

    class FakeEngine:
        on_batch = None

    cfg = load_config(None, ["rollout.n=2"])
    spec = RunSpec(str(tmp_path), "unused", "tcp://127.0.0.1:1", "127.0.0.1", 0, 0, 1)
    server = RolloutServer(cfg, spec, 0, FakeEngine(), Loop(), Client(), Rewards())  # type: ignore[arg-type]
    await server.run_group(dataclasses.replace(prompt(), n=2))
    assert [t.reward for t in Client.sent] == [0.75, 0.75]
