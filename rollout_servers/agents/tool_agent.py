"""The tool agent loop: multi-turn generation with tool calls and a simulated user, token in and
token out.

One trajectory alternates assistant turns (sampled by the engine) with tool turns (the outputs
of the calls the model made, Hermes/Qwen format `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`, several per turn) and user turns (an interaction's reply to an answer without a
tool call). It ends when the model answers and no interaction asks for more ("stop"), a turn
is cut by its token limit or the response budget runs out ("length"), or a limit of
`rollout.tool_agent` is reached ("max_assistant_turns", "max_tool_calls", "max_user_turns").

Token in, token out. The trajectory is the prompt (chat template with the generation prompt)
followed by exactly the ids the engine sampled and the template ids of each tool or user turn;
decoded model text is parsed for tool calls but never tokenized again, so the learner trains on
the very ids the engine produced. A turn's ids come from
`rollout_servers.agents.turn_renderer.TurnRenderer`.

Invariants of every AgentResult:
- loss_mask is 1 exactly on ids the engine sampled; every tool, user and template id has 0.
- logprobs and versions are the engine's for sampled ids, 0.0 and -1 elsewhere.
- len(response_ids) <= limits.max_response_tokens: each turn samples at most what the budget
  has left, and a tool or user turn that would not leave room for one more sampled id ends the
  trajectory ("length") instead of being appended. It is never truncated: cut template ids
  would be a conversation the chat format cannot produce.
- response_text is the last assistant turn (decoded without special tokens): the final answer,
  which is what final-answer rewards (`#### N`, `\\boxed{}`, a code block) must read. Neither
  tool outputs nor earlier attempts can supply an answer the model's last turn did not give.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections import defaultdict
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from asyncrl.config.rollout import ToolAgentConfig
from asyncrl.wire.protocol import PromptItem
from rollout_servers.agents.base import AgentResult
from rollout_servers.agents.interactions import Interaction
from rollout_servers.agents.tools import ToolSet
from rollout_servers.agents.turn_renderer import TurnRenderer, render_ids
from rollout_servers.engines.base import Engine, GenerationOutput, SamplingParams

log = logging.getLogger("asyncrl.tool_agent")


# ---- tool calls in model text -----------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    error: str
    """Why the call could not be read (what the model sees as the call's output)."""


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every `<tool_call>{...}</tool_call>` in `text`, in order; `arguments` may be an object or
    a JSON string of one (Qwen emits both). An unclosed `<tool_call>` is a malformed call."""
    calls = [_parse_call(body) for body in _TOOL_CALL.findall(text)]
    if "<tool_call>" in _TOOL_CALL.sub("", text):
        calls.append(MalformedCall("a <tool_call> is not closed by </tool_call>"))
    return calls


def _parse_call(body: str) -> ToolCall | MalformedCall:
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as e:
        return MalformedCall(f"the tool call is not valid JSON: {e}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return MalformedCall('a tool call must be a JSON object with a "name" string')
    name, arguments = call["name"], call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError) as e:
            return MalformedCall(f"the arguments of {name!r} are a string but not JSON: {e}")
    if not isinstance(arguments, dict):
        return MalformedCall(f"the arguments of {name!r} must be a JSON object")
    return ToolCall(name, arguments)


# ---- the loop ---------------------------------------------------------------------------------
def row_agent_kwargs(prompt: PromptItem) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tools_kwargs, interaction_kwargs) of a row: the PromptItem's own fields when not empty,
    else the keys of the same names in extra_info (where verl's preprocessing puts them)."""
    found = []
    for key, own in (
        ("tools_kwargs", prompt.tools_kwargs),
        ("interaction_kwargs", prompt.interaction_kwargs),
    ):
        value = own or prompt.extra_info.get(key) or {}
        if not isinstance(value, dict):
            raise ValueError(f"a row's {key} must be a JSON object, got {value!r}")
        found.append(value)
    return found[0], found[1]


METRIC_KEYS = (
    "turns",  # engine calls
    "tool_calls",  # calls executed by a tool (timed out or failed included)
    "tool_errors",  # executed calls whose tool raised
    "tool_timeouts",  # executed calls cancelled after tool_timeout_s
    "malformed_calls",  # calls not run: bad JSON, no name, unknown tool, arguments off-schema
    "limited_calls",  # valid calls not run: max_parallel_calls or max_tool_calls reached
    "user_turns",  # interaction replies appended
    "tool_reward",  # sum of the tools' step rewards and calc_reward
    "interaction_reward",  # sum of the interaction's turn rewards
)
"""Metrics of every tool agent trajectory (plus `tool_<name>_<key>` and `interaction_<key>`
sums of what tools and interactions report)."""


@dataclass
class _Rollout:
    """The growing trajectory of one run, and its counters."""

    instance_id: str
    prompt_ids: list[int]
    messages: list[dict[str, str]]
    tools_kwargs: dict[str, Any]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    created_tools: list[str] = field(default_factory=list)
    last_answer: str = ""
    metrics: defaultdict[str, float] = field(
        default_factory=lambda: defaultdict(float, dict.fromkeys(METRIC_KEYS, 0.0))
    )

    def add_sampled(self, out: GenerationOutput) -> None:
        n = len(out.token_ids)
        self.response_ids += out.token_ids
        self.loss_mask += [1] * n
        self.logprobs += out.logprobs
        self.versions += out.versions

    def add_template(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)


class ToolAgentLoop:
    """Multi-turn agent loop with tools and interactions (module docstring: the token rules).

    Built with the agent registry's common keywords. One instance serves every concurrent
    trajectory of a server; tools and interactions keep per-trajectory state under a fresh
    instance id and are always released at the end, also when the trajectory fails.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        params: SamplingParams,
        tools: ToolSet | None = None,
        interactions: Mapping[str, Interaction] | None = None,
        limits: ToolAgentConfig | None = None,
    ):
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.tools = tools or ToolSet([])
        self.interactions = dict(interactions or {})
        self.limits = limits or ToolAgentConfig()
        self.renderer = TurnRenderer(tokenizer, self.tools.schemas)

    async def run(self, prompt: PromptItem, params: SamplingParams | None = None) -> AgentResult:
        tools_kwargs, interaction_kwargs = row_agent_kwargs(prompt)
        messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
        prompt_ids = render_ids(self.tokenizer, messages, self.tools.schemas)
        r = _Rollout(uuid.uuid4().hex, prompt_ids, messages, tools_kwargs)
        interaction = self._maybe_start_interaction(r, interaction_kwargs, prompt.ground_truth)
        try:
            finish_reason = await self._converse(r, params or self.params, interaction)
            for name in r.created_tools:
                r.metrics["tool_reward"] += self.tools.tools[name].calc_reward(r.instance_id) or 0.0
        finally:
            for name in r.created_tools:
                self.tools.tools[name].release(r.instance_id)
            if interaction is not None:
                interaction.finish(r.instance_id)
        return AgentResult(
            prompt_ids,
            r.response_ids,
            r.loss_mask,
            r.logprobs,
            r.versions,
            r.last_answer,
            finish_reason,
            {k: float(v) for k, v in r.metrics.items()},
        )

    def _maybe_start_interaction(
        self, r: _Rollout, kwargs: dict[str, Any], ground_truth: str
    ) -> Interaction | None:
        """The row's interaction, started (kwargs default `ground_truth` to the row's), or None
        when the row names none."""
        if not kwargs:
            return None
        name = kwargs.get("name")
        if name not in self.interactions:
            raise ValueError(
                f"a row asks for interaction {name!r}; this server offers {sorted(self.interactions)}"
            )
        start_kwargs = {"ground_truth": ground_truth, **kwargs}
        start_kwargs.pop("name")
        self.interactions[name].start(r.instance_id, **start_kwargs)
        return self.interactions[name]

    async def _converse(
        self, r: _Rollout, params: SamplingParams, interaction: Interaction | None
    ) -> str:
        """Alternate sampled turns with tool or user turns until one ends the trajectory; the
        finish reason."""
        limits = self.limits
        while True:
            budget = limits.max_response_tokens - len(r.response_ids)
            turn_params = replace(params, max_new_tokens=min(params.max_new_tokens, budget))
            out = await self.engine.generate(r.prompt_ids + r.response_ids, turn_params)
            r.add_sampled(out)
            r.metrics["turns"] += 1
            r.last_answer = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            r.messages.append({"role": "assistant", "content": r.last_answer})
            if out.finish_reason != "stop":
                return "length"
            calls = parse_tool_calls(r.last_answer)
            if calls:
                if r.metrics["turns"] >= limits.max_assistant_turns:
                    return "max_assistant_turns"
                if r.metrics["tool_calls"] >= limits.max_tool_calls:
                    return "max_tool_calls"
                new = await self._run_calls(r, calls)
            else:
                if interaction is None:
                    return "stop"
                reply = await interaction.respond(r.instance_id, list(r.messages))
                r.metrics["interaction_reward"] += reply.turn_reward
                for key, value in reply.metrics.items():
                    r.metrics[f"interaction_{key}"] += value
                if reply.should_stop:
                    return "stop"
                if r.metrics["user_turns"] >= limits.max_user_turns:
                    return "max_user_turns"
                if r.metrics["turns"] >= limits.max_assistant_turns:
                    return "max_assistant_turns"
                r.metrics["user_turns"] += 1
                new = [{"role": "user", "content": reply.reply}]
            ids = self.renderer.turn_ids(new, after_id=out.token_ids[-1])
            if len(ids) >= limits.max_response_tokens - len(r.response_ids):
                return "length"
            r.add_template(ids)
            r.messages += new

    async def _run_calls(
        self, r: _Rollout, calls: list[ToolCall | MalformedCall]
    ) -> list[dict[str, str]]:
        """One tool message per call, in call order; valid calls within the per-turn and
        per-trajectory limits run concurrently, every other call gets an error output."""
        limits = self.limits
        allowance = min(limits.max_parallel_calls, limits.max_tool_calls - r.metrics["tool_calls"])
        outputs: list[str] = [""] * len(calls)
        running: dict[int, Coroutine[Any, Any, str]] = {}
        for i, call in enumerate(calls):
            if isinstance(call, MalformedCall):
                error: str | None = call.error
            else:
                error = self.tools.check_call(call.name, call.arguments)
            if error or isinstance(call, MalformedCall):
                r.metrics["malformed_calls"] += 1
                outputs[i] = f"Error: {error}"
            elif len(running) >= allowance:
                r.metrics["limited_calls"] += 1
                outputs[i] = (
                    f"Error: not run: at most {limits.max_parallel_calls} tool calls per turn "
                    f"and {limits.max_tool_calls} per trajectory"
                )
            else:
                running[i] = self._execute(r, call)
        for i, text in zip(running, await asyncio.gather(*running.values()), strict=True):
            outputs[i] = text
        return [{"role": "tool", "content": text} for text in outputs]

    async def _execute(self, r: _Rollout, call: ToolCall) -> str:
        """The output of one valid call: the tool's text, or an error text when it times out or
        raises (a tool's own bug must not end the trajectory, let alone the server)."""
        tool = self.tools.tools[call.name]
        r.metrics["tool_calls"] += 1
        try:
            if call.name not in r.created_tools:
                tool.create(r.instance_id, **_create_kwargs(r.tools_kwargs, call.name))
                r.created_tools.append(call.name)
            response = await asyncio.wait_for(
                tool.execute(r.instance_id, call.arguments), self.limits.tool_timeout_s
            )
        except asyncio.TimeoutError:
            r.metrics["tool_timeouts"] += 1
            return f"Error: tool {call.name!r} timed out after {self.limits.tool_timeout_s:g} s"
        except Exception as e:
            r.metrics["tool_errors"] += 1
            log.warning("tool %r failed: %r", call.name, e)
            return f"Error: tool {call.name!r} failed: {type(e).__name__}: {e}"
        if response.reward is not None:
            r.metrics["tool_reward"] += response.reward
        for key, value in response.metrics.items():
            r.metrics[f"tool_{call.name}_{key}"] += value
        return response.text


def _create_kwargs(tools_kwargs: dict[str, Any], name: str) -> dict[str, Any]:
    """verl's per-row layout: `tools_kwargs[name]["create_kwargs"]`."""
    entry = tools_kwargs.get(name) or {}
    kwargs = entry.get("create_kwargs") if isinstance(entry, dict) else None
    return kwargs if isinstance(kwargs, dict) else {}
