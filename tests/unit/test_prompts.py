"""Prompt sources of the replay: verl-schema parquet files and the embedded task."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.config import load_config
from asyncrl.data.rows import row_to_prompt_item
from replay.prompts import (
    ParquetPromptSource,
    TaskPromptSource,
    setup_prompt_source,
)


def _verl_docs_rows(n: int) -> list[dict]:
    """Rows the way verl's docs and preprocessing examples build them (a dict per row, then
    `datasets`/pandas `to_parquet`, which infers the arrow types just as `from_pylist` does)."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [
                {"role": "system", "content": "You are a careful solver."},
                {"role": "user", "content": f"What is {i} + {i}? Output the answer after ####."},
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i, "answer": f"#### {2 * i}"},
        }
        for i in range(n)
    ]


@pytest.fixture
def verl_parquet(tmp_path: Path) -> str:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_docs_rows(20)), path)
    return str(path)


def test_setup_picks_parquet_when_train_files_are_set(verl_parquet):
    cfg = load_config(overrides=[f"data.train_files=[{verl_parquet}]"])
    source = setup_prompt_source(cfg)
    assert isinstance(source, ParquetPromptSource)
    rows = [source.next_row() for _ in range(20)]
    assert sorted(r["extra_info"]["index"] for r in rows) == list(range(20))

    row = rows[0]
    item = row_to_prompt_item(row, row_index=7, n=4)
    i = row["extra_info"]["index"]
    assert item.group_id.startswith("7-") and item.n == 4
    assert item.data_source == "openai/gsm8k"
    assert [(m.role, m.content) for m in item.messages] == [
        ("system", "You are a careful solver."),
        ("user", f"What is {i} + {i}? Output the answer after ####."),
    ]
    assert item.ground_truth == str(2 * i)
    assert item.extra_info == {
        "split": "train",
        "index": i,
        "answer": f"#### {2 * i}",
    }


def test_setup_keeps_the_embedded_task_without_files():
    source = setup_prompt_source(load_config())
    assert isinstance(source, TaskPromptSource)
    assert source.next_row()["data_source"] == "asyncrl/arith"


def test_parquet_source_resumes_where_it_stopped(verl_parquet):
    cfg = load_config(overrides=[f"data.train_files=[{verl_parquet}]", "data.seed=5"])
    source = setup_prompt_source(cfg)
    for _ in range(13):
        source.next_row()
    state = json.loads(json.dumps(source.state()))
    expected = [source.next_row() for _ in range(30)]
    resumed = setup_prompt_source(cfg)
    resumed.load_state(state)
    assert [resumed.next_row() for _ in range(30)] == expected


class CharTokenizer:
    """A fake tokenizer without a chat template: one token per character."""

    chat_template = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def test_setup_applies_the_data_settings(verl_parquet, tmp_path):
    other = tmp_path / "other.parquet"
    rows_b = [{**r, "data_source": "b"} for r in _verl_docs_rows(5)]
    pq.write_table(pa.Table.from_pylist(rows_b), other)
    files = f"data.train_files=[{verl_parquet},{other}]"
    one_digit = len("\n".join(m["content"] for m in _verl_docs_rows(1)[0]["prompt"]))
    cfg = load_config(
        overrides=[files, "data.train_weights=[1,0]", f"data.max_prompt_length={one_digit}"]
    )
    source = setup_prompt_source(cfg, tokenizer=CharTokenizer())
    assert isinstance(source, ParquetPromptSource)
    assert source.reader.counters["too_long"] == 10  # "What is 10 + 10?" and up
    indices = {source.next_row()["extra_info"]["index"] for _ in range(40)}
    assert indices == set(range(10))  # only file a (weight 1), only the short prompts

    cfg = load_config(overrides=[files, "data.shuffle=false"])
    source = setup_prompt_source(cfg)
    assert [source.next_row()["extra_info"]["index"] for _ in range(22)] == [*range(20), 0, 1]


def test_row_to_prompt_item_names_the_row_of_a_bad_prompt():
    row = {**_verl_docs_rows(1)[0], "prompt": [{"role": "user", "content": 3}]}
    with pytest.raises(ValueError, match=r"row 9: prompt\[0\]\.content must be a string"):
        row_to_prompt_item(row, row_index=9, n=2)


def test_agent_columns_travel_with_the_prompt():
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "2+2?"}],
        "reward_model": {"ground_truth": "4"},
        "agent_name": "tool_agent",
        "tools_kwargs": {"calculator": {"create_kwargs": {"x": 1}}},
        "interaction_kwargs": {"name": "gsm8k_retry"},
    }
    item = row_to_prompt_item(row, 0, 2)
    assert item.agent_name == "tool_agent"
    assert item.tools_kwargs == {"calculator": {"create_kwargs": {"x": 1}}}
    assert item.interaction_kwargs == {"name": "gsm8k_retry"}
    plain = row_to_prompt_item({k: row[k] for k in ("data_source", "prompt", "reward_model")}, 1, 2)
    assert (plain.agent_name, plain.tools_kwargs, plain.interaction_kwargs) == ("", {}, {})
