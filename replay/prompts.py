"""Where the replay's prompts come from, and how a dataset row becomes a lease.

A `PromptSource` hands out rows in the verl schema (`data_source`, `prompt`, `reward_model`,
`extra_info`, ...); the replay turns each row into a `PromptItem` with a fresh group id when it
grants a lease (`asyncrl.data.rows.row_to_prompt_item`). The protocol is one method so that any row
stream (a registered `Task`, parquet files through `asyncrl.data.prompts.PromptReader`) plugs in without
the replay knowing where rows live.

Invariant: every group id handed out is unique for the life of the process (row index plus a
random suffix), so a trajectory of an expired or consumed lease can never be mistaken for a
sample of a newer lease of the same row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.config import Config
from asyncrl.data.prompts import PromptReader, Task, setup_task
from asyncrl.data.rows import new_group_id, row_of_group

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncrl.wire.protocol import PromptItem


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


class TaskPromptSource:
    """Rows of a registered `Task` (the embedded demo task, or a user's), in its seeded order."""

    def __init__(self, task: Task) -> None:
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
    cfg: Config, model_path: str | None = None, tokenizer: PreTrainedTokenizerBase | None = None
) -> PromptSource:
    """The prompt source the config asks for: parquet files when `data.train_files` is set,
    else the task `data.task`.

    `tokenizer` measures prompts for `data.max_prompt_length`; when none is given and a length
    is set, the tokenizer of `model_path` (the run's model directory) is loaded.
    """
    data = cfg.data
    if not data.train_files:
        return TaskPromptSource(setup_task(data))
    if data.max_prompt_length is None:
        tokenizer = None
    elif tokenizer is None:
        if model_path is None:
            raise ValueError("data.max_prompt_length needs the model's tokenizer (no model path)")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    reader = PromptReader(
        data.train_files,
        weights=data.train_weights,
        seed=data.seed,
        shuffle=data.shuffle,
        skip_bad_rows=data.skip_bad_rows,
        tokenizer=tokenizer,
        max_prompt_length=data.max_prompt_length,
        too_long=data.too_long,
    )
    return ParquetPromptSource(reader)


def reissue(item: PromptItem) -> PromptItem:
    """The same prompt under a fresh group id (its row index is kept), for a lease that expired."""
    return dataclasses.replace(item, group_id=new_group_id(row_of_group(item.group_id)))
