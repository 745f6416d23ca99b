"""Agent loops by name: which loop turns a prompt into a trajectory, chosen per row.

A loop is registered under a short name (`@AGENT_LOOPS.register("name")` over a class or a
factory) or named by import path (`package.module:ClassName`). Every loop is built with the same
keyword arguments, so the server can build any of them without knowing which:

    factory(engine=..., tokenizer=..., params=..., tools=..., interactions=..., limits=...)

`single_turn` ignores `tools`, `interactions` and `limits`. A row picks its loop by `agent_name`
(verl's column); rows without one get the server's default (`pick_agent_loop`). Rows may only
name registered loops: an import path is accepted from the configuration, never from data, so a
dataset cannot make the server import arbitrary modules.

Built-ins are registered as import paths and imported on first use, so this module imports no
loop (and no loop imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from asyncrl.config.rollout import ToolAgentConfig
from asyncrl.registry import Registry
from asyncrl.wire.protocol import PromptItem
from rollout_servers.agents.base import AgentLoop, AgentResult
from rollout_servers.agents.interactions import Interaction
from rollout_servers.agents.tools import ToolSet
from rollout_servers.engines.base import Engine, SamplingParams

AgentLoopFactory = Callable[..., AgentLoop]
"""Called with the keywords engine, tokenizer, params, tools, interactions, limits."""

AGENT_LOOPS: Registry[AgentLoopFactory] = Registry("agent loop", "asyncrl.agent_loops")
"""Registered agent loops (also from the `asyncrl.agent_loops` entry points of packages)."""
AGENT_LOOPS.register("single_turn", "rollout_servers.agents.single_turn:SingleTurnAgentLoop")
AGENT_LOOPS.register("tool_agent", "rollout_servers.agents.tool_agent:ToolAgentLoop")
AGENT_LOOPS.register("openai", "rollout_servers.agents.openai_agent:OpenAIAgentLoop")

register_agent_loop = AGENT_LOOPS.register
"""`@register_agent_loop("my_loop")` over a class or factory that accepts the common keywords;
rows can then pick it with `agent_name: my_loop`."""


def resolve_agent_loop(name_or_path: str) -> AgentLoopFactory:
    """The factory registered as `name_or_path`, or the one at `package.module:ClassName`."""
    factory = AGENT_LOOPS.resolve(name_or_path)
    if not callable(factory):
        raise ValueError(f"agent loop {name_or_path!r} is not callable: {factory!r}")
    return factory


def pick_agent_loop(agent_name: str | None, default_name: str) -> AgentLoopFactory:
    """The loop for a row: its `agent_name` when set (a registered name, or the default itself),
    else the server's `default_name` (a registered name or an import path)."""
    if agent_name and agent_name != default_name and agent_name not in AGENT_LOOPS:
        raise ValueError(
            f"row names agent loop {agent_name!r}; rows may name only registered loops "
            f"{AGENT_LOOPS.names()} or the configured default {default_name!r}"
        )
    return resolve_agent_loop(agent_name or default_name)


class AgentLoopRouter:
    """An `AgentLoop` that hands each prompt to the loop its row names (one instance per name,
    built on first use with the common keywords and reused for every later row).

    A row's `prompt.agent_name` picks its loop ("": the default). The default is resolved
    here, so a bad `rollout.agent_loop` fails at start-up. `loops`: loops the server built
    itself, by name (`openai`, which needs its own config section), used instead of building.
    """

    def __init__(
        self,
        default_name: str,
        *,
        engine: Engine,
        tokenizer: Any,
        params: SamplingParams,
        tools: ToolSet | None = None,
        interactions: Mapping[str, Interaction] | None = None,
        limits: ToolAgentConfig | None = None,
        loops: Mapping[str, AgentLoop] | None = None,
    ):
        resolve_agent_loop(default_name)
        self.default_name = default_name
        self._loop_kwargs: dict[str, Any] = dict(
            engine=engine,
            tokenizer=tokenizer,
            params=params,
            tools=tools,
            interactions=interactions,
            limits=limits,
        )
        self._loops: dict[str, AgentLoop] = dict(loops or {})

    def loop_for(self, agent_name: str | None) -> AgentLoop:
        name = agent_name or self.default_name
        if name not in self._loops:
            self._loops[name] = pick_agent_loop(name, self.default_name)(**self._loop_kwargs)
        return self._loops[name]

    async def run(self, prompt: PromptItem, params: SamplingParams | None = None) -> AgentResult:
        return await self.loop_for(prompt.agent_name).run(prompt, params)

    def stats(self) -> dict[str, float]:
        """The running counts of the loops that keep some (the `openai` loop's)."""
        out: dict[str, float] = {}
        for loop in self._loops.values():
            stats = getattr(loop, "stats", None)
            if stats is not None:
                out.update(stats())
        return out

    async def close(self) -> None:
        """Close the loops that hold resources (the `openai` loop's endpoint)."""
        for loop in self._loops.values():
            close = getattr(loop, "close", None)
            if close is not None:
                await close()
