"""The `search` tool: BM25 over a local corpus, loaded from a tool config like the other tools,
answers bounded in size, bad corpora and bad calls refused with a message that names them."""

from __future__ import annotations

import asyncio
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rollout_servers.agents.search_tool import SearchTool
from rollout_servers.agents.tools import load_tool_config

SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the encyclopedia.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
            "required": ["query"],
        },
    },
}
ROWS = [
    {"title": "Zorvath", "text": "Zorvath is a city on the river Kell, founded in 1204."},
    {"title": "Kell", "text": "The Kell is a long river; its source is Mount Arden."},
    {"title": "Mount Arden", "text": "Mount Arden is 3120 metres high."},
    {"title": "Lemons", "text": "Lemons are yellow citrus fruit."},
]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def call(tool, **arguments):
    return asyncio.run(tool.execute("t0", arguments))


def test_the_best_passage_comes_first_and_top_k_is_obeyed(tmp_path):
    tool = SearchTool(SCHEMA, corpus=write_jsonl(tmp_path / "c.jsonl", ROWS), top_k=2)
    got = call(tool, query="When was Zorvath founded?")
    assert got.text.startswith("[1] Zorvath: Zorvath is a city")
    assert got.metrics == {"results": 1.0}  # only one passage shares a word with the query
    got = call(tool, query="source of the river Kell", top_k=1)
    assert got.text.startswith("[1] Kell:") and "[2]" not in got.text
    two = call(tool, query="Kell river Arden")
    assert two.text.count("\n") == 1 and two.metrics["results"] == 2.0


def test_no_match_and_bad_calls_answer_in_text_and_are_counted(tmp_path):
    tool = SearchTool(SCHEMA, corpus=write_jsonl(tmp_path / "c.jsonl", ROWS), max_top_k=3)
    assert call(tool, query="quantum chromodynamics").text == "No results."
    assert call(tool, query="the of and").metrics["no_results"] == 1.0  # stop words only
    for arguments in ({"query": "   "}, {"query": "x" * 1001}, {"query": "Kell", "top_k": 4}):
        got = call(tool, **arguments)
        assert got.text.startswith("Error:") and got.metrics == {"error": 1.0}


def test_the_answer_is_bounded_whatever_the_passages(tmp_path):
    rows = [{"title": f"T{i}", "text": "kell " * 5000} for i in range(5)]
    tool = SearchTool(
        SCHEMA, corpus=write_jsonl(tmp_path / "c.jsonl", rows), top_k=5, max_passage_chars=100,
        max_response_chars=300,
    )  # fmt: skip
    text = call(tool, query="kell").text
    assert len(text) < 300 + 60  # the limit plus the marker saying what was cut
    assert "characters cut" in text


def test_a_parquet_corpus_and_the_tool_config_path(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "c.parquet")
    config = {
        "tools": [
            {
                "class_name": "search",
                "config": {"corpus": str(tmp_path / "c.parquet"), "top_k": 1},
                "tool_schema": SCHEMA,
            }
        ]
    }
    (tmp_path / "tools.yaml").write_text(yaml.safe_dump(config))
    tool = load_tool_config(tmp_path / "tools.yaml").tools["search"]
    assert call(tool, query="Mount Arden height").text.startswith("[1] Mount Arden:")


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("", "is empty"),
        ('{"title": "a", "text": "ok"}\nnot json\n', "line 2 is not JSON"),
        ('{"title": "a", "text": "ok"}\n{"title": "b"}\n', "row 1 has no text in 'text'"),
    ],
)
def test_a_bad_corpus_is_refused_naming_the_file_and_row(tmp_path, content, message):
    path = tmp_path / "c.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        SearchTool(SCHEMA, corpus=str(path))
    with pytest.raises(ValueError, match="expected a .jsonl or .parquet"):
        SearchTool(SCHEMA, corpus=write_jsonl(tmp_path / "c.txt", ROWS))
    with pytest.raises(ValueError, match="top_k <= max_top_k"):
        SearchTool(SCHEMA, corpus=write_jsonl(tmp_path / "ok.jsonl", ROWS), top_k=9)
