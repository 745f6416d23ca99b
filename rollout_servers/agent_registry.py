"""Agent loops by name: which loop turns a prompt into a trajectory, chosen per row.

A loop is registered under a short name (`@register_agent_loop("name")` over a class or a factory)
or named by import path (`package.module:ClassName`). Every loop is built with the same keyword
arguments, so the server can build any of them without knowing which:

    factory(engine=..., tokenizer=..., params=..., tools=..., interactions=..., limits=...)

`single_turn` ignores `tools`, `interactions` and `limits`. A row picks its loop by `agent_name`
(verl's column); rows without one get the server's default (`pick_agent_loop`). Rows may only
name registered loops: an import path is accepted from the configuration, never from data, so a
dataset cannot make the server import arbitrary modules.

Built-ins are registered as import paths and imported on first use, so importing this module
has no side effects and never imports the loops (which import this module's resolver).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from rollout_servers.agent_loop import AgentLoop, SingleTurnAgentLoop
from rollout_servers.engine import Engine, SamplingParams

if TYPE_CHECKING:
    from asyncrl.protocol import PromptItem
    from rollout_servers.agent_loop import AgentResult
    from rollout_servers.interactions import Interaction
    from rollout_servers.tool_agent import ToolAgentLimits
    from rollout_servers.tools import ToolSet

AgentLoopFactory = Callable[..., AgentLoop]
"""Called with the keywords engine, tokenizer, params, tools, interactions, limits."""

T = TypeVar("T")


def resolve_registered(kind: str, registry: Mapping[str, T | str], name_or_path: str) -> T:
    """`registry[name]`, or the object at `package.module:Attr`; a registered value that is a
    string is itself such a path (a lazily imported built-in). Raises ValueError naming the
    registered names when `name_or_path` is neither."""
    target: Any = registry.get(name_or_path, name_or_path)
    if not isinstance(target, str):
        return target
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"unknown {kind} {name_or_path!r}: registered are {sorted(registry)}, "
            "or give an import path like package.module:ClassName"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"{kind} {name_or_path!r}: cannot import {module_name!r}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{kind} {name_or_path!r}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj  # type: ignore[return-value]


def setup_single_turn_agent_loop(
    *,
    engine: Engine,
    tokenizer: Any,
    params: SamplingParams,
    tools: ToolSet | None = None,
    interactions: Mapping[str, Interaction] | None = None,
    limits: ToolAgentLimits | None = None,
) -> AgentLoop:
    """`SingleTurnAgentLoop` under the common keywords (it has no use for tools or limits)."""
    return SingleTurnAgentLoop(engine, tokenizer, params)


AGENT_LOOPS: dict[str, AgentLoopFactory | str] = {
    "single_turn": setup_single_turn_agent_loop,
    "tool_agent": "rollout_servers.tool_agent:ToolAgentLoop",
}
"""Registered agent loops: name -> factory, or -> import path of a built-in."""


def register_agent_loop(name: str) -> Callable[[T], T]:
    """Decorator: `@register_agent_loop("my_loop")` over a class or factory that accepts the
    common keywords; rows can then pick it with `agent_name: my_loop`."""

    def wrap(factory: T) -> T:
        AGENT_LOOPS[name] = factory  # type: ignore[assignment]
        return factory

    return wrap


def resolve_agent_loop(name_or_path: str) -> AgentLoopFactory:
    """The factory registered as `name_or_path`, or the one at `package.module:ClassName`."""
    factory = resolve_registered("agent loop", AGENT_LOOPS, name_or_path)
    if not callable(factory):
        raise ValueError(f"agent loop {name_or_path!r} is not callable: {factory!r}")
    return factory


def pick_agent_loop(agent_name: str | None, default_name: str) -> AgentLoopFactory:
    """The loop for a row: its `agent_name` when set (a registered name, or the default itself),
    else the server's `default_name` (a registered name or an import path)."""
    if agent_name and agent_name != default_name and agent_name not in AGENT_LOOPS:
        raise ValueError(
            f"row names agent loop {agent_name!r}; rows may name only registered loops "
            f"{sorted(AGENT_LOOPS)} or the configured default {default_name!r}"
        )
    return resolve_agent_loop(agent_name or default_name)


class AgentLoopRouter:
    """An `AgentLoop` that hands each prompt to the loop its row names (one instance per name,
    built on first use with the common keywords and reused for every later row).

    A row's `prompt.agent_name` picks its loop ("": the default). The default is resolved
    here, so a bad `rollout.agent_loop` fails at start-up.
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
        limits: ToolAgentLimits | None = None,
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
        self._loops: dict[str, AgentLoop] = {}

    def loop_for(self, agent_name: str | None) -> AgentLoop:
        name = agent_name or self.default_name
        if name not in self._loops:
            self._loops[name] = pick_agent_loop(name, self.default_name)(**self._loop_kwargs)
        return self._loops[name]

    async def run(self, prompt: PromptItem, params: SamplingParams | None = None) -> AgentResult:
        return await self.loop_for(prompt.agent_name).run(prompt, params)
