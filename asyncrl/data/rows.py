"""Dataset rows in the verl schema: checking one, and turning one into the lease of a group.

A row has `data_source` (picks the reward function), `prompt` (chat messages, or a plain
string), `ability`, `reward_model` (`style`, `ground_truth`), `extra_info`, and optionally
`agent_name`, `tools_kwargs`, `interaction_kwargs` (`asyncrl.data.prompts` reads them from parquet
files or from a task).

- `validate_row` is the schema check every row passes before the replay may lease it
  (`asyncrl.data.prompts.PromptReader` runs it on every row of its files when it is built).
- `row_to_prompt_item` is how a row becomes the lease of one group (`PromptItem`), for training
  and evaluation alike; `new_group_id` names that lease and `row_of_group` reads the row back.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from asyncrl.wire.protocol import ChatMessage, PromptItem


class BadRowError(ValueError):
    """A dataset row that does not fit the schema; the message names the file and row index."""


def prompt_messages(prompt: Any) -> list[dict[str, str]]:
    """A row's `prompt` as chat messages; a plain string is one user message.

    Raises ValueError saying what is wrong (the caller adds file and row). Parquet readers hand
    back numpy arrays where the writer had lists, so those are accepted too.
    """
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if prompt is None:
        raise ValueError("missing 'prompt'")
    if not isinstance(prompt, (list, tuple, np.ndarray)) or len(prompt) == 0:
        raise ValueError(
            f"'prompt' must be a string or a non-empty list of {{role, content}} messages, "
            f"got {type(prompt).__name__}"
        )
    messages = []
    for i, m in enumerate(prompt):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise ValueError(f"prompt[{i}] must be a mapping with a string role")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"prompt[{i}].content must be a string")
        messages.append({"role": m["role"], "content": m["content"]})
    return messages


def validate_row(row: dict[str, Any], file: str, index: int) -> list[dict[str, str]]:
    """Check one row against the schema; returns its prompt messages.

    Raises BadRowError naming `file` and `index` for a missing or non-string `data_source`, a
    missing or malformed `prompt`, or a `reward_model` without a `ground_truth`.
    """
    try:
        if not isinstance(row.get("data_source"), str):
            raise ValueError("missing or non-string 'data_source'")
        messages = prompt_messages(row.get("prompt"))
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise ValueError("missing 'reward_model.ground_truth'")
    except ValueError as e:
        raise BadRowError(f"{file}: row {index}: {e}") from None
    return messages


def new_group_id(row_index: int | str) -> str:
    """`"{row_index}-{8 hex digits}"`: readable in logs, unique per lease."""
    return f"{row_index}-{uuid.uuid4().hex[:8]}"


def row_of_group(group_id: str) -> str:
    """The row index part of a `new_group_id`: the same for every lease of one row."""
    return group_id.rsplit("-", 1)[0]


def row_to_prompt_item(row: dict[str, Any], row_index: int, n: int) -> PromptItem:
    """A verl-schema row -> the lease of one group of `n` samples.

    `row["prompt"]` is a list of `{role, content}` messages or a plain string (one user
    message); `extra_info`, `tools_kwargs` and `interaction_kwargs` must be JSON objects (numpy
    values from parquet readers are converted). Raises ValueError naming the field when the row
    does not fit the schema.
    """
    for key in ("data_source", "prompt", "reward_model"):
        if key not in row:
            raise ValueError(f"row {row_index}: missing field {key!r}")
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError(f"row {row_index}: reward_model must be a mapping with ground_truth")
    try:
        messages = prompt_messages(row["prompt"])
    except ValueError as e:
        raise ValueError(f"row {row_index}: {e}") from None
    return PromptItem(
        group_id=new_group_id(row_index),
        n=n,
        data_source=str(row["data_source"]),
        messages=[ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        ground_truth=str(reward_model["ground_truth"]),
        extra_info=_json_object(row, "extra_info", row_index),
        agent_name=str(row.get("agent_name") or ""),
        tools_kwargs=_json_object(row, "tools_kwargs", row_index),
        interaction_kwargs=_json_object(row, "interaction_kwargs", row_index),
    )


def _json_object(row: dict[str, Any], key: str, row_index: int) -> dict[str, Any]:
    """`row[key]` as a JSON object of plain values ({} when absent or None)."""
    value = _plain(row.get(key) or {}, f"row {row_index}: {key}")
    if not isinstance(value, dict):
        raise ValueError(f"row {row_index}: {key} must be a mapping, got {type(value).__name__}")
    return value


def _plain(value: Any, where: str) -> Any:
    """What parquet readers hand back (numpy scalars and arrays, tuples) as plain JSON values."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.ndarray, list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"{where}: mapping keys must be strings")
        return {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"{where}: a value of type {type(value).__name__} is not JSON")
