"""Where the replay's prompts come from, and how a dataset row becomes a lease.

A `PromptSource` hands out rows in the verl schema (`data_source`, `prompt`, `reward_model`,
`extra_info`, ...); the replay turns each row into a `PromptItem` with a fresh group id when it
grants a lease. The protocol is one method so that any row stream (the embedded arithmetic task
here, a parquet reader later) plugs in without the replay knowing where rows live.

Invariant: every group id handed out is unique for the life of the process (row index plus a
random suffix), so a trajectory of an expired or consumed lease can never be mistaken for a
sample of a newer lease of the same row.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from asyncrl.config import Config
from asyncrl.protocol import ChatMessage, PromptItem
from asyncrl.tasks import ArithmeticTask


class PromptSource(Protocol):
    """An endless stream of verl-schema rows."""

    def next_row(self) -> dict[str, Any]:
        """The next row to lease (a dict with at least `data_source`, `prompt`, `reward_model`)."""
        ...


class EmbeddedPromptSource:
    """Rows of the embedded arithmetic task, in the task's seeded order."""

    def __init__(self, task: ArithmeticTask) -> None:
        self._rows: Iterator[dict[str, Any]] = task.rows()

    def next_row(self) -> dict[str, Any]:
        return next(self._rows)


def setup_prompt_source(cfg: Config) -> PromptSource:
    """The prompt source the config asks for (today: the embedded task when no files are set)."""
    if cfg.data.train_files:
        raise ValueError(
            f"data.train_files={cfg.data.train_files!r}: the replay cannot read parquet prompts "
            "yet; leave data.train_files empty to train on the embedded arithmetic task"
        )
    return EmbeddedPromptSource(
        ArithmeticTask(max_operand=cfg.data.task_max_operand, seed=cfg.data.seed)
    )


def new_group_id(row_index: int) -> str:
    """`"{row_index}-{8 hex digits}"`: readable in logs, unique per lease."""
    return f"{row_index}-{uuid.uuid4().hex[:8]}"


def reissue(item: PromptItem) -> PromptItem:
    """The same prompt under a fresh group id (its row index is kept), for a lease that expired."""
    row_index = item.group_id.rsplit("-", 1)[0]
    return dataclasses.replace(item, group_id=f"{row_index}-{uuid.uuid4().hex[:8]}")


def row_to_prompt_item(row: dict[str, Any], row_index: int, n: int) -> PromptItem:
    """A verl-schema row -> the lease of one group of `n` samples.

    `row["prompt"]` is a list of `{role, content}` messages or a plain string (one user
    message); `extra_info` travels JSON-encoded because the wire carries no free-form values.
    Raises ValueError naming the field when the row does not fit the schema.
    """
    for key in ("data_source", "prompt", "reward_model"):
        if key not in row:
            raise ValueError(f"row {row_index}: missing field {key!r}")
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError(f"row {row_index}: reward_model must be a mapping with ground_truth")
    return PromptItem(
        group_id=new_group_id(row_index),
        n=n,
        data_source=str(row["data_source"]),
        messages=_messages(row["prompt"], row_index),
        ground_truth=str(reward_model["ground_truth"]),
        extra_info_json=json.dumps(row.get("extra_info") or {}, default=_plain),
    )


def _messages(prompt: Any, row_index: int) -> list[ChatMessage]:
    if isinstance(prompt, str):
        return [ChatMessage(role="user", content=prompt)]
    # parquet readers hand back numpy arrays of dicts where the writer had lists
    items = list(prompt) if isinstance(prompt, (list, tuple, np.ndarray)) else None
    if not items:
        raise ValueError(f"row {row_index}: prompt must be a string or a non-empty message list")
    messages = []
    for i, m in enumerate(items):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise ValueError(f"row {row_index}: prompt[{i}] must be a mapping with a string role")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"row {row_index}: prompt[{i}].content must be a string")
        messages.append(ChatMessage(role=m["role"], content=m["content"]))
    return messages


def _plain(value: Any) -> Any:
    """JSON fallback for what parquet readers put in extra_info (numpy scalars and arrays)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"extra_info value of type {type(value).__name__} is not JSON-serialisable")
