"""The search demo's task: its committed corpus, its rows, its reward and its warm-start
conversations (which must fit the tiny model and train only the assistant's turns)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from asyncrl.demo.search_task import NO_RESULTS, SearchQATask, search_qa_score
from asyncrl.demo.tiny_model import build_tokenizer, render_conversation

CORPUS = Path(__file__).parents[2] / "configs/data/search_corpus.jsonl"


def test_the_committed_corpus_is_the_generators():
    rows = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    assert rows == SearchQATask().corpus_rows()
    assert len({r["title"] for r in rows}) == len(rows) == 200


def test_rows_ask_every_name_and_the_reward_is_an_exact_match():
    task = SearchQATask()
    val = task.val_rows()
    assert [r["extra_info"]["name"] for r in val] == [n for n, _ in task.facts]
    stream = iter(task.rows())
    first = [next(stream)["extra_info"]["name"] for _ in range(20)]
    again = iter(SearchQATask().rows())
    assert first == [next(again)["extra_info"]["name"] for _ in range(20)]
    code = val[0]["reward_model"]["ground_truth"]
    assert search_qa_score("asyncrl/search_qa", f" {code}\n", code) == 1.0
    assert search_qa_score("asyncrl/search_qa", f"{code}0", code) == 0.0
    assert search_qa_score("asyncrl/search_qa", f"It is {code}", code) == 0.0


def test_demonstrations_mix_guesses_searches_and_misspelt_searches():
    task, rng = SearchQATask(), random.Random(1)
    kinds = {"guess": 0, "found": 0, "missed": 0}
    for _ in range(1000):
        demo = task.demonstration(rng, 0.35)
        code = dict(task.facts)[demo[0]["content"][len("code of ") : -1]]
        if len(demo) == 2:
            kinds["guess"] += 1
        elif demo[2]["content"] == NO_RESULTS:
            kinds["missed"] += 1
            query = json.loads(demo[1]["content"][11:-12])["arguments"]["query"]
            assert query not in dict(task.facts)
        else:
            kinds["found"] += 1
            assert demo[3]["content"] == code and code in demo[2]["content"]
    assert 430 < kinds["guess"] < 570 and 280 < kinds["found"] < 420 and 100 < kinds["missed"] < 200


def test_a_search_conversation_fits_the_tiny_model_and_trains_only_assistant_turns():
    task, tokenizer, rng = SearchQATask(), build_tokenizer(), random.Random(2)
    longest = 0
    for _ in range(200):
        demo = task.demonstration(rng, 0.35)
        ids, mask = render_conversation(tokenizer, demo)
        longest = max(longest, len(ids))
        trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        if len(demo) == 4:
            assert demo[2]["content"] not in trained
    assert longest < 200  # max_position_embeddings is 256
