"""Where the replay's prompts come from, and how a dataset row becomes a lease.

A `PromptSource` hands out rows in the verl schema (`data_source`, `prompt`, `reward_model`,
`extra_info`, ...); the replay turns each row into a `PromptItem` with a fresh group id when it
grants a lease. The protocol is one method so that any row stream (the embedded arithmetic task,
parquet files through `asyncrl.data.PromptReader`) plugs in without the replay knowing where
rows live.

Invariant: every group id handed out is unique for the life of the process (row index plus a
random suffix), so a trajectory of an expired or consumed lease can never be mistaken for a
sample of a newer lease of the same row.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from asyncrl.config import Config
from asyncrl.data import PromptReader, prompt_messages
from asyncrl.protocol import ChatMessage, PromptItem
from asyncrl.tasks import ArithmeticTask, ToolArithmeticTask, setup_embedded_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class PromptSource(Protocol):
    """An endless stream of verl-schema rows whose position can be saved and restored."""

    def next_row(self) -> dict[str, Any]:
        """The next row to lease (a dict with at least `data_source`, `prompt`, `reward_model`)."""
        ...

    def state(self) -> dict[str, Any]:
        """The position in the stream, JSON-serialisable."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by `state`."""
        ...


class EmbeddedPromptSource:
    """Rows of the embedded arithmetic task, in the task's seeded order."""

    def __init__(self, task: ArithmeticTask | ToolArithmeticTask) -> None:
        self._task = task
        self._rows: Iterator[dict[str, Any]] = task.rows()
        self._drawn = 0

    def next_row(self) -> dict[str, Any]:
        self._drawn += 1
        return next(self._rows)

    def state(self) -> dict[str, Any]:
        return {"drawn": self._drawn}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue the seeded stream where the saved one stopped."""
        self._rows, self._drawn = self._task.rows(), 0
        for _ in range(int(state["drawn"])):
            self.next_row()


class ParquetPromptSource:
    """Rows of verl-schema parquet files, validated, mixed and shuffled by a `PromptReader`.

    `state`/`load_state` expose the reader's position so a resumed run continues the stream
    where it stopped (no prompt repeated or skipped).
    """

    def __init__(self, reader: PromptReader) -> None:
        self.reader = reader

    def next_row(self) -> dict[str, Any]:
        return next(self.reader)

    def state(self) -> dict[str, Any]:
        """The reader's position, JSON-serialisable."""
        return self.reader.state()

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by `state`."""
        self.reader.load_state(state)


def setup_prompt_source(
    cfg: Config, tokenizer: PreTrainedTokenizerBase | None = None
) -> PromptSource:
    """The prompt source the config asks for: parquet files when `data.train_files` is set,
    else the embedded task `data.task`.

    `tokenizer` measures prompts for `data.max_prompt_length`; when none is given and a length
    is set, the model's tokenizer is loaded (`trainer.model_path`, or the embedded model's).
    """
    data = cfg.data
    if not data.train_files:
        return EmbeddedPromptSource(
            setup_embedded_task(data.task, data.task_max_operand, data.seed)
        )
    if data.max_prompt_length is not None and tokenizer is None:
        tokenizer = _model_tokenizer(cfg)
    reader = PromptReader(
        data.train_files,
        weights=data.train_weights,
        seed=data.seed,
        shuffle=data.shuffle,
        skip_bad_rows=data.skip_bad_rows,
        tokenizer=tokenizer if data.max_prompt_length is not None else None,
        max_prompt_length=data.max_prompt_length,
        too_long=data.too_long,
    )
    return ParquetPromptSource(reader)


def _model_tokenizer(cfg: Config) -> PreTrainedTokenizerBase:
    if cfg.trainer.model_path is None:
        from asyncrl.tiny_model import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.trainer.model_path)


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
        agent_name=str(row.get("agent_name") or ""),
        tools_kwargs_json=json.dumps(row.get("tools_kwargs") or {}, default=_plain),
        interaction_kwargs_json=json.dumps(row.get("interaction_kwargs") or {}, default=_plain),
    )


def _messages(prompt: Any, row_index: int) -> list[ChatMessage]:
    try:
        messages = prompt_messages(prompt)
    except ValueError as e:
        raise ValueError(f"row {row_index}: {e}") from None
    return [ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def _plain(value: Any) -> Any:
    """JSON fallback for what parquet readers put in extra_info (numpy scalars and arrays)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"extra_info value of type {type(value).__name__} is not JSON-serialisable")
