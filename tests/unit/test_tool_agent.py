"""The tool agent loop against a scripted engine and the real char tokenizer: token in / token
out, masks token by token, tool-call errors, concurrency, limits, interactions, the registry."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any, Literal

import pytest

from asyncrl.config.rollout import ToolAgentConfig
from asyncrl.demo.tiny_model import CHAT_TEMPLATE, build_tokenizer
from asyncrl.wire.protocol import ChatMessage, PromptItem
from rollout_servers.agents.base import AgentResult
from rollout_servers.agents.calculator_tool import CalculatorTool
from rollout_servers.agents.interactions import (
    Gsm8kRetryInteraction,
    final_number,
    load_interaction_config,
)
from rollout_servers.agents.registry import (
    AGENT_LOOPS,
    AgentLoopRouter,
    pick_agent_loop,
    register_agent_loop,
    resolve_agent_loop,
)
from rollout_servers.agents.single_turn import SingleTurnAgentLoop
from rollout_servers.agents.tool_agent import (
    MalformedCall,
    ToolAgentLoop,
    ToolCall,
    parse_tool_calls,
)
from rollout_servers.agents.tools import Tool, ToolResponse, ToolSet
from rollout_servers.agents.turn_renderer import TemplateNotPrefixStableError, TurnRenderer
from rollout_servers.engines.base import (
    AppliedVersion,
    Engine,
    GenerationOutput,
    SamplingParams,
    SyncTarget,
)

VERSION = 7
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=400)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def enc(tokenizer, text: str) -> list[int]:
    """Ids of `text`, special tokens (`</s>`, role markers) read as their single ids."""
    return tokenizer.encode(text, add_special_tokens=False)


class ScriptedEngine(Engine):
    """Returns the scripted ids of call k on the k-th generate (cut to max_new_tokens, then
    finishing by "length"), with log-prob -(k + 1 + j / 1000) for its j-th id."""

    def __init__(self, script: list[list[int]], finish: Literal["stop", "length"] = "stop"):
        self.script, self.finish = script, finish
        self.calls: list[tuple[list[int], SamplingParams]] = []

    @property
    def version(self) -> int:
        return VERSION

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        k = len(self.calls)
        self.calls.append((list(prompt_ids), params))
        ids = self.script[k]
        cut = ids[: params.max_new_tokens]
        reason: Literal["stop", "length"] = self.finish if len(cut) == len(ids) else "length"
        return GenerationOutput(
            cut, [-(k + 1 + j / 1000) for j in range(len(cut))], VERSION, reason
        )

    def follow_learner(self, target: SyncTarget) -> Iterator[AppliedVersion]:
        raise RuntimeError("a scripted engine has no weights to update")


class SleepTool(Tool):
    """Sleeps `seconds`, then echoes `arguments["x"]`; records per-trajectory state."""

    def __init__(self, name: str, seconds: float = 0.0, fail: bool = False):
        super().__init__(_schema(name, {"x": {"type": "string"}}, ["x"]))
        self.seconds, self.fail = seconds, fail
        self.created: dict[str, dict[str, Any]] = {}
        self.released: list[str] = []

    def create(self, instance_id: str, **create_kwargs: Any) -> None:
        self.created[instance_id] = create_kwargs

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        await asyncio.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("broken tool")
        return ToolResponse(f"echo {arguments['x']}", reward=0.5, metrics={"echoes": 1.0})

    def calc_reward(self, instance_id: str) -> float | None:
        return 2.0 if self.created[instance_id].get("bonus") else None

    def release(self, instance_id: str) -> None:
        self.released.append(instance_id)


def _schema(name: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name} tool",
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def calculator() -> CalculatorTool:
    return CalculatorTool(_schema("calculator", {"expression": {"type": "string"}}, ["expression"]))


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def prompt(ground_truth: str = "5", wire: dict[str, Any] | None = None, **extra: Any) -> PromptItem:
    return PromptItem(
        group_id="g",
        n=1,
        data_source="test",
        messages=[ChatMessage("user", "What is 2+3?")],
        ground_truth=ground_truth,
        extra_info=extra,
        **(wire or {}),
    )


def make_loop(tokenizer, script: list[str | list[int]], tools=(), interactions=None, **limits):
    engine = ScriptedEngine([s if isinstance(s, list) else enc(tokenizer, s) for s in script])
    loop = ToolAgentLoop(
        engine, tokenizer, PARAMS, ToolSet(tools), interactions, ToolAgentConfig(**limits)
    )
    return loop, engine


def tool_outputs(tokenizer, result: AgentResult) -> list[str]:
    """The tool messages of a trajectory, read back from its ids."""
    text = tokenizer.decode(result.response_ids, skip_special_tokens=False)
    return [part.split("</s>")[0] for part in text.split("<|tool|>")[1:]]


def assert_aligned(result: AgentResult, engine: ScriptedEngine) -> None:
    """Token by token: the sampled ids of call k sit where the loop put them, with mask 1, the
    engine's log-probs and version; every other id has mask 0, log-prob 0.0, version -1."""
    n = len(result.response_ids)
    assert len(result.loss_mask) == len(result.logprobs) == len(result.versions) == n
    sampled = 0
    for k, (prompt_ids, params) in enumerate(engine.calls):
        start = len(prompt_ids) - len(result.prompt_ids)
        assert prompt_ids == result.prompt_ids + result.response_ids[:start]
        ids = engine.script[k][: params.max_new_tokens]
        assert result.response_ids[start : start + len(ids)] == ids
        for j in range(len(ids)):
            assert result.loss_mask[start + j] == 1
            assert result.logprobs[start + j] == -(k + 1 + j / 1000)
            assert result.versions[start + j] == VERSION
        sampled += len(ids)
    assert sum(result.loss_mask) == sampled
    for mask, lp, version in zip(result.loss_mask, result.logprobs, result.versions, strict=True):
        if mask == 0:
            assert (lp, version) == (0.0, -1)


async def test_one_call_appends_tool_turn_ids(tokenizer):
    first = call("calculator", expression="2+3") + "</s>"
    loop, engine = make_loop(tokenizer, [first, "#### 5</s>"], [calculator()])
    result = await loop.run(prompt())
    # built independently of the loop: prompt, sampled ids, the tool turn, sampled ids
    assert result.prompt_ids == enc(tokenizer, "<|user|>What is 2+3?</s><|assistant|>")
    tool_turn = enc(tokenizer, "<|tool|>5</s><|assistant|>")
    expected = enc(tokenizer, first) + tool_turn + enc(tokenizer, "#### 5</s>")
    assert result.response_ids == expected
    n1 = len(enc(tokenizer, first))
    assert result.loss_mask == [1] * n1 + [0] * len(tool_turn) + [1] * 7
    assert_aligned(result, engine)
    assert result.finish_reason == "stop"
    assert result.response_text == "#### 5"
    assert result.metrics["turns"] == 2 and result.metrics["tool_calls"] == 1
    assert result.metrics["malformed_calls"] == 0 and result.metrics["tool_errors"] == 0


async def test_sampled_ids_are_kept_not_retokenized(tokenizer):
    # a role marker inside the sampled text: decode (skipping specials) then encode would lose it
    first = enc(tokenizer, "ok<|user|>") + enc(tokenizer, call("calculator", expression="1+1"))
    first += [tokenizer.eos_token_id]
    text = tokenizer.decode(first, skip_special_tokens=True)
    assert enc(tokenizer, text) + [tokenizer.eos_token_id] != first
    loop, engine = make_loop(tokenizer, [first, "done</s>"], [calculator()])
    result = await loop.run(prompt())
    assert result.response_ids[: len(first)] == first
    assert tokenizer.convert_tokens_to_ids("<|user|>") in result.response_ids[:3]
    assert tool_outputs(tokenizer, result) == ["2"]
    assert_aligned(result, engine)


async def test_calls_of_one_turn_run_concurrently_in_order(tokenizer):
    a, b = SleepTool("a", 0.2), SleepTool("b", 0.2)
    turn = call("a", x="1") + call("b", x="2") + "</s>"
    loop, engine = make_loop(tokenizer, [turn, "fin</s>"], [a, b])
    start = time.perf_counter()
    result = await loop.run(prompt())
    assert time.perf_counter() - start < 0.35
    assert tool_outputs(tokenizer, result) == ["echo 1", "echo 2"]
    # two tool messages rendered as one turn, then the generation prompt
    turn_ids = enc(tokenizer, "<|tool|>echo 1</s><|tool|>echo 2</s><|assistant|>")
    n = len(enc(tokenizer, turn))
    assert result.response_ids[n : n + len(turn_ids)] == turn_ids
    assert result.metrics["tool_calls"] == 2
    assert result.metrics["tool_reward"] == 1.0 and result.metrics["tool_a_echoes"] == 1.0
    assert_aligned(result, engine)


async def test_malformed_calls_get_error_outputs_and_the_loop_goes_on(tokenizer):
    turn = (
        "<tool_call>{not json}</tool_call>"
        + call("nope", x="1")
        + call("a", y="1")
        + call("a", x=3)
        + '<tool_call>{"arguments": {}}</tool_call>'
        + '<tool_call>{"name": "a", "arguments": "{\\"x\\": \\"s\\"}"}</tool_call>'
        + "</s>"
    )
    tool = SleepTool("a")
    loop, engine = make_loop(tokenizer, [turn, "fin</s>"], [tool])
    result = await loop.run(prompt())
    outputs = tool_outputs(tokenizer, result)
    assert "not valid JSON" in outputs[0]
    assert "unknown tool 'nope'" in outputs[1] and "['a']" in outputs[1]
    assert "missing the required property 'x'" in outputs[2]
    assert "arguments.x must be string, got integer" in outputs[3]
    assert '"name" string' in outputs[4]
    assert outputs[5] == "echo s"  # arguments given as a JSON string
    assert all(o.startswith("Error: ") for o in outputs[:5])
    assert result.metrics["malformed_calls"] == 5 and result.metrics["tool_calls"] == 1
    assert result.finish_reason == "stop" and result.response_text == "fin"
    assert_aligned(result, engine)


async def test_timeouts_and_tool_exceptions_become_outputs(tokenizer):
    slow, broken = SleepTool("slow", 5.0), SleepTool("broken", fail=True)
    turn = call("slow", x="1") + call("broken", x="2") + "</s>"
    loop, _ = make_loop(tokenizer, [turn, "fin</s>"], [slow, broken], tool_timeout_s=0.05)
    start = time.perf_counter()
    result = await loop.run(prompt())
    assert time.perf_counter() - start < 1.0
    timed_out, failed = tool_outputs(tokenizer, result)
    assert "timed out after 0.05 s" in timed_out
    assert "failed: RuntimeError: broken tool" in failed
    assert result.metrics["tool_timeouts"] == 1 and result.metrics["tool_errors"] == 1


async def test_tools_get_row_create_kwargs_and_are_released(tokenizer):
    tool = SleepTool("a")
    loop, _ = make_loop(tokenizer, [call("a", x="1") + "</s>", "fin</s>"], [tool])
    extra = {"tools_kwargs": {"a": {"create_kwargs": {"bonus": True}}}}
    result = await loop.run(prompt(**extra))
    [(instance_id, kwargs)] = tool.created.items()
    assert kwargs == {"bonus": True} and tool.released == [instance_id]
    assert result.metrics["tool_reward"] == 0.5 + 2.0  # step reward + calc_reward


async def test_max_assistant_turns_stops_without_running_the_last_calls(tokenizer):
    turn = call("a", x="1") + "</s>"
    loop, engine = make_loop(tokenizer, [turn] * 5, [SleepTool("a")], max_assistant_turns=2)
    result = await loop.run(prompt())
    assert len(engine.calls) == 2
    assert result.finish_reason == "max_assistant_turns"
    assert result.metrics["turns"] == 2 and result.metrics["tool_calls"] == 1
    assert result.response_ids[-1] == tokenizer.eos_token_id  # ends with the sampled turn
    assert_aligned(result, engine)


async def test_max_tool_calls_limits_the_trajectory(tokenizer):
    two = call("a", x="1") + call("a", x="2") + "</s>"
    script = [two, two, call("a", x="3") + "</s>"]
    loop, engine = make_loop(tokenizer, script, [SleepTool("a")], max_tool_calls=3)
    result = await loop.run(prompt())
    assert tool_outputs(tokenizer, result)[:3] == ["echo 1", "echo 2", "echo 1"]
    assert "3 per trajectory" in tool_outputs(tokenizer, result)[3]
    assert result.finish_reason == "max_tool_calls"
    assert result.metrics["tool_calls"] == 3 and result.metrics["limited_calls"] == 1
    assert len(engine.calls) == 3


async def test_max_parallel_calls_refuses_extra_calls_of_a_turn(tokenizer):
    turn = call("a", x="1") + call("a", x="2") + call("a", x="3") + "</s>"
    loop, _ = make_loop(tokenizer, [turn, "fin</s>"], [SleepTool("a")], max_parallel_calls=2)
    result = await loop.run(prompt())
    outputs = tool_outputs(tokenizer, result)
    assert outputs[:2] == ["echo 1", "echo 2"]
    assert outputs[2].startswith("Error: not run: at most 2 tool calls per turn")
    assert result.metrics["tool_calls"] == 2 and result.metrics["limited_calls"] == 1


async def test_response_budget_caps_turns_and_stops_before_a_tool_turn_that_does_not_fit(
    tokenizer,
):
    first = call("calculator", expression="2+3") + "</s>"
    n1 = len(enc(tokenizer, first))
    tool_turn = len(enc(tokenizer, "<|tool|>5</s><|assistant|>"))
    # room for the first turn, the tool turn and 4 sampled ids
    budget = n1 + tool_turn + 4
    loop, engine = make_loop(
        tokenizer, [first, "#### 5</s>"], [calculator()], max_response_tokens=budget
    )
    result = await loop.run(prompt())
    assert [p.max_new_tokens for _, p in engine.calls] == [budget, 4]
    assert result.finish_reason == "length" and len(result.response_ids) == budget
    assert result.response_text == "####"
    assert_aligned(result, engine)
    # one id less: the tool turn would leave no room to sample, so it is not appended
    loop, engine = make_loop(tokenizer, [first], [calculator()], max_response_tokens=n1 + tool_turn)
    result = await loop.run(prompt())
    assert result.finish_reason == "length" and result.response_ids == enc(tokenizer, first)


async def test_a_turn_cut_by_length_ends_the_trajectory(tokenizer):
    engine = ScriptedEngine([enc(tokenizer, call("calculator", expression="1"))], finish="length")
    loop = ToolAgentLoop(engine, tokenizer, PARAMS, ToolSet([calculator()]))
    result = await loop.run(prompt())
    assert result.finish_reason == "length" and len(engine.calls) == 1
    assert result.metrics["tool_calls"] == 0


async def test_gsm8k_retry_interaction_replies_as_the_user(tokenizer):
    interactions = {"gsm8k_retry": Gsm8kRetryInteraction()}
    script = ["#### 4</s>", "#### 5</s>"]
    loop, engine = make_loop(tokenizer, script, interactions=interactions)
    result = await loop.run(prompt("5", wire={"interaction_kwargs": {"name": "gsm8k_retry"}}))
    feedback = Gsm8kRetryInteraction().feedback
    user_turn = enc(tokenizer, f"<|user|>{feedback}</s><|assistant|>")
    expected = enc(tokenizer, "#### 4</s>") + user_turn + enc(tokenizer, "#### 5</s>")
    assert result.response_ids == expected
    assert result.loss_mask == [1] * 7 + [0] * len(user_turn) + [1] * 7
    assert_aligned(result, engine)
    assert result.finish_reason == "stop" and result.response_text == "#### 5"
    assert result.metrics["user_turns"] == 1 and result.metrics["interaction_reward"] == 1.0
    assert result.metrics["interaction_correct"] == 1.0
    assert interactions["gsm8k_retry"]._truths == {}  # finished


async def test_interaction_stops_at_max_user_turns(tokenizer):
    interactions = {"gsm8k_retry": Gsm8kRetryInteraction()}
    loop, engine = make_loop(
        tokenizer,
        ["#### 4</s>", "the answer is 3</s>"],
        interactions=interactions,
        max_user_turns=1,
    )
    result = await loop.run(prompt("5", interaction_kwargs={"name": "gsm8k_retry"}))
    assert result.finish_reason == "max_user_turns" and len(engine.calls) == 2
    assert result.metrics["user_turns"] == 1 and result.metrics["interaction_reward"] == 0.0
    with pytest.raises(ValueError, match="interaction 'other'"):
        await loop.run(prompt("5", interaction_kwargs={"name": "other"}))


def test_parse_tool_calls_accepts_string_arguments_and_flags_unclosed_calls():
    text = 'a<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>b<tool_call>{"na'
    assert parse_tool_calls(text) == [
        ToolCall("f", {"k": 1}),
        MalformedCall("a <tool_call> is not closed by </tool_call>"),
    ]
    assert parse_tool_calls("no calls #### 5") == []
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>') == [ToolCall("f", {})]
    [bad] = parse_tool_calls('<tool_call>{"name": "f", "arguments": [1]}</tool_call>')
    assert isinstance(bad, MalformedCall)


def test_turn_renderer_adds_what_the_template_renders_after_the_end_token():
    tok = build_tokenizer()
    # like Qwen's: a newline after each message's end token
    tok.chat_template = CHAT_TEMPLATE.replace("'</s>' }}", "'</s>\n' }}")
    renderer = TurnRenderer(tok)
    ids = renderer.turn_ids([{"role": "tool", "content": "7"}], after_id=tok.eos_token_id)
    assert ids == enc(tok, "\n<|tool|>7</s>\n<|assistant|>")


def test_turn_renderer_falls_back_for_templates_that_render_the_last_turn_specially():
    tok = build_tokenizer()
    # like Qwen3's empty think block on a final assistant turn
    tok.chat_template = CHAT_TEMPLATE.replace(
        "message['content']",
        "(('[t]' if loop.last and message['role'] == 'assistant' else '') + message['content'])",
    )
    renderer = TurnRenderer(tok)
    assert [m["role"] for m in renderer._prefix] == ["system", "user"]
    ids = renderer.turn_ids([{"role": "user", "content": "no"}], after_id=tok.eos_token_id)
    assert ids == enc(tok, "<|user|>no</s><|assistant|>")


def test_turn_renderer_rejects_templates_that_are_not_prefix_stable():
    tok = build_tokenizer()
    tok.chat_template = "{{ messages | length }}" + CHAT_TEMPLATE
    with pytest.raises(TemplateNotPrefixStableError, match="not prefix-stable"):
        TurnRenderer(tok)


# ---- registry -----------------------------------------------------------------------------------
def test_registry_resolves_names_and_import_paths(tokenizer):
    engine = ScriptedEngine([])
    kwargs = dict(engine=engine, tokenizer=tokenizer, params=PARAMS, tools=None)
    kwargs |= dict(interactions=None, limits=None)
    assert isinstance(resolve_agent_loop("single_turn")(**kwargs), SingleTurnAgentLoop)
    assert resolve_agent_loop("tool_agent") is ToolAgentLoop
    assert resolve_agent_loop("rollout_servers.agents.tool_agent:ToolAgentLoop") is ToolAgentLoop
    with pytest.raises(ValueError, match=r"registered are \[.*'single_turn'.*'tool_agent'"):
        resolve_agent_loop("nope")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_agent_loop("no_such_module:Loop")
    assert pick_agent_loop(None, "tool_agent") is ToolAgentLoop
    assert pick_agent_loop("tool_agent", "single_turn") is ToolAgentLoop
    with pytest.raises(ValueError, match="rows may name only registered loops"):
        pick_agent_loop("os:system", "single_turn")


async def test_router_hands_each_row_to_its_loop(tokenizer, request):
    request.addfinalizer(lambda: AGENT_LOOPS.unregister("echo_test"))

    @register_agent_loop("echo_test")
    class EchoLoop:
        def __init__(self, **kwargs: Any):
            self.kwargs = kwargs

        async def run(self, prompt: Any, params: SamplingParams | None = None) -> AgentResult:
            return AgentResult([1], [2], [1], [0.0], [0], "echo", "stop")

    engine = ScriptedEngine([enc(tokenizer, "hi</s>")])
    router = AgentLoopRouter(
        "single_turn", engine=engine, tokenizer=tokenizer, params=PARAMS, tools=None
    )
    row = dataclasses.replace(prompt(), agent_name="echo_test")
    assert (await router.run(row)).response_text == "echo"
    assert router.loop_for("echo_test") is router.loop_for("echo_test")
    assert (await router.run(prompt())).response_text == "hi"  # no agent_name: the default
    with pytest.raises(ValueError, match="unknown agent loop 'missing_loop'"):
        AgentLoopRouter("missing_loop", engine=engine, tokenizer=tokenizer, params=PARAMS)


# ---- interactions ---------------------------------------------------------------------------------
async def test_gsm8k_retry_reads_the_final_number():
    user = Gsm8kRetryInteraction()
    user.start("i", ground_truth="1,234")
    for answer, right in [
        ("so 3 + 4 = 7\n#### 1,234", True),
        ("#### 1234 and then 5", True),  # `####` wins over a later number
        ("the total is 1234.", True),  # no `####`: the last number
        ("#### 1233", False),
        ("I do not know", False),
    ]:
        reply = await user.respond("i", [{"role": "assistant", "content": answer}])
        assert (reply.should_stop, reply.turn_reward) == ((True, 1.0) if right else (False, 0.0))
        assert reply.reply == ("" if right else user.feedback)
    user.finish("i")
    assert final_number("-3, then 2.50") == "2.50"


def test_load_interaction_config(tmp_path):
    assert set(load_interaction_config(None)) == {"gsm8k_retry"}
    path = tmp_path / "interactions.yaml"
    path.write_text(
        "interactions:\n"
        "  - name: strict\n"
        "    class_name: gsm8k_retry\n"
        "    config: {feedback: Wrong.}\n"
        "  - name: plain\n"
        "    class_name: rollout_servers.agents.interactions:Gsm8kRetryInteraction\n"
    )
    loaded = load_interaction_config(path)
    assert list(loaded) == ["strict", "plain"] and loaded["strict"].feedback == "Wrong."
    path.write_text("interactions:\n  - name: x\n    class_name: nope\n")
    with pytest.raises(ValueError, match=r"interactions\[0\]: unknown interaction 'nope'"):
        load_interaction_config(path)
