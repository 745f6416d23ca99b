"""The search demo's agent (rollout_servers/agents/search_agent.py) through the `openai` loop:
the real `openai` client, a real socket, the real `search` tool over the committed corpus, and
a scripted engine that searches for the name in the question and then copies what it read.
Also the loop's contract for what an agent returns: keyword arguments from the config, a dict
with the agent's own metrics, and a malformed dict counted as an agent error."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from asyncrl.config.rollout import OpenAIConfig
from asyncrl.demo.search_task import SearchQATask
from asyncrl.demo.tiny_model import build_tokenizer
from asyncrl.wire.protocol import ChatMessage, PromptItem
from rollout_servers.agents.openai_agent import OpenAIAgentLoop
from rollout_servers.agents.search_agent import toolset
from rollout_servers.engines.base import (
    AppliedVersion,
    Engine,
    GenerationOutput,
    SamplingParams,
    SyncTarget,
)

pytestmark = pytest.mark.integration

TOOLS = "configs/tools/search_demo.yaml"
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=200)


class SearchScriptEngine(Engine):
    """No tool turn in the prompt: a `search` call for the question's name (`query`
    overrides it). After one: the last four-digit number of the prompt. Replies end in `</s>`."""

    def __init__(self, tokenizer: Any, query: str | None = None):
        self.tokenizer, self.query = tokenizer, query
        self.tool_id = tokenizer.convert_tokens_to_ids("<|tool|>")
        self.context_tokens = 256

    @property
    def version(self) -> int:
        return 1

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        if self.tool_id not in prompt_ids:
            name = self.query or re.search(r"code of (\w+)\?", text).group(1)  # type: ignore[union-attr]
            call = {"name": "search", "arguments": {"query": name}}
            reply = f"<tool_call>{json.dumps(call)}</tool_call>"
        else:
            reply = re.findall(r"\d{4}", text)[-1] if re.findall(r"\d{4}", text) else "0000"
        ids = self.tokenizer.encode(reply + "</s>", add_special_tokens=False)
        return GenerationOutput(ids, [-0.5] * len(ids), 1, "stop")

    def follow_learner(self, target: SyncTarget) -> Iterator[AppliedVersion]:
        raise RuntimeError("a scripted engine has no weights")


def question(task: SearchQATask, i: int) -> PromptItem:
    row = task.row(i)
    messages = [ChatMessage(**m) for m in row["prompt"]]
    return PromptItem("g", 1, row["data_source"], messages, row["reward_model"]["ground_truth"], {})


def make_loop(engine: Engine, agent: str, **kwargs: Any) -> OpenAIAgentLoop:
    config = OpenAIConfig(enabled=True, agent=agent, agent_kwargs=kwargs)
    return OpenAIAgentLoop(engine, build_tokenizer(), PARAMS, config)


async def test_the_search_agent_finds_the_code_and_trains_only_on_sampled_tokens():
    task, tokenizer = SearchQATask(), build_tokenizer()
    agent = "rollout_servers.agents.search_agent:answer_with_search"
    loop = make_loop(SearchScriptEngine(tokenizer), agent, tool_config=TOOLS)
    try:
        for i in (0, 57, 199):
            item = question(task, i)
            result = await loop.run(item)
            m = result.metrics
            assert result.response_text == item.ground_truth
            assert (m["agent_tool_calls"], m["agent_useful_search"], m["openai_drift"]) == (1, 1, 0)
            assert m["openai_completions"] == 2 and m["agent_refused_calls"] == 0
            tool_turn = task.tool_response(task.facts[i][0])
            masked = tokenizer.decode(
                [t for t, k in zip(result.response_ids, result.loss_mask, strict=True) if k == 0]
            )
            assert tool_turn in masked  # the tool's passage is context, never trained
            trained = tokenizer.decode(
                [t for t, k in zip(result.response_ids, result.loss_mask, strict=True) if k == 1]
            )
            assert tool_turn not in trained and trained.endswith(item.ground_truth + "</s>")
        stats = loop.stats()  # the server's stats() carries these
        assert (stats["openai_episodes"], stats["openai_requests"]) == (3, 6)
        assert stats["openai_agent_errors"] == stats["openai_drift"] == 0
    finally:
        await loop.close()


async def test_a_search_with_no_result_is_not_useful():
    task, tokenizer = SearchQATask(), build_tokenizer()
    agent = "rollout_servers.agents.search_agent:answer_with_search"
    loop = make_loop(SearchScriptEngine(tokenizer, query="qqqqqq"), agent, tool_config=TOOLS)
    try:
        result = await loop.run(question(task, 3))
        assert result.metrics["agent_tool_calls"] == 1
        assert result.metrics["agent_useful_search"] == 0
        assert result.response_text != task.facts[3][1]
    finally:
        await loop.close()


def test_the_demo_tool_answers_what_the_warm_start_shows():
    """The warm-start's tool messages are the real tool's answers (names and misspellings)."""
    import asyncio
    import random

    task, tool = SearchQATask(), toolset(TOOLS).tools["search"]
    rng = random.Random(0)
    seen = 0
    for _ in range(400):
        demo = task.demonstration(rng, 0.0)
        if len(demo) == 4:
            query = json.loads(demo[1]["content"][len("<tool_call>") : -len("</tool_call>")])
            answer = asyncio.run(tool.execute("", query["arguments"])).text
            assert demo[2]["content"] == answer
            seen += 1
    assert seen > 50


# ---- what an agent may return ------------------------------------------------------------------
async def returns_dict(client: openai.AsyncOpenAI, row: dict[str, Any], bonus: float) -> Any:
    await client.chat.completions.create(model="policy", messages=row["messages"])
    return {"reward": bonus, "metrics": {"steps": 3}}


async def returns_bad_dict(client: openai.AsyncOpenAI, row: dict[str, Any]) -> Any:
    return {"reward": 1.0, "score": 2}


async def returns_bad_metrics(client: openai.AsyncOpenAI, row: dict[str, Any]) -> Any:
    return {"reward": 1.0, "metrics": {"steps": "three"}}


async def test_agent_kwargs_and_a_dict_with_metrics_reach_the_trajectory():
    loop = make_loop(SearchScriptEngine(build_tokenizer()), f"{__name__}:returns_dict", bonus=0.5)
    try:
        result = await loop.run(question(SearchQATask(), 0))
        assert result.reward == 0.5 and result.metrics["agent_steps"] == 3
        assert result.metrics["openai_agent_errors"] == 0
    finally:
        await loop.close()


@pytest.mark.parametrize("agent", ["returns_bad_dict", "returns_bad_metrics"])
async def test_a_malformed_dict_is_an_agent_error_scoring_zero(agent):
    loop = make_loop(SearchScriptEngine(build_tokenizer()), f"{__name__}:{agent}")
    try:
        result = await loop.run(question(SearchQATask(), 0))
        assert result.reward == 0.0 and result.metrics["openai_agent_errors"] == 1
        assert not any(k.startswith("agent_") for k in result.metrics)
        assert loop.stats()["openai_agent_errors"] == 1
    finally:
        await loop.close()
