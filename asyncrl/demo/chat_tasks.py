"""`data.task=arith_chat`: single-digit addition asked in plain English, for pretrained chat
models (the real-model demo, `configs/smollm2_arith.yaml`, `docs/real_model.md`).

The prompt is one user message, "What is 7 + 5? Answer with just the number.", so the model's
own chat template frames it. The reward (`arith_chat_score`, registered for the data source
`asyncrl/arith_chat`) is 1.0 when the last integer in the response equals the sum: a pretrained
model answers in words ("7 + 5 = 12") as often as with the bare number, and both are right.
Only the last integer counts, so listing candidates cannot win more than the last one would.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ARITH_CHAT_SOURCE = "asyncrl/arith_chat"
_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class ChatArithmeticTask:
    max_operand: int = 9
    """Operands are drawn uniformly from 0..max_operand."""
    seed: int = 0
    """Seed of the prompt stream."""

    def row(self, a: int, b: int, index: int = 0) -> dict[str, Any]:
        """One verl-schema row asking for a + b in a sentence."""
        question = f"What is {a} + {b}? Answer with just the number."
        return {
            "data_source": ARITH_CHAT_SOURCE,
            "prompt": [{"role": "user", "content": question}],
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
        """Every question of the task once, in a fixed order."""
        pairs = [(a, b) for a in range(self.max_operand + 1) for b in range(self.max_operand + 1)]
        return [self.row(a, b, i) for i, (a, b) in enumerate(pairs)]


def last_integer(text: str) -> str | None:
    """The last integer written in `text` (thousands separators ignored), or None."""
    found = _INTEGER.findall(text.replace(",", ""))
    return str(int(found[-1])) if found else None


def arith_chat_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
) -> float:
    """verl's signature: 1.0 when the response's last integer is the ground truth, else 0.0."""
    return 1.0 if last_integer(solution_str) == str(int(ground_truth)) else 0.0


def setup_arith_chat_task(data_cfg: Any) -> ChatArithmeticTask:
    """`data.task=arith_chat`: operands 0..data.task_max_operand, seeded by data.seed."""
    return ChatArithmeticTask(max_operand=data_cfg.task_max_operand, seed=data_cfg.seed)
