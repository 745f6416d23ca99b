"""The OpenAI-compatible endpoint and the `openai` agent loop, driven by the real `openai`
client over a real socket, against a scripted engine and the real char tokenizer: two tool
calls per episode token-exact, the loss mask token by token, every bad request class a 4xx
after which the endpoint still serves, 1,000 concurrent requests of one episode, drift,
agent errors and timeouts."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from asyncrl.config import Config
from asyncrl.config.rollout import OpenAIConfig, RolloutConfig
from asyncrl.demo.tiny_model import build_tokenizer
from asyncrl.wire.protocol import ChatMessage, PromptItem
from rollout_servers.agents.openai_agent import OpenAIAgentLoop
from rollout_servers.agents.registry import AgentLoopRouter
from rollout_servers.agents.turn_renderer import render_ids
from rollout_servers.engines.base import (
    AppliedVersion,
    Engine,
    GenerationOutput,
    SamplingParams,
    SyncTarget,
)

pytestmark = pytest.mark.integration

VERSION = 3
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=200)
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluates an expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def call_text(expression: str) -> str:
    arguments = {"expression": expression}
    return f"<tool_call>{json.dumps({'name': 'calculator', 'arguments': arguments})}</tool_call>"


class ToolScriptEngine(Engine):
    """Answers by the number k of tool turns in the prompt: a calculator call for k = 0 and 1,
    then `The answer is 5`; every reply ends with `</s>`. Log-prob of the j-th id of a reply
    after k tool turns: -(k + 1 + j / 1000). Records what it was asked and what it returned."""

    def __init__(self, tokenizer: Any, delay_s: float = 0.0):
        self.tokenizer, self.delay_s = tokenizer, delay_s
        self.tool_id = tokenizer.convert_tokens_to_ids("<|tool|>")
        self.context_tokens = 2000
        self.calls: list[tuple[list[int], GenerationOutput]] = []

    @property
    def version(self) -> int:
        return VERSION

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        await asyncio.sleep(self.delay_s)
        k = prompt_ids.count(self.tool_id)
        text = [call_text("2+3"), call_text("5*1"), "The answer is 5"][min(k, 2)] + "</s>"
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: params.max_new_tokens]
        out = GenerationOutput(ids, [-(k + 1 + j / 1000) for j in range(len(ids))], VERSION, "stop")
        self.calls.append((list(prompt_ids), out))
        return out

    def follow_learner(self, target: SyncTarget) -> Iterator[AppliedVersion]:
        raise RuntimeError("a scripted engine has no weights")


# ---- agents (named by import path, as rollout.openai.agent names them) -------------------------
async def two_tool_calls(client: openai.AsyncOpenAI, row: dict[str, Any]) -> list[Any]:
    """A hand-rolled agent: call the model, run its tool calls, until it answers."""
    messages: list[Any] = list(row["messages"])
    for _ in range(4):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALC]
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if reply.choices[0].finish_reason != "tool_calls":
            return messages
        for call in message.tool_calls or []:
            value = eval(json.loads(call.function.arguments)["expression"])  # noqa: S307
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})
    return messages


async def rewrites_history(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    """Calls once, then sends the first reply back changed: drift."""
    messages: list[Any] = list(row["messages"])
    await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    messages += [
        {"role": "assistant", "content": "I will guess."},
        {"role": "user", "content": "?"},
    ]
    await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    return 1.0


async def raises(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    await client.chat.completions.create(model="policy", messages=row["messages"])
    raise RuntimeError("agent bug")


async def sleeps(client: openai.AsyncOpenAI, row: dict[str, Any]) -> float:
    await asyncio.sleep(60)
    return 1.0


LATE: list[int] = []


def sync_late(client: openai.OpenAI, row: dict[str, Any]) -> float:
    """Blocks past the episode's timeout, then asks: its key is closed by then."""
    time.sleep(0.6)
    try:
        client.chat.completions.create(model="policy", messages=row["messages"])
        LATE.append(200)
    except openai.APIStatusError as e:
        LATE.append(e.status_code)
    return 1.0


def sync_agent(client: openai.OpenAI, row: dict[str, Any]) -> float:
    """A blocking agent: runs in a thread."""
    reply = client.chat.completions.create(model="policy", messages=row["messages"])
    return 0.25 if reply.choices[0].message.tool_calls else 0.0


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def make_loop(tokenizer, agent: str, delay_s: float = 0.0, **cfg: Any) -> OpenAIAgentLoop:
    config = OpenAIConfig(enabled=True, agent=f"{__name__}:{agent}", **cfg)
    return OpenAIAgentLoop(ToolScriptEngine(tokenizer, delay_s), tokenizer, PARAMS, config)


def prompt() -> PromptItem:
    return PromptItem(
        group_id="g",
        n=1,
        data_source="test",
        messages=[ChatMessage("user", "What is 2+3?")],
        ground_truth="5",
        extra_info={},
    )


def chat(messages: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": messages or [{"role": "user", "content": "hi"}], **extra}


# ---- the agent loop ----------------------------------------------------------------------------
async def test_two_tool_calls_through_the_client_are_recorded_token_exactly(tokenizer):
    loop = make_loop(tokenizer, "two_tool_calls")
    try:
        result = await loop.run(prompt())
    finally:
        await loop.endpoint.close()
    engine = loop.engine
    assert isinstance(engine, ToolScriptEngine)
    assert len(engine.calls) == 3 and result.finish_reason == "stop"
    assert result.metrics["openai_completions"] == 3 and result.metrics["openai_drift"] == 0
    assert result.reward is None and result.response_text == "The answer is 5"
    full = result.prompt_ids + result.response_ids
    # every request's prompt is the trajectory so far, ids and all
    sampled = 0
    for k, (prompt_ids, out) in enumerate(engine.calls):
        assert full[: len(prompt_ids)] == prompt_ids
        start = len(prompt_ids) - len(result.prompt_ids)
        assert result.response_ids[start : start + len(out.token_ids)] == out.token_ids
        for j in range(len(out.token_ids)):  # the loss mask, token by token
            assert result.loss_mask[start + j] == 1
            assert result.logprobs[start + j] == -(k + 1 + j / 1000)
            assert result.versions[start + j] == VERSION
        sampled += len(out.token_ids)
    assert sum(result.loss_mask) == sampled
    assert len(result.loss_mask) == len(result.logprobs) == len(result.versions)
    for mask, lp, v in zip(result.loss_mask, result.logprobs, result.versions, strict=True):
        assert mask == 1 or (lp, v) == (0.0, -1)
    # the template ids between the turns are the tool outputs, as the chat template renders them
    text = tokenizer.decode(result.response_ids, skip_special_tokens=False)
    assert text.count("<|tool|>5</s><|assistant|>") == 2
    question = [{"role": "user", "content": "What is 2+3?"}]
    assert result.prompt_ids == render_ids(tokenizer, question, [CALC])


async def test_drift_is_counted_and_refuses_the_episode(tokenizer):
    loop = make_loop(tokenizer, "rewrites_history")
    try:
        result = await loop.run(prompt())
    finally:
        await loop.endpoint.close()
    assert result.metrics["openai_drift"] == 1 and result.metrics["openai_refused"] == 1
    assert result.reward == 1.0 and sum(result.loss_mask) == 0
    assert result.metrics["openai_unused_completions"] == 1


@pytest.mark.parametrize(
    ("agent", "metric"), [("raises", "openai_agent_errors"), ("sleeps", "openai_agent_timeouts")]
)
async def test_agent_errors_and_timeouts_score_zero(tokenizer, agent, metric):
    loop = make_loop(tokenizer, agent, timeout_s=0.5)
    try:
        result = await loop.run(prompt())
        assert result.reward == 0.0 and result.metrics[metric] == 1
        assert len(result.response_ids) == len(result.loss_mask)
        assert (await loop.run(prompt())).reward == 0.0  # and the loop goes on
    finally:
        await loop.endpoint.close()


async def test_a_sync_agent_runs_in_a_thread_and_its_float_is_the_reward(tokenizer):
    loop = make_loop(tokenizer, "sync_agent")
    try:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        ticker = asyncio.ensure_future(tick())
        result = await loop.run(prompt())
        ticker.cancel()
    finally:
        await loop.endpoint.close()
    assert result.reward == 0.25 and sum(result.loss_mask) == len(result.response_ids)
    assert ticks > 1  # the event loop ran while the agent blocked


async def test_router_uses_the_servers_openai_loop_and_config_requires_enabled(tokenizer):
    loop = make_loop(tokenizer, "sync_agent")
    router = AgentLoopRouter(
        "single_turn",
        engine=loop.engine,
        tokenizer=tokenizer,
        params=PARAMS,
        loops={"openai": loop},
    )
    assert router.loop_for("openai") is loop
    await loop.base_url()
    await router.close()  # the endpoint stops serving
    assert loop.endpoint._runner is None
    with pytest.raises(ValueError, match="openai.enabled"):
        RolloutConfig(agent_loop="openai")
    with pytest.raises(ValueError, match="package.module:function"):
        RolloutConfig(openai=OpenAIConfig(enabled=True))
    wide = {"openai": {"enabled": True, "agent": "m:f", "host": "0.0.0.0"}}
    with pytest.raises(ValueError, match="launch.allow_remote"):
        Config(rollout=wide)
    assert Config(rollout=wide, launch={"allow_remote": True}).rollout.openai.host == "0.0.0.0"


async def test_a_sync_agent_past_its_timeout_is_refused_afterwards(tokenizer):
    loop = make_loop(tokenizer, "sync_late", timeout_s=0.3)
    try:
        result = await loop.run(prompt())
        assert result.metrics["openai_agent_timeouts"] == 1 and result.reward == 0.0
        for _ in range(100):
            if LATE:
                break
            await asyncio.sleep(0.05)
        assert LATE == [401]
    finally:
        await loop.endpoint.close()


async def test_n_choices_and_a_stop_string_of_several_ids(tokenizer):
    loop = make_loop(tokenizer, "sync_agent")
    url = await loop.base_url()
    episode = loop.endpoint.open_episode(PARAMS)
    try:
        async with openai.AsyncOpenAI(base_url=url, api_key=episode.key, max_retries=0) as client:
            reply = await client.chat.completions.create(**chat(n=2, stop=["calc"]))
        assert [c.message.content for c in reply.choices] == ['<tool_call>{"name": "'] * 2
        assert [c.finish_reason for c in reply.choices] == ["stop", "stop"]
        for c in episode.completions:  # the ids are cut right after the stop string
            assert tokenizer.decode(c.token_ids) == '<tool_call>{"name": "calc'
            assert not c.ended and len(c.logprobs) == len(c.token_ids)
    finally:
        await loop.endpoint.close()


# ---- bad requests ------------------------------------------------------------------------------
async def test_each_bad_request_gets_its_4xx_and_the_endpoint_goes_on(tokenizer):
    loop = make_loop(tokenizer, "sync_agent", max_requests_per_episode=100)
    url = await loop.base_url()
    episode = loop.endpoint.open_episode(PARAMS)
    client = openai.AsyncOpenAI(base_url=url, api_key=episode.key, max_retries=0)
    good = chat()

    async def still_serves() -> None:
        reply = await client.chat.completions.create(**good)
        assert reply.choices[0].finish_reason == "tool_calls"

    long = [{"role": "user", "content": "x" * 2500}]
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
    cases = [
        (dict(good, model="gpt-9"), openai.NotFoundError, "model_not_found"),
        (chat(long), openai.BadRequestError, "context_length_exceeded"),
        (chat(tools=[bad_tool]), openai.BadRequestError, "invalid_tool_schema"),
        (chat(messages=[{"role": "wizard"}]), openai.BadRequestError, None),
        (chat(temperature=-1), openai.BadRequestError, None),
    ]
    try:
        for body, error, code in cases:
            with pytest.raises(error) as caught:
                await client.chat.completions.create(**body)
            assert caught.value.body["code"] == code  # the OpenAI error shape
            await still_serves()
        wrong = openai.AsyncOpenAI(base_url=url, api_key="not-a-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(**good)
        await still_serves()
        async with httpx.AsyncClient(trust_env=False) as raw:
            auth = {"Authorization": f"Bearer {episode.key}"}
            for body in (b"{not json", b"[1, 2]", b"\xff\xfe"):
                r = await raw.post(f"{url}/chat/completions", content=body, headers=auth)
                assert r.status_code == 400 and r.json()["error"]["message"]
            huge = b"[" + b"0," * (9 * 2**20) + b"0]"  # 18 MiB
            r = await raw.post(f"{url}/chat/completions", content=huge, headers=auth)
            assert r.status_code == 413
            r = await raw.get(f"{url}/models", headers=auth)
            assert r.json()["data"][0]["id"] == "policy"
        await still_serves()
        assert not any(k.startswith("status_5") for k in loop.endpoint.counters)
    finally:
        await client.close()
        await loop.endpoint.close()


async def test_a_thousand_concurrent_requests_of_one_episode(tokenizer):
    """Past max_concurrent_requests they are 429, never 5xx; the endpoint serves on, and a
    closed episode's key is refused."""
    loop = make_loop(tokenizer, "sync_agent", delay_s=0.2, max_requests_per_episode=500)
    url = await loop.base_url()
    episode = loop.endpoint.open_episode(PARAMS)
    client = openai.AsyncOpenAI(base_url=url, api_key=episode.key, max_retries=0, timeout=60)

    async def one() -> int:
        try:
            await client.chat.completions.create(**chat())
            return 200
        except openai.APIStatusError as e:
            return e.status_code

    try:
        statuses = Counter(await asyncio.gather(*(one() for _ in range(1000))))
        assert set(statuses) == {200, 429}, statuses
        assert 8 <= statuses[200] <= 500
        assert len(loop.endpoint.engine.calls) == statuses[200]  # type: ignore[attr-defined]
        loop.endpoint.close_episode(episode)
        assert await one() == 401
        fresh = loop.endpoint.open_episode(PARAMS)
        client = openai.AsyncOpenAI(base_url=url, api_key=fresh.key, max_retries=0)
        assert await one() == 200
    finally:
        await client.close()
        await loop.endpoint.close()
