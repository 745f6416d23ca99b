"""The embedded synthetic tasks: single-digit addition (`arith`) and two-digit multiplication
with a calculator tool (`arith_tool`), each with a verifiable 0-1 reward.

They plug in exactly as a user's task would: pyproject.toml declares the task factories as
`asyncrl.tasks` entry points (`data.task=arith`) and their reward as `asyncrl.rewards` entry
points for their data sources; nothing in the core or the fleets imports this module.

Rows use the schema users of verl already have (`data_source`, `prompt` as chat messages,
`ability`, `reward_model.ground_truth`, `extra_info`), so the embedded task flows through
exactly the same path as a parquet dataset.

The warm-start demonstrations are deliberately noisy: the answer is right only with probability
`p_correct`, otherwise a nearby wrong number. Supervised training on them teaches the format and
leaves a policy that is right roughly that often; reinforcement learning against the verifiable
reward must find which answers are right. That makes "reward rises" a real test of the RL loop.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

ARITH_SOURCE = "asyncrl/arith"


@dataclass(frozen=True)
class ArithmeticTask:
    max_operand: int = 9
    """Operands are drawn uniformly from 0..max_operand."""
    seed: int = 0
    """Seed of the prompt stream."""

    source = ARITH_SOURCE
    """The rows' data_source (which picks their reward)."""

    def question(self, a: int, b: int) -> str:
        """The user message asking for a + b."""
        return f"{a}+{b}="

    def row(self, a: int, b: int, index: int = 0) -> dict[str, Any]:
        """One verl-schema row asking for a + b."""
        return {
            "data_source": self.source,
            "prompt": [{"role": "user", "content": self.question(a, b)}],
            "ability": "arithmetic",
            "reward_model": {"ground_truth": str(a + b), "style": "rule"},
            "extra_info": {"index": index, "a": a, "b": b},
        }

    def rows(self) -> Iterator[dict[str, Any]]:
        """An endless, seeded stream of rows."""
        rng = random.Random(self.seed)
        index = 0
        while True:
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            yield self.row(a, b, index)
            index += 1

    def val_rows(self) -> list[dict[str, Any]]:
        """Every question of the task once (the embedded validation set), in a fixed order."""
        pairs = [(a, b) for a in range(self.max_operand + 1) for b in range(self.max_operand + 1)]
        return [self.row(a, b, i) for i, (a, b) in enumerate(pairs)]

    def demonstration(self, rng: random.Random, p_correct: float) -> tuple[str, str]:
        """(prompt text, answer text) for the warm-start; the answer is right w.p. p_correct."""
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        answer = a + b
        if rng.random() >= p_correct:
            answer = max(0, answer + rng.choice([-2, -1, 1, 2]))
            if answer == a + b:
                answer += 1
        return self.question(a, b), str(answer)


def arith_reward_fn(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response is exactly the right number (whitespace ignored), else 0.0."""
    return 1.0 if solution_str.strip() == ground_truth.strip() else 0.0


def arith_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """Both embedded tasks' reward under verl's signature: exact match of the final answer (for
    arith_tool, the last assistant turn, which the tool agent passes as the response)."""
    return arith_reward_fn(solution_str, ground_truth)


ARITH_TOOL_SOURCE = "asyncrl/arith_tool"
EmbeddedTaskKind = Literal["arith", "arith_tool"]


@dataclass(frozen=True)
class ToolArithmeticTask:
    """Two-digit times one-digit multiplication (`37*8=`), a task the calculator tool solves.

    The tiny model cannot multiply reliably, so answering directly is mostly wrong, while a
    calculator call with the right expression followed by copying its output is always right.
    The warm-start mixes both behaviours with tool use a minority and sometimes miscalled (a
    wrong operand in the expression), so reinforcement learning has room to raise both the share
    of correct tool calls and the reward.
    """

    min_left: int = 10
    """Left operands are drawn from min_left..max_left."""
    max_left: int = 99
    """Largest left operand."""
    min_right: int = 2
    """Right operands are drawn from min_right..max_right."""
    max_right: int = 9
    """Largest right operand."""
    seed: int = 0
    """Seed of the prompt stream."""
    p_tool: float = 0.25
    """Warm-start: share of demonstrations that call the calculator."""
    p_tool_miscall: float = 0.3
    """Warm-start: share of tool demonstrations whose expression has a wrong operand."""

    def row(self, a: int, b: int, index: int = 0) -> dict[str, Any]:
        """One verl-schema row asking for a * b."""
        return {
            "data_source": ARITH_TOOL_SOURCE,
            "prompt": [{"role": "user", "content": f"{a}*{b}="}],
            "ability": "arithmetic",
            "reward_model": {"ground_truth": str(a * b), "style": "rule"},
            "extra_info": {"index": index, "a": a, "b": b},
        }

    def _pair(self, rng: random.Random) -> tuple[int, int]:
        return rng.randint(self.min_left, self.max_left), rng.randint(
            self.min_right, self.max_right
        )

    def rows(self) -> Iterator[dict[str, Any]]:
        """An endless, seeded stream of rows."""
        rng = random.Random(self.seed)
        index = 0
        while True:
            yield self.row(*self._pair(rng), index)
            index += 1

    def val_rows(self) -> list[dict[str, Any]]:
        """Every question of the task once, in a fixed order."""
        pairs = [
            (a, b)
            for a in range(self.min_left, self.max_left + 1)
            for b in range(self.min_right, self.max_right + 1)
        ]
        return [self.row(a, b, i) for i, (a, b) in enumerate(pairs)]

    def demonstration(self, rng: random.Random, p_correct: float) -> list[dict[str, str]]:
        """A warm-start conversation (user, assistant[, tool, assistant]) as chat messages.

        With probability p_tool the assistant calls the calculator (with a wrong operand w.p.
        p_tool_miscall) and then answers with the tool's output, so the final answer is right
        exactly when the call is. Otherwise it answers directly, right w.p. p_correct, else a
        nearby wrong number.
        """
        a, b = self._pair(rng)
        messages = [{"role": "user", "content": f"{a}*{b}="}]
        if rng.random() < self.p_tool:
            x, y = a, b
            if rng.random() < self.p_tool_miscall:
                if rng.random() < 0.5:
                    x = a + rng.choice([-1, 1])
                else:
                    y = b + rng.choice([-1, 1])
            call = {"name": "calculator", "arguments": {"expression": f"{x}*{y}"}}
            return [
                *messages,
                {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
                {"role": "tool", "content": str(x * y)},
                {"role": "assistant", "content": str(x * y)},
            ]
        answer = a * b
        if rng.random() >= p_correct:
            answer += rng.choice([-10, -2, -1, 1, 2, 10])
        return [*messages, {"role": "assistant", "content": str(answer)}]


def setup_embedded_task(
    kind: EmbeddedTaskKind, max_operand: int, seed: int
) -> ArithmeticTask | ToolArithmeticTask:
    """The embedded task a config names (`data.task`); max_operand applies to `arith` only."""
    if kind == "arith_tool":
        return ToolArithmeticTask(seed=seed)
    return ArithmeticTask(max_operand=max_operand, seed=seed)


def setup_arith_task(data_cfg: Any) -> ArithmeticTask:
    """`data.task=arith`: operands 0..data.task_max_operand, seeded by data.seed."""
    return ArithmeticTask(max_operand=data_cfg.task_max_operand, seed=data_cfg.seed)


def setup_arith_tool_task(data_cfg: Any) -> ToolArithmeticTask:
    """`data.task=arith_tool` (for rollout.agent_loop=tool_agent), seeded by data.seed."""
    return ToolArithmeticTask(seed=data_cfg.seed)
