"""A search agent written against the OpenAI client, as a user would write one: the search
demo's agent (`configs/search_agent.yaml`, docs/agents.md), run by the `openai` agent loop.

    rollout:
      agent_loop: openai
      openai:
        enabled: true
        agent: rollout_servers.agents.search_agent:answer_with_search
        agent_kwargs: {tool_config: configs/tools/search_demo.yaml}

Per episode it asks the model (offering the tools of `tool_config`, in the OpenAI `tools`
layout), runs every tool call of a reply itself, sends the results back as `tool` messages,
and stops at the first reply without a tool call or after `max_turns` replies. It returns the
messages, so the server's reward function scores the last reply, and its own metrics: the
calls it made, the ones refused (unknown tool, bad arguments), and whether a search result held
the expected answer (`useful_search`, for the report; it does not touch the reward).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from rollout_servers.agents.tools import ToolSet, load_tool_config

_TOOLSETS: dict[str, ToolSet] = {}


def toolset(path: str) -> ToolSet:
    """The tools of the YAML file at `path`, loaded once per process (a search index is built
    once per server, as the tool agent's are)."""
    if path not in _TOOLSETS:
        _TOOLSETS[path] = load_tool_config(path)
    return _TOOLSETS[path]


async def answer_with_search(
    client: Any, row: dict[str, Any], tool_config: str, max_turns: int = 2, max_tokens: int = 96
) -> dict[str, Any]:
    """One episode (module docstring)."""
    tools = toolset(tool_config)
    messages: list[dict[str, Any]] = list(row["messages"])
    calls = refused = useful = 0.0
    for _ in range(max_turns):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=tools.schemas, max_tokens=max_tokens
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            calls += 1
            text = await _run(tools, call.function.name, call.function.arguments)
            if text is None:
                refused += 1
                text = "Error: that call cannot run"
            elif row["ground_truth"] and row["ground_truth"] in text:
                useful = 1.0
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    metrics = {"tool_calls": calls, "refused_calls": refused, "useful_search": useful}
    return {"messages": messages, "metrics": metrics}


async def _run(tools: ToolSet, name: str, arguments: str) -> str | None:
    """The tool's answer, or None when the call cannot run (bad JSON, unknown tool, arguments
    that do not match its schema)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    if tools.check_call(name, parsed) is not None:
        return None
    tool, instance = tools.tools[name], uuid.uuid4().hex
    tool.create(instance)
    try:
        return (await tool.execute(instance, parsed)).text
    finally:
        tool.release(instance)
