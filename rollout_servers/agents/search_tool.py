"""The `search` tool: BM25 retrieval over a local corpus, for Search-R1 style agents.

    tools:
      - class_name: search
        config:
          corpus: data/corpus.jsonl   # .jsonl or .parquet, one passage per row
          text_field: text            # the passage (required in every row)
          title_field: title          # optional: shown before the passage when the row has it
          top_k: 3                    # passages returned when the call does not ask
          max_top_k: 5                # the most a call may ask for
          max_passage_chars: 400      # each passage is cut to this
          max_response_chars: 1500    # the whole answer is cut to this
        tool_schema: {...}            # arguments: query (string), top_k (integer, optional)

The index is built once per server when the tool config is loaded (bm25s, Lucene's BM25 with
k1 = 1.5 and b = 0.75 by default, English stop words removed); a call retrieves the passages
whose score is above 0 and returns them numbered, `[1] Title: text`, so an answer is bounded by
`max_response_chars` (plus a one-line marker saying how much was cut) however the model asks. A query with no indexed word returns "No results."
(metric `no_results`); an empty or overlong query is refused as text (metric `error`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout_servers.agents.tools import Tool, ToolResponse, truncate_middle

MAX_QUERY_CHARS = 1000


def load_corpus(path: str | Path, text_field: str, title_field: str | None) -> list[dict[str, str]]:
    """Rows {text, title} of a .jsonl or .parquet corpus; ValueError naming the file and row
    when a row has no text."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"search corpus {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows: list[Any] = pq.read_table(path).to_pylist()
    elif path.suffix == ".jsonl":
        rows = []
        for i, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"search corpus {path}: line {i + 1} is not JSON: {e}") from e
    else:
        raise ValueError(f"search corpus {path}: expected a .jsonl or .parquet file")
    passages = []
    for i, row in enumerate(rows):
        text = row.get(text_field) if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"search corpus {path}: row {i} has no text in {text_field!r}")
        title = row.get(title_field) if title_field else None
        passages.append({"text": text, "title": title if isinstance(title, str) else ""})
    if not passages:
        raise ValueError(f"search corpus {path} is empty")
    return passages


class SearchTool(Tool):
    """BM25 over a local corpus (module docstring); the index is read-only, so one instance
    serves every trajectory of the server."""

    def __init__(
        self,
        schema: Mapping[str, Any],
        corpus: str,
        text_field: str = "text",
        title_field: str | None = "title",
        top_k: int = 3,
        max_top_k: int = 5,
        max_passage_chars: int = 400,
        max_response_chars: int = 1500,
        k1: float = 1.5,
        b: float = 0.75,
    ):
        super().__init__(schema)
        if not 1 <= top_k <= max_top_k:
            raise ValueError(f"need 1 <= top_k <= max_top_k, got {top_k} and {max_top_k}")
        if max_passage_chars < 20 or max_response_chars < max_passage_chars:
            raise ValueError("need max_passage_chars >= 20 and max_response_chars >= it")
        import bm25s  # the `search` extra

        self._bm25s = bm25s
        self.passages = load_corpus(corpus, text_field, title_field)
        self.top_k, self.max_top_k = top_k, max_top_k
        self.max_passage_chars, self.max_response_chars = max_passage_chars, max_response_chars
        texts = [f"{p['title']} {p['text']}" for p in self.passages]
        self.index = bm25s.BM25(k1=k1, b=b)
        self.index.index(self._tokenize(texts), show_progress=False)

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        return self._bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    def search(self, query: str, top_k: int) -> list[tuple[int, float]]:
        """(passage index, score) of the best `top_k` passages with a score above 0."""
        tokens = self._tokenize([query])
        if not tokens[0]:
            return []
        k = min(top_k, len(self.passages))
        found = self.index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        pairs = zip(found.documents[0].tolist(), found.scores[0].tolist(), strict=True)
        return [(int(i), float(s)) for i, s in pairs if s > 0]

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        query = arguments["query"]
        top_k = arguments.get("top_k", self.top_k)
        if not query.strip():
            return ToolResponse("Error: the query is empty", metrics={"error": 1.0})
        if len(query) > MAX_QUERY_CHARS:
            return ToolResponse(
                f"Error: the query is over {MAX_QUERY_CHARS} characters", metrics={"error": 1.0}
            )
        if not isinstance(top_k, int) or not 1 <= top_k <= self.max_top_k:
            return ToolResponse(
                f"Error: top_k must be an integer from 1 to {self.max_top_k}",
                metrics={"error": 1.0},
            )
        hits = await asyncio.to_thread(self.search, query, top_k)
        if not hits:
            return ToolResponse("No results.", metrics={"no_results": 1.0, "results": 0.0})
        return ToolResponse(self.format(hits), metrics={"results": float(len(hits))})

    def format(self, hits: list[tuple[int, float]]) -> str:
        """`[n] Title: passage` per hit, each passage and then the whole cut to their limits."""
        lines = []
        for n, (i, _) in enumerate(hits, start=1):
            p = self.passages[i]
            text = truncate_middle(p["text"], self.max_passage_chars)
            lines.append(f"[{n}] {p['title']}: {text}" if p["title"] else f"[{n}] {text}")
        return truncate_middle("\n".join(lines), self.max_response_chars)
