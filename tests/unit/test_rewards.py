"""Reward functions (gsm8k, math, code, custom files) and the process-pool `RewardComputer`."""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from pathlib import Path

import pytest

from rollout_servers.rewards.computer import RewardComputer
from rollout_servers.rewards.functions import (
    REWARD_FNS,
    gsm8k_reward_fn,
    last_boxed_answer,
    load_custom_reward,
    math_equal,
    math_reward_fn,
)
from rollout_servers.sandbox import SandboxConfig, SharedSandbox

CUSTOM = textwrap.dedent(
    """
    import math
    import os
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        if solution_str == "die":
            os._exit(3)
        if solution_str == "raise":
            raise RuntimeError("boom")
        if solution_str == "hang":
            while True:
                time.sleep(1)
        if solution_str == "nan":
            return math.nan
        if solution_str == "huge":  # finite in float64, +inf once stored as float32
            return {"score": 1e39, "length": 1.0}
        if solution_str == "huge extra":
            return {"score": 1.0, "length": 1e39, "ok": 2.0}
        if solution_str == "text":
            return "one"
        bonus = kwargs.get("bonus", 0.0)
        return {"score": float(solution_str == ground_truth) + bonus, "length": len(solution_str)}

    not_a_function = 3
    """
)


@pytest.fixture
def custom_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return path


# ---- gsm8k ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("... so #### 72", "72", 1.0),
        ("#### 1,200", "1200", 1.0),
        ("#### $18", "18", 1.0),
        ("#### -3", "-3", 1.0),
        ("#### 2.50", "2.5", 1.0),
        ("first #### 5, no wait #### 6", "6", 1.0),
        ("first #### 6, no wait #### 5", "6", 0.0),
        ("#### 71", "72", 0.0),
        ("the answer is 72", "72", 0.0),
    ],
)
def test_gsm8k_reads_the_last_final_answer(response, truth, score):
    assert gsm8k_reward_fn("openai/gsm8k", response, truth) == score


def test_gsm8k_format_score_is_configurable():
    assert gsm8k_reward_fn("gsm8k", "#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_reward_fn("gsm8k", "72", "72", format_score=0.1) == 0.0
    assert REWARD_FNS["openai/gsm8k"] is REWARD_FNS["gsm8k"] is gsm8k_reward_fn


# ---- math -----------------------------------------------------------------------------------
def test_last_boxed_answer_keeps_nested_braces():
    text = r"first \boxed{1}, then \boxed{\frac{\sqrt{2}}{2}} done"
    assert last_boxed_answer(text) == r"\frac{\sqrt{2}}{2}"
    assert last_boxed_answer(r"\boxed 5$") == "5"
    assert last_boxed_answer(r"\fbox{x}") == "x"
    assert last_boxed_answer(r"cut off \boxed{\frac{1}{2}") is None
    assert last_boxed_answer("no box") is None


@pytest.mark.parametrize(
    ("answer", "truth"),
    [(r"\frac{1}{2}", "0.5"), (r"2\sqrt{2}", r"\sqrt{8}"), (r"\dfrac{\pi}{2}", r"\pi/2")],
)
def test_math_accepts_equivalent_answers(answer, truth):
    assert math_equal(answer, truth)
    assert math_reward_fn("math", f"so \\boxed{{{answer}}}.", truth) == 1.0


@pytest.mark.parametrize(
    ("answer", "truth"), [("3", "4"), (r"\frac{1}{3}", "0.33"), (r"\sqrt{2}", r"\sqrt{3}")]
)
def test_math_rejects_different_answers(answer, truth):
    assert not math_equal(answer, truth)
    assert math_reward_fn("math", f"\\boxed{{{answer}}}", truth, format_score=0.1) == 0.1


def test_math_without_a_boxed_answer_scores_zero_and_boxed_truth_is_read():
    assert math_reward_fn("math", "it is 0.5", "0.5", format_score=0.1) == 0.0
    assert math_reward_fn("lighteval/MATH", r"\boxed{0.5}", r"\boxed{\frac12}") == 1.0
    assert REWARD_FNS["math"] is REWARD_FNS["lighteval/MATH"] is math_reward_fn


# ---- code (tests/integration/test_code_reward.py has the rest) ------------------------------
def _fenced(code: str) -> str:
    return f"Here you go:\n```python\n{textwrap.dedent(code).strip()}\n```\nDone."


# ---- custom reward files --------------------------------------------------------------------
def test_load_custom_reward_errors_are_clear(custom_file, tmp_path):
    assert load_custom_reward(custom_file)("x", "a", "a") == {"score": 1.0, "length": 1}
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_custom_reward(tmp_path / "nope.py")
    with pytest.raises(AttributeError, match="has no function 'score_it'"):
        load_custom_reward(custom_file, "score_it")
    with pytest.raises(TypeError, match="'not_a_function' .* is not callable"):
        load_custom_reward(custom_file, "not_a_function")
    with pytest.raises(FileNotFoundError):
        RewardComputer(1.0, custom_path=str(tmp_path / "nope.py"))


async def test_failures_score_zero_are_counted_and_the_pool_keeps_working(custom_file):
    rc = RewardComputer(1.0, num_workers=1, custom_path=str(custom_file))
    try:
        assert await rc.score("any/source", "a", "a", None) == (1.0, {"length": 1.0})
        assert await rc.score("any/source", "raise", "a", None) == (0.0, {})
        assert await rc.score("any/source", "nan", "a", None) == (0.0, {})
        assert (await rc.score("any/source", "huge", "a", None))[0] == 0.0
        assert await rc.score("any/source", "huge extra", "a", None) == (1.0, {"ok": 2.0})
        assert await rc.score("any/source", "text", "a", None) == (0.0, {})

        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        start = time.monotonic()
        assert await rc.score("any/source", "hang", "a", None) == (0.0, {})
        hung_for = time.monotonic() - start
        tick_task.cancel()
        assert 1.0 <= hung_for < 3.0
        assert ticks > 30  # the event loop kept running while the reward hung

        start = time.monotonic()  # the single worker was replaced: later calls succeed quickly
        assert await rc.score("any/source", "b", "b", None) == (1.0, {"length": 1.0})
        # the replacement's start is in it: up to 0.65 s on a loaded 2-core machine
        assert time.monotonic() - start < 3.0
        assert rc.failures == {"exception": 1, "non_finite": 3, "non_number": 1, "timeout": 1}
    finally:
        rc.close()


async def test_a_turns_calls_travel_as_one_batch_and_each_fails_alone(custom_file):
    """Calls made together go to the worker as one batch; the item that hangs and the item that
    kills the worker fail alone, the others are scored (those after them on the replacement),
    and the batch costs one timeout, not one per item after the hang."""
    rc = RewardComputer(1.0, num_workers=1, custom_path=str(custom_file))
    batches: list[int] = []
    call_batch = rc._call_batch
    rc._call_batch = lambda items: (batches.append(len(items)), call_batch(items))[1]  # type: ignore[method-assign]
    try:
        texts = ["a", "hang", "b", "die", "c", "x"]
        start = time.monotonic()
        scores = await asyncio.gather(
            *(rc.score("any/source", t, "y" if t == "x" else t, None) for t in texts)
        )
        took = time.monotonic() - start
        assert [s for s, _ in scores] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
        assert batches == [6]
        assert rc.failures == {"timeout": 1, "crash": 1}
        # one timeout plus three worker starts (0.16 s each here, 0.85 s under load); a timeout
        # per item after the hang would be 5 s or more
        assert 1.0 <= took < 4.5

        # a caller that gives up does not disturb the others of its batch
        calls = [asyncio.create_task(rc.score("any/source", t, t, None)) for t in ("hang", "d")]
        await asyncio.sleep(0.2)
        calls[0].cancel()
        assert await calls[1] == (1.0, {"length": 1.0})
        assert batches == [6, 2]
    finally:
        rc.close()


async def test_builtin_rewards_run_in_workers_with_reward_kwargs(custom_file):
    sandbox = SharedSandbox(SandboxConfig())
    rc = RewardComputer(
        5.0, num_workers=2, reward_kwargs={"format_score": 0.25, "bonus": 9}, sandbox=sandbox
    )
    try:
        scores = await asyncio.gather(
            rc.score("openai/gsm8k", "#### 18", "18", {}),
            rc.score("openai/gsm8k", "#### 17", "18", {}),
            rc.score("math", r"\boxed{\frac{1}{2}}", "0.5", {}),
            rc.score(
                "code",
                _fenced("print(input())"),
                json.dumps({"inputs": ["x"], "outputs": ["x"]}),
                {},
            ),
            rc.score("nobody/knows", "x", "y", {}),
        )
        assert [s for s, _ in scores] == [1.0, 0.25, 1.0, 1.0, 0.0]
        assert scores[3][1]["passed"] == 1.0
        assert rc.failures == {"unknown_data_source": 1}
    finally:
        rc.close()
        sandbox.close()
    assert await rc.score("openai/gsm8k", "#### 18", "18", {}) == (0.0, {})
    assert rc.failures["closed"] == 1
