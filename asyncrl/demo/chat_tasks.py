"""`data.task=arith_chat`: single-digit addition asked in plain English, for pretrained chat
models (the real-model demo, `configs/smollm2_arith.yaml`, `docs/real_model.md`).

The prompt is one user message, "What is 7 + 5? Answer with just the number.", so the model's
own chat template frames it. The reward (`arith_chat_score`, registered for the data source
`asyncrl/arith_chat`) is 1.0 when the last integer in the response equals the sum: a pretrained
model answers in words ("7 + 5 = 12") as often as with the bare number, and both are right.
Only the last integer counts, so listing candidates cannot win more than the last one would.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from asyncrl.demo.tasks import ArithmeticTask

ARITH_CHAT_SOURCE = "asyncrl/arith_chat"
_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class ChatArithmeticTask(ArithmeticTask):
    """`ArithmeticTask`'s questions (same stream, same validation set), asked in a sentence."""

    source = ARITH_CHAT_SOURCE

    def question(self, a: int, b: int) -> str:
        return f"What is {a} + {b}? Answer with just the number."


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
