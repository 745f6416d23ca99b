"""`data.task=search_qa`: look a made-up fact up with the `search` tool (the search demo,
`configs/search_agent.yaml`, docs/agents.md).

The corpus holds one passage per invented name ("The code of zorvia is 4817."), so no model can
know an answer without retrieving it: answering directly is a guess, and a `search` call with
the name from the question, followed by copying the code from the passage, is always right.
The corpus is generated from a fixed seed and committed as `configs/data/search_corpus.jsonl`
(`python -m asyncrl.demo.search_task configs/data/search_corpus.jsonl` writes it again; a test
keeps the two equal).

The warm-start conversations (for the embedded tiny model) use the tool in half of the cases
and miscall it in some of those (a misspelt name, which the index does not hold), so the
policy starts guessing half of the time; reinforcement learning on the exact-match reward must find that
searching pays. A conversation's tool message is the text the `search` tool returns for the
query with `top_k` 1 (`tool_response`; a test checks it against the tool itself).
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

SEARCH_QA_SOURCE = "asyncrl/search_qa"
NO_RESULTS = "No results."
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def invent_names(count: int, seed: int) -> list[str]:
    """`count` distinct pronounceable six-letter names (three consonant-vowel syllables)."""
    rng = random.Random(seed)
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < count:
        name = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(3))
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


@dataclass(frozen=True)
class SearchQATask:
    """Questions about the codes of invented names, answerable only through retrieval."""

    num_entities: int = 200
    """Passages in the corpus (one per name)."""
    corpus_seed: int = 1234
    """Seed of the names and codes (the committed corpus is this seed's)."""
    seed: int = 0
    """Seed of the question stream."""
    p_tool: float = 0.5
    """Warm-start: share of conversations that call `search` (at 0.25, 400 steps left the
    tiny model unable to copy a code from the passage: 0 of 60 greedy copies right; at 0.5,
    45 of 60)."""
    p_tool_miscall: float = 0.3
    """Warm-start: share of those whose query misspells the name (no result)."""

    source = SEARCH_QA_SOURCE

    @cached_property
    def facts(self) -> list[tuple[str, str]]:
        """(name, four-digit code) per passage, in corpus order."""
        rng = random.Random(self.corpus_seed + 1)
        names = invent_names(self.num_entities, self.corpus_seed)
        return [(name, str(rng.randint(1000, 9999))) for name in names]

    def corpus_rows(self) -> list[dict[str, str]]:
        """The corpus, one {"title", "text"} row per name (the `search` tool's jsonl layout)."""
        return [{"title": n, "text": f"The code of {n} is {c}."} for n, c in self.facts]

    def question(self, name: str) -> str:
        return f"code of {name}?"

    def row(self, i: int, index: int = 0) -> dict[str, Any]:
        """One verl-schema row asking for the code of the i-th name."""
        name, code = self.facts[i]
        return {
            "data_source": self.source,
            "prompt": [{"role": "user", "content": self.question(name)}],
            "ability": "retrieval",
            "reward_model": {"ground_truth": code, "style": "rule"},
            "extra_info": {"index": index, "name": name},
        }

    def rows(self) -> Iterator[dict[str, Any]]:
        """An endless, seeded stream of rows."""
        rng = random.Random(self.seed)
        index = 0
        while True:
            yield self.row(rng.randrange(self.num_entities), index)
            index += 1

    def val_rows(self) -> list[dict[str, Any]]:
        """Every name once, in corpus order."""
        return [self.row(i, i) for i in range(self.num_entities)]

    def tool_response(self, query: str) -> str:
        """What `search` (top_k 1, configs/tools/search_demo.yaml) answers to `query`, for the
        queries the warm-start makes: a name of the corpus, or a name it does not hold."""
        row = self._rows_by_name.get(query)
        return f"[1] {row['title']}: {row['text']}" if row else NO_RESULTS

    @cached_property
    def _rows_by_name(self) -> dict[str, dict[str, str]]:
        return {row["title"]: row for row in self.corpus_rows()}

    def _misspelt(self, rng: random.Random, name: str) -> str:
        while True:
            i = rng.randrange(len(name))
            wrong = name[:i] + rng.choice(_CONSONANTS if name[i] in _CONSONANTS else _VOWELS)
            wrong += name[i + 1 :]
            if wrong != name and wrong not in self._rows_by_name:
                return wrong

    def demonstration(self, rng: random.Random, p_correct: float) -> list[dict[str, str]]:
        """A warm-start conversation: w.p. p_tool a `search` call (misspelt w.p.
        p_tool_miscall), its result, and the code copied from it (a guess after no result);
        otherwise a direct guess. `p_correct` is unused: nothing but retrieval answers right."""
        del p_correct
        name, code = self.facts[rng.randrange(self.num_entities)]
        messages = [{"role": "user", "content": self.question(name)}]
        guess = str(rng.randint(1000, 9999))
        if rng.random() >= self.p_tool:
            return [*messages, {"role": "assistant", "content": guess}]
        query = self._misspelt(rng, name) if rng.random() < self.p_tool_miscall else name
        call = {"name": "search", "arguments": {"query": query}}
        found = self.tool_response(query)
        return [
            *messages,
            {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
            {"role": "tool", "content": found},
            {"role": "assistant", "content": code if found != NO_RESULTS else guess},
        ]


def search_qa_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None
) -> float:
    """verl's signature: 1.0 when the final reply is exactly the code (whitespace ignored)."""
    return 1.0 if solution_str.strip() == ground_truth.strip() else 0.0


def setup_search_task(data_cfg: Any) -> SearchQATask:
    """`data.task=search_qa`, seeded by data.seed (the corpus is fixed)."""
    return SearchQATask(seed=data_cfg.seed)


def write_corpus(path: str | Path, task: SearchQATask | None = None) -> None:
    """The task's corpus as jsonl at `path`."""
    rows = (task or SearchQATask()).corpus_rows()
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    write_corpus(sys.argv[1])
