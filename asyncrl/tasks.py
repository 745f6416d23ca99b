"""The embedded synthetic task: single-digit addition with a verifiable 0-1 reward.

Rows use the schema users of verl already have (`data_source`, `prompt` as chat messages,
`ability`, `reward_model.ground_truth`, `extra_info`), so the embedded task flows through
exactly the same path as a parquet dataset.

The warm-start demonstrations are deliberately noisy: the answer is right only with probability
`p_correct`, otherwise a nearby wrong number. Supervised training on them teaches the format and
leaves a policy that is right roughly that often; reinforcement learning against the verifiable
reward must find which answers are right. That makes "reward rises" a real test of the RL loop.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ARITH_SOURCE = "asyncrl/arith"


@dataclass(frozen=True)
class ArithmeticTask:
    max_operand: int = 9
    """Operands are drawn uniformly from 0..max_operand."""
    seed: int = 0
    """Seed of the prompt stream."""

    def row(self, a: int, b: int, index: int = 0) -> dict[str, Any]:
        """One verl-schema row asking for a + b."""
        return {
            "data_source": ARITH_SOURCE,
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
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
        return f"{a}+{b}=", str(answer)


def arith_reward_fn(solution_str: str, ground_truth: str) -> float:
    """1.0 when the response is exactly the right number (whitespace ignored), else 0.0."""
    return 1.0 if solution_str.strip() == ground_truth.strip() else 0.0
