"""The embedded tool task: its rows, its demonstrations, their token layout and its reward."""

from __future__ import annotations

import random

import pytest

from asyncrl.data.prompts import render_prompt_ids
from asyncrl.demo.tasks import (
    ARITH_TOOL_SOURCE,
    ArithmeticTask,
    ToolArithmeticTask,
    setup_embedded_task,
)
from asyncrl.demo.tiny_model import build_tokenizer, render_conversation
from rollout_servers.agents.calculator_tool import evaluate_expression
from rollout_servers.agents.tool_agent import parse_tool_calls
from rollout_servers.agents.turn_renderer import TurnRenderer
from rollout_servers.rewards.functions import REWARD_FNS


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_rows_ask_for_a_product_with_the_product_as_ground_truth():
    rows = ToolArithmeticTask(seed=3).rows()
    for _ in range(20):
        row = next(rows)
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert 10 <= a <= 99 and 2 <= b <= 9
        assert row["prompt"] == [{"role": "user", "content": f"{a}*{b}="}]
        assert row["reward_model"]["ground_truth"] == str(a * b)
        assert row["data_source"] == ARITH_TOOL_SOURCE
    assert len(ToolArithmeticTask().val_rows()) == 90 * 8


def test_tool_demonstrations_call_the_calculator_and_answer_with_its_output():
    task, rng = ToolArithmeticTask(), random.Random(0)
    demos = [task.demonstration(rng, p_correct=0.3) for _ in range(2000)]
    tool_demos = [d for d in demos if len(d) == 4]
    assert 0.2 < len(tool_demos) / len(demos) < 0.3  # p_tool = 0.25
    miscalled = 0
    for user, call, tool, answer in tool_demos:
        (parsed,) = parse_tool_calls(call["content"])
        value = evaluate_expression(parsed.arguments["expression"])
        assert tool == {"role": "tool", "content": str(value)}
        assert answer == {"role": "assistant", "content": str(value)}
        miscalled += user["content"] != parsed.arguments["expression"] + "="
    assert 0.2 < miscalled / len(tool_demos) < 0.4  # p_tool_miscall = 0.3


def test_render_conversation_trains_assistant_turns_with_the_tool_loops_layout(tokenizer):
    messages = [
        {"role": "user", "content": "37*8="},
        {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
        {"role": "tool", "content": "296"},
        {"role": "assistant", "content": "296"},
    ]
    ids, mask = render_conversation(tokenizer, messages)
    prompt = render_prompt_ids(tokenizer, messages[:1])
    call = tokenizer.encode(messages[1]["content"], add_special_tokens=False)
    eos = tokenizer.eos_token_id
    # what ToolAgentLoop appends after a sampled turn that ended with </s>
    tool_turn = TurnRenderer(tokenizer).turn_ids([messages[2]], after_id=eos)
    answer = tokenizer.encode("296", add_special_tokens=False)
    assert ids == [*prompt, *call, eos, *tool_turn, *answer, eos]
    expected_mask = [0] * len(prompt) + [1] * (len(call) + 1) + [0] * len(tool_turn)
    assert mask == expected_mask + [1] * (len(answer) + 1)


def test_render_conversation_rejects_a_conversation_not_ending_with_the_assistant(tokenizer):
    with pytest.raises(ValueError, match="must end with an assistant"):
        render_conversation(tokenizer, [{"role": "user", "content": "1*2="}])


def test_the_reward_is_exact_match_of_the_final_answer():
    reward = REWARD_FNS[ARITH_TOOL_SOURCE]
    assert reward(ARITH_TOOL_SOURCE, " 296 ", "296") == 1.0
    assert reward(ARITH_TOOL_SOURCE, "<tool_call>{}</tool_call>", "296") == 0.0


def test_setup_embedded_task_picks_the_task_by_kind():
    assert setup_embedded_task("arith", 5, 1) == ArithmeticTask(max_operand=5, seed=1)
    assert setup_embedded_task("arith_tool", 5, 1) == ToolArithmeticTask(seed=1)
