"""What no request may do to the OpenAI-compatible endpoint (issue 40): stall the server's event
loop (which carries its heartbeats), get a 500 with a malformed number or string, have a field
ignored without a word, get an empty stream, or leave a reply cut at `max_tokens` that cannot
be continued. Driven with the real `openai` client and raw HTTP against scripted engines and
the char tokenizer."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest

from asyncrl.config.rollout import OpenAIConfig
from asyncrl.demo.tiny_model import build_tokenizer
from asyncrl.wire.protocol import ChatMessage, PromptItem
from rollout_servers.agents.openai_agent import OpenAIAgentLoop
from rollout_servers.agents.openai_endpoint import OpenAIEndpoint
from rollout_servers.agents.turn_renderer import TurnRenderer, render_ids
from rollout_servers.engines.base import (
    AppliedVersion,
    Engine,
    GenerationOutput,
    SamplingParams,
    SyncTarget,
)

pytestmark = pytest.mark.integration

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=200)
MAX_LAG_S = 1.0  # half a heartbeat interval (launch.heartbeat_s); on a4c0d2f: 36.6 s
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


class CallThenAnswerEngine(Engine):
    """A tool call and more text before any tool output, then `The answer is 5`; each reply
    ends with `</s>`, or is cut at `max_new_tokens` with finish reason "length" (as engines
    do). Log-prob of the j-th id of the k-th call: -(k + 1 + j / 1000)."""

    def __init__(self, tokenizer: Any, context_tokens: int = 2000):
        self.tokenizer, self.context_tokens = tokenizer, context_tokens
        self.tool_id = tokenizer.convert_tokens_to_ids("<|tool|>")
        self.calls: list[tuple[list[int], GenerationOutput]] = []

    @property
    def version(self) -> int:
        return 1

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        text = CALL + " and then I explain" if self.tool_id not in prompt_ids else "The answer is 5"
        ids = self.tokenizer.encode(text + "</s>", add_special_tokens=False)
        finish = "length" if len(ids) > params.max_new_tokens else "stop"
        ids = ids[: params.max_new_tokens]
        k = len(self.calls)
        out = GenerationOutput(ids, [-(k + 1 + j / 1000) for j in range(len(ids))], 1, finish)
        self.calls.append((list(prompt_ids), out))
        return out

    def follow_learner(self, target: SyncTarget) -> Iterator[AppliedVersion]:
        raise RuntimeError("a scripted engine has no weights")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@asynccontextmanager
async def serving(tokenizer: Any, **engine: Any) -> AsyncIterator[tuple[OpenAIEndpoint, str, str]]:
    """(the endpoint, its chat URL, an open episode's key)."""
    cfg = OpenAIConfig(enabled=True, agent="unused:unused", max_requests_per_episode=1000)
    endpoint = OpenAIEndpoint(CallThenAnswerEngine(tokenizer, **engine), tokenizer, cfg)
    url = await endpoint.start()
    try:
        yield endpoint, f"{url}/chat/completions", endpoint.open_episode(PARAMS).key
    finally:
        await endpoint.close()


@asynccontextmanager
async def loop_lag() -> AsyncIterator[list[float]]:
    """[the longest the event loop went without running a 10 ms ticker, in seconds]."""
    worst = [0.0]

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            worst[0] = max(worst[0], now - last - 0.01)
            last = now

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.05)
    try:
        yield worst
    finally:
        ticker.cancel()


def body(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": [{"role": "user", "content": content}], **extra}


async def test_huge_messages_leave_the_event_loop_free(tokenizer):
    """A 16 MB message (under the 16 MiB body limit) is refused before it is tokenized: it
    used to hold the server's loop for a minute, past the heartbeat deadline. One under the
    character bound (an engine with a long context) is tokenized in a thread, not on the loop."""
    async with (
        serving(tokenizer) as (_, url, key),
        httpx.AsyncClient(trust_env=False, timeout=120) as http,
    ):
        auth = {"Authorization": f"Bearer {key}"}
        async with loop_lag() as lag:
            r = await http.post(url, json=body("x" * 16_000_000), headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert lag[0] < MAX_LAG_S, f"the event loop stalled {lag[0]:.2f}s"
        assert (await http.post(url, json=body(), headers=auth)).status_code == 200
    async with serving(tokenizer, context_tokens=1 << 20) as (endpoint, url, key):
        assert endpoint.max_prompt_chars > 2_000_000
        async with httpx.AsyncClient(trust_env=False, timeout=120) as http, loop_lag() as lag:
            auth = {"Authorization": f"Bearer {key}"}
            r = await http.post(url, json=body("x" * 2_000_000), headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "2000" in r.json()["error"]["message"]  # tokenized: its token count is named
        assert lag[0] < MAX_LAG_S, f"the event loop stalled {lag[0]:.2f}s"


TOOL_TEMPLATE = (  # the char tokenizer's template, rendering tool schemas and tool calls too
    "{% if tools %}{{ '<|system|>' + (tools | tojson) + '</s>' }}{% endif %}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
    "{% for c in m.tool_calls or [] %}{{ c['function'] | tojson }}{% endfor %}{{ '</s>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


async def test_tool_schemas_and_call_arguments_count_toward_the_bound():
    """A megabyte in a tool's description and one in an assistant call's arguments are
    rendered into the prompt, but the bound counted contents only (3 characters): the prompt
    was tokenized in full, holding one of the two prepare threads for seconds (a minute at
    16 MB). It is refused on its rendered text now, before any tokenizing."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    tool = {"type": "function", "function": {**CALC["function"], "description": "d" * 10**6}}
    call = {"id": "c1", "type": "function"}
    call["function"] = {"name": "calculator", "arguments": json.dumps({"e": "1" * 10**6})}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    async with serving(tokenizer) as (endpoint, url, key):
        auth = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(trust_env=False, timeout=120) as http, loop_lag() as lag:
            for extra in ({"tools": [tool]}, {"messages": messages}):
                r = await http.post(url, json=body(**extra), headers=auth)
                error = r.json()["error"]
                assert r.status_code == 400 and error["code"] == "context_length_exceeded"
                assert "characters" in error["message"], error  # refused before tokenizing
            r = await http.post(url, json=body(tools=[CALC]), headers=auth)
            assert r.status_code == 200  # a prompt with tools under the bound is served
        assert lag[0] < MAX_LAG_S, f"the event loop stalled {lag[0]:.2f}s"
        assert isinstance(endpoint.engine, CallThenAnswerEngine)
        prompt_ids = endpoint.engine.calls[0][0]
        assert prompt_ids == render_ids(tokenizer, [{"role": "user", "content": "hi"}], [CALC])


SURROGATE = '"\\ud800"'  # a JSON escape that decodes to a lone surrogate


def raw(fields: str = "", content: str = '"hi"', model: str = '"policy"', key: str = "") -> str:
    """A request body as JSON text, with `fields` appended to its top-level object."""
    message = f'{{"role": "user", "content": {content}{key}}}'
    return f'{{"model": {model}, "messages": [{message}]{fields}}}'


MALFORMED = [  # none may reach the engine, none may be a 5xx
    raw(', "n": 1' + "0" * 400),
    raw(', "max_tokens": 9' + "9" * 399),
    raw(', "temperature": 1' + "0" * 400),
    raw(', "max_tokens": 1' + "0" * 5000),  # past Python's digit limit
    raw(f', "stop": {SURROGATE}'),
    raw(f', "stop": ["a", {SURROGATE}]'),
    raw(content=SURROGATE),
    raw(model=SURROGATE),
    raw(key=f", {SURROGATE}: 1"),
    raw(', "n": NaN'),
    raw(', "top_p": Infinity'),
    raw(', "n": 1e400'),
    raw(', "n": 2.5'),
    raw(', "max_tokens": -3'),
    raw(', "n": true'),
    raw(', "stop": "' + "s" * 5000 + '"'),
    '{"model": "policy", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
]
VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2.5,
    -0.0,
    10**30,
    -(10**30),
    1e308,
    "",
    "x",
    "\ud800",
    [],
    [1],
    ["\ud800"],
    {},
    {"a": "\ud800"},
    [{"type": "text", "text": "\udfff"}],
    "a" * 5000,
]
FIELDS = [
    "n",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "tools",
    "messages",
    "model",
    "stream",
    "logprobs",
    "tool_choice",
    "user",
    "seed",
    "logit_bias",
]


async def test_malformed_numbers_and_strings_get_400s(tokenizer):
    """Huge, negative, fractional, non-finite and mistyped numbers, and lone surrogates in any
    string (keys too), are 4xx; today's 500s were a 400-digit `n` or `max_tokens` and a lone
    surrogate in `stop`. Then each field is fuzzed with odd values: never a 5xx."""
    async with (
        serving(tokenizer) as (endpoint, url, key),
        httpx.AsyncClient(trust_env=False, timeout=120) as http,
    ):
        auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        for text in MALFORMED:
            r = await http.post(url, content=text.encode(), headers=auth)
            assert r.status_code == 400, (text[:120], r.text[:300])
            assert len(r.text) < 2000 and r.json()["error"]["message"]
        rng = random.Random(0)
        for _ in range(300):
            fuzzed = body()
            for field in rng.sample(FIELDS, rng.randint(1, 3)):
                fuzzed[field] = rng.choice(VALUES)
            sent = json.dumps(fuzzed).encode("utf-8", "surrogatepass")
            r = await http.post(url, content=sent, headers=auth)
            assert r.status_code in (200, 400, 404), (fuzzed, r.status_code, r.text[:300])
        assert not any(k.startswith("status_5") for k in endpoint.counters)
        assert (await http.post(url, json=body(), headers=auth)).status_code == 200


async def test_fields_the_endpoint_does_not_honour_are_refused(tokenizer):
    """`logprobs` and `tool_choice` were dropped without a word. Each is now a 400 that names
    it, before the engine; the values that change nothing, and the fields that cannot matter,
    are served."""
    async with serving(tokenizer) as (endpoint, url, key):
        client = openai.AsyncOpenAI(base_url=url.rsplit("/chat", 1)[0], api_key=key, max_retries=0)
        refused = [
            {"stream_options": {"include_usage": True}},  # without stream
            {"stream": True, "stream_options": {"include_usage": True, "chunked": True}},
            {"logprobs": True},
            {"logprobs": True, "top_logprobs": 2},
            {"tool_choice": "required", "tools": [CALC]},
            {"tool_choice": "none", "tools": [CALC]},
            {"presence_penalty": 0.5},
            {"logit_bias": {"5": 10}},
            {"response_format": {"type": "json_object"}},
            {"extra_body": {"functions": [CALC["function"]]}},
            {"extra_body": {"top_k": 5}},
        ]
        served = [
            {"stream": False, "logprobs": False, "tool_choice": "auto", "tools": [CALC]},
            {"user": "u1", "seed": 7, "metadata": {"a": "b"}, "presence_penalty": 0.0},
            {"temperature": 1.0, "top_p": 1.0, "parallel_tool_calls": True},
        ]
        engine = endpoint.engine
        assert isinstance(engine, CallThenAnswerEngine)
        async with client:
            for extra in refused:
                with pytest.raises(openai.BadRequestError) as caught:
                    await client.chat.completions.create(**body(), **extra)
                assert next(iter(k for k in extra if k != "tools")) in str(caught.value) or (
                    "extra_body" in extra
                )
            assert engine.calls == []
            for extra in served:
                reply = await client.chat.completions.create(**body(), **extra)
                assert reply.choices[0].message.tool_calls
        assert len(engine.calls) == len(served)


def cut_row(tokenizer: Any) -> PromptItem:
    """The row of `cut_then_continue`: cut 4 ids after the tool call."""
    cut_at = len(tokenizer.encode(CALL, add_special_tokens=False)) + 4
    question = [ChatMessage("user", "What is 2+3?")]
    return PromptItem("g", 1, "test", question, "5", {"cut_at": cut_at})


async def cut_then_continue(client: openai.AsyncOpenAI, row: dict[str, Any]) -> list[Any]:
    """The first reply is cut at max_tokens right after a whole tool call; the agent runs the
    call anyway and asks again."""
    messages: list[Any] = list(row["messages"])
    reply = await client.chat.completions.create(
        model="policy", messages=messages, tools=[CALC], max_tokens=row["extra_info"]["cut_at"]
    )
    FINISHES.append(reply.choices[0].finish_reason)
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
    FINISHES.append(reply.choices[0].finish_reason)
    return [*messages, reply.choices[0].message.model_dump(exclude_none=True)]


FINISHES: list[str | None] = []


async def test_a_reply_cut_at_max_tokens_says_length_and_its_continuation_is_trained(tokenizer):
    """The cut reply says "length" (it used to say "tool_calls"), and the next request, which
    continues it, is not drift (the episode used to be refused): its prompt is the cut reply's
    ids, the template's end-of-turn id (context) and the tool turn, and both replies train."""
    FINISHES.clear()
    config = OpenAIConfig(enabled=True, agent=f"{__name__}:cut_then_continue")
    engine = CallThenAnswerEngine(tokenizer)
    loop = OpenAIAgentLoop(engine, tokenizer, PARAMS, config)
    row = cut_row(tokenizer)
    try:
        result = await loop.run(row)
    finally:
        await loop.close()
    assert FINISHES == ["length", "stop"]
    assert result.metrics["openai_drift"] == 0 and result.metrics["openai_refused"] == 0
    (first_prompt, first), (second_prompt, second) = engine.calls
    end = tokenizer.convert_tokens_to_ids("</s>")
    assert first.token_ids[-1] != end  # cut: the model never sampled its end
    turn = TurnRenderer(tokenizer, [CALC]).turn_ids([{"role": "tool", "content": "5"}], end)
    assert second_prompt == first_prompt + first.token_ids + [end] + turn
    question = [{"role": "user", "content": "What is 2+3?"}]
    assert result.prompt_ids == render_ids(tokenizer, question, [CALC]) == first_prompt
    n1, n2 = len(first.token_ids), len(second.token_ids)
    assert result.response_ids == second_prompt[len(first_prompt) :] + second.token_ids
    assert result.loss_mask == [1] * n1 + [0] * (1 + len(turn)) + [1] * n2
    assert result.logprobs[:n1] == first.logprobs and result.logprobs[-n2:] == second.logprobs


async def test_agent_requests_write_no_httpx_info_lines(tokenizer, caplog):
    """httpx logged one INFO line per agent request into the server's log (480 KB a demo)."""
    caplog.set_level(logging.INFO)
    FINISHES.clear()
    config = OpenAIConfig(enabled=True, agent=f"{__name__}:cut_then_continue")
    loop = OpenAIAgentLoop(CallThenAnswerEngine(tokenizer), tokenizer, PARAMS, config)
    row = cut_row(tokenizer)
    try:
        await loop.run(row)
    finally:
        await loop.close()
    assert len(FINISHES) == 2  # two requests went through the client
    noisy = [r for r in caplog.records if r.name.startswith(("httpx", "httpcore"))]
    assert all(r.levelno < logging.INFO for r in noisy), [r.getMessage() for r in noisy]


STREAMED: list[tuple[str | None, int | None]] = []


async def streams_until_answered(client: openai.AsyncOpenAI, row: dict[str, Any]) -> list[Any]:
    """A tool loop on `stream=True`, assembling each reply from its chunks as frameworks do."""
    messages: list[Any] = list(row["messages"])
    for _ in range(3):
        stream = await client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=[CALC],
            stream=True,
            stream_options={"include_usage": True},
        )
        content, calls, finish, used = "", {}, None, None
        async for chunk in stream:
            used = chunk.usage.completion_tokens if chunk.usage else used
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for c in choice.delta.tool_calls or []:
                    call = calls.setdefault(c.index, {"id": c.id, "type": "function"})
                    fn = call.setdefault("function", {"name": "", "arguments": ""})
                    if c.function is not None:
                        fn["name"] += c.function.name or ""
                        fn["arguments"] += c.function.arguments or ""
                finish = choice.finish_reason or finish
        STREAMED.append((finish, used))
        messages.append({"role": "assistant", "content": content or None})
        if calls:
            messages[-1]["tool_calls"] = list(calls.values())
        if finish != "tool_calls":
            return messages
        for call in calls.values():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "5"})
    return messages


async def test_a_streamed_tool_loop_is_recorded_token_exactly(tokenizer):
    """`stream=True` used to get a 200 and an empty stream while its completion was sampled
    and trained. Now the reply comes as server-sent events; the message the client assembles
    continues the recorded completion (no drift), and both replies train with the engine's
    ids and log-probs."""
    STREAMED.clear()
    config = OpenAIConfig(enabled=True, agent=f"{__name__}:streams_until_answered")
    engine = CallThenAnswerEngine(tokenizer)
    loop = OpenAIAgentLoop(engine, tokenizer, PARAMS, config)
    try:
        result = await loop.run(cut_row(tokenizer))
    finally:
        await loop.close()
    (_, first), (second_prompt, second) = engine.calls
    seen = list(STREAMED)  # (finish reason, usage's completion tokens) of each reply
    assert seen == [("tool_calls", len(first.token_ids)), ("stop", len(second.token_ids))]
    assert result.metrics["openai_drift"] == 0 and result.metrics["openai_completions"] == 2
    assert result.response_text == "The answer is 5"
    assert result.prompt_ids + result.response_ids == second_prompt + second.token_ids
    n1, n2 = len(first.token_ids), len(second.token_ids)
    assert sum(result.loss_mask) == n1 + n2
    assert result.logprobs[:n1] == first.logprobs and result.logprobs[-n2:] == second.logprobs
