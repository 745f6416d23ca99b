"""Where the embedded tiny model is cached, computed without torch or transformers.

The launcher asks `embedded_model_dir` before every run; on a hit (every run after the first)
it uses the directory as it is and never imports the model code (`tiny_model`, which imports
torch and transformers: about two seconds of start-up that no fleet was waiting for). The name
is a hash of everything that determines the directory's contents, so a hit is exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.demo.search_task import SearchQATask
from asyncrl.demo.tasks import ArithmeticTask, ToolArithmeticTask

EmbeddedTask = ArithmeticTask | ToolArithmeticTask | SearchQATask
"""The tasks the embedded model can be warm-started on."""

FORMAT_VERSION = 1
"""Bump when the tokenizer, template, model or warm-start recipe changes: old caches go stale."""

P_CORRECT = 0.35
"""How often the warm-start's demonstrations are right (so the model is right only partly)."""


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the embedded Llama. Head dim is hidden_size / num_attention_heads = 32, the
    smallest that vLLM's attention kernels accept."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False


def cache_key(
    task: EmbeddedTask,
    warmstart_steps: int,
    seed: int,
    spec: TinyModelSpec = TinyModelSpec(),  # noqa: B008 (frozen, so a shared default is safe)
    p_correct: float = P_CORRECT,
) -> dict[str, Any]:
    """Everything that determines the cached directory's contents."""
    key: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "spec": dataclasses.asdict(spec),
        "task": dataclasses.asdict(task),
        "warmstart_steps": warmstart_steps,
        "seed": seed,
        "p_correct": p_correct,
    }
    if isinstance(task, ToolArithmeticTask):  # absent for ArithmeticTask: its keys are unchanged
        key["task_kind"] = "arith_tool"
    elif isinstance(task, SearchQATask):
        key["task_kind"] = "search_qa"
    return key


def embedded_model_dir(cache_dir: str | Path, key: dict[str, Any]) -> Path:
    """The directory of the model built for `key` (it exists only once complete)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"tiny-llama-{digest}"
