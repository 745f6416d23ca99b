"""Dataset preparation, inspection and the resumable prompt reader (`asyncrl.data.prompts`)."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from asyncrl.data.gsm8k import GSM8K_INSTRUCTION, GSM8K_SOURCE, gsm8k_final_answer, prepare_gsm8k
from asyncrl.data.prompts import PromptReader, PromptTooLongError, inspect_parquet, write_rows
from asyncrl.data.rows import BadRowError
from rollout_servers.rewards.functions import gsm8k_reward_fn

GSM8K_DIR = Path(os.environ.get("ASYNCRL_GSM8K_DIR", "/work/shared/data/gsm8k"))


@pytest.fixture(scope="module")
def gsm8k_parquet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    out = tmp_path_factory.mktemp("gsm8k")
    return out, prepare_gsm8k(GSM8K_DIR, out)


def _write(path: Path, rows: list[dict]) -> str:
    return str(write_rows(rows, path))


def _row(source: str, i: int, prompt: object = None) -> dict:
    return {
        "data_source": source,
        "prompt": prompt if prompt is not None else [{"role": "user", "content": f"{source} {i}"}],
        "ability": "test",
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"index": i},
    }


@pytest.fixture
def two_files(tmp_path: Path) -> list[str]:
    return [
        _write(tmp_path / "a.parquet", [_row("a", i) for i in range(50)]),
        _write(tmp_path / "b.parquet", [_row("b", i) for i in range(30)]),
    ]


class WordTokenizer:
    """A fake tokenizer without a chat template: one token per whitespace-separated word."""

    chat_template = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(range(len(text.split())))}


class TemplateTokenizer:
    """A fake chat tokenizer: `<|role|>content` per message, one token per word plus one per
    message and one for the generation prompt; `tokenize=True` answers like transformers 5."""

    chat_template = "fake"

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool, tokenize: bool
    ) -> object:
        text = "".join(f"<|{m['role']}|>{m['content']}" for m in messages) + "<|assistant|>"
        if not tokenize:
            return text
        n = sum(len(m["content"].split()) + 1 for m in messages) + 1
        return {"input_ids": list(range(n))}


# ---- GSM8K preparation ----------------------------------------------------------------------
def test_prepare_gsm8k_gives_the_published_split_sizes(gsm8k_parquet):
    out, counts = gsm8k_parquet
    assert counts == {"train": 7473, "test": 1319}
    assert pq.read_metadata(out / "train.parquet").num_rows == 7473
    assert pq.read_metadata(out / "test.parquet").num_rows == 1319


def test_prepared_rows_follow_the_verl_gsm8k_layout(gsm8k_parquet):
    out, _ = gsm8k_parquet
    row = pq.read_table(out / "test.parquet").slice(0, 1).to_pylist()[0]
    first = json.loads((GSM8K_DIR / "test.jsonl").read_text().splitlines()[0])
    assert row == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{first['question']} {GSM8K_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "18"},
        "extra_info": {
            "split": "test",
            "index": 0,
            "answer": first["answer"],
            "question": first["question"],
        },
    }
    assert (
        GSM8K_INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    )
    truths = pq.read_table(out / "train.parquet").column("reward_model").to_pylist()
    assert all("," not in t["ground_truth"] for t in truths)


@pytest.mark.parametrize("split", ["test", "train"])
def test_gsm8k_reward_accepts_every_reference_and_rejects_a_changed_number(gsm8k_parquet, split):
    out, _ = gsm8k_parquet
    rows = pq.read_table(out / f"{split}.parquet").to_pylist()
    for row in rows:
        answer, truth = row["extra_info"]["answer"], row["reward_model"]["ground_truth"]
        assert gsm8k_reward_fn(GSM8K_SOURCE, answer, truth) == 1.0, row["extra_info"]["index"]
        wrong = re.sub(r"#### .*$", f"#### {int(float(truth)) + 1}", answer)
        assert gsm8k_reward_fn(GSM8K_SOURCE, wrong, truth) == 0.0, row["extra_info"]["index"]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "not valid JSON"),
        ('{"question": "q"}', "needs string fields"),
        ('{"question": "q", "answer": "no final line"}', "answer has no final '#### N'"),
    ],
)
def test_prepare_gsm8k_names_file_and_line_of_a_malformed_line(tmp_path, line, problem):
    good = json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"})
    (tmp_path / "train.jsonl").write_text(f"{good}\n{good}\n{line}\n")
    (tmp_path / "test.jsonl").write_text(f"{good}\n")
    with pytest.raises(ValueError, match=re.escape(f"train.jsonl:3: {problem}")):
        prepare_gsm8k(tmp_path, tmp_path / "out")


def test_gsm8k_final_answer_reads_what_models_write():
    assert gsm8k_final_answer("so #### 1,234") == "1234"
    assert gsm8k_final_answer("#### $5.50.") == "5.50"
    assert gsm8k_final_answer("#### -3") == "-3"
    assert gsm8k_final_answer("#### $-3") == "-3"
    assert gsm8k_final_answer("#### 1 then #### 2") == "2"
    assert gsm8k_final_answer("the answer is 7") is None


# ---- inspect --------------------------------------------------------------------------------
def test_inspect_reports_counts_types_lengths_and_rows(gsm8k_parquet):
    out, _ = gsm8k_parquet
    text = inspect_parquet(out / "test.parquet", num_rows=2)
    assert "rows: 1319" in text
    assert "prompt: list<element: struct<role: string, content: string>>" in text
    assert "openai/gsm8k: 1319" in text
    assert re.search(r"prompt length \(characters\): min \d+  p50 \d+  p90 \d+  max \d+", text)
    assert text.count("--- row ") == 2
    assert "[user] Janet" in text


def test_inspect_with_a_tokenizer_renders_the_chat_template(tmp_path):
    path = _write(tmp_path / "x.parquet", [_row("a", i) for i in range(4)])
    text = inspect_parquet(path, tokenizer=TemplateTokenizer(), num_rows=1)
    assert "prompt length (tokens): min 4  p50 4  p90 4  max 4" in text
    assert "<|user|>a 0<|assistant|>" in text


def test_inspect_counts_malformed_prompts_instead_of_failing(tmp_path):
    rows = [_row("a", 0), {**_row("a", 1), "prompt": None}]
    text = inspect_parquet(_write(tmp_path / "x.parquet", rows))
    assert "malformed prompts: 1" in text


# ---- bad rows -------------------------------------------------------------------------------
def test_bad_rows_fail_naming_file_and_row(tmp_path):
    rows = [_row("a", 0), {**_row("a", 1), "prompt": None}]
    path = _write(tmp_path / "missing.parquet", rows)
    with pytest.raises(BadRowError, match=r"missing\.parquet: row 1: missing 'prompt'"):
        PromptReader([path])

    path = _write(tmp_path / "wrong.parquet", [{**_row("a", 0), "prompt": 17}])
    with pytest.raises(BadRowError, match=r"wrong\.parquet: row 0: 'prompt' must be a string"):
        PromptReader([path])

    rows = [_row("a", 0), _row("a", 1), {**_row("a", 2), "reward_model": {"style": "rule"}}]
    path = _write(tmp_path / "truth.parquet", rows)
    with pytest.raises(BadRowError, match=r"truth\.parquet: row 2: missing 'reward_model"):
        PromptReader([path])


def test_bad_rows_are_skipped_and_counted_when_asked(tmp_path):
    rows = [_row("a", i) for i in range(6)]
    rows[1]["prompt"] = None
    rows[4]["prompt"] = [{"role": "user", "content": None}]
    reader = PromptReader([_write(tmp_path / "x.parquet", rows)], skip_bad_rows=True)
    assert reader.counters["bad_rows"] == 2 and reader.counters["rows"] == 4
    seen = sorted(next(reader)["extra_info"]["index"] for _ in range(4))
    assert seen == [0, 2, 3, 5]
    assert "2 bad rows skipped" in reader.summary()


def test_write_rows_round_trips_and_leaves_no_temporary_file(tmp_path):
    rows = [_row("a", i) for i in range(3)]
    path = write_rows(rows, tmp_path / "new" / "x.parquet")
    assert pq.read_table(path).to_pylist() == rows
    assert [p.name for p in path.parent.iterdir()] == ["x.parquet"]


def test_string_prompts_are_accepted(tmp_path):
    path = _write(tmp_path / "x.parquet", [_row("a", 0, prompt="just text")])
    assert next(PromptReader([path]))["prompt"] == "just text"


# ---- prompt length policy -------------------------------------------------------------------
def test_too_long_prompts_are_filtered_and_counted(tmp_path):
    rows = [_row("a", i, prompt=" ".join(["w"] * (i + 1))) for i in range(10)]
    path = _write(tmp_path / "x.parquet", rows)
    reader = PromptReader([path], tokenizer=WordTokenizer(), max_prompt_length=4)
    assert reader.counters["too_long"] == 6 and reader.counters["rows"] == 4
    assert {next(reader)["extra_info"]["index"] for _ in range(8)} == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="none of its 10 rows is usable .0 bad, 10 over"):
        PromptReader([path], tokenizer=WordTokenizer(), max_prompt_length=0)


def test_too_long_prompts_fail_naming_file_row_and_length(tmp_path):
    rows = [_row("a", i, prompt=" ".join(["w"] * (i + 1))) for i in range(10)]
    path = _write(tmp_path / "x.parquet", rows)
    with pytest.raises(PromptTooLongError, match=r"x\.parquet: row 4: prompt is 5 tokens"):
        PromptReader([path], tokenizer=WordTokenizer(), max_prompt_length=4, too_long="fail")


# ---- order, mixing, resume ------------------------------------------------------------------
def test_each_epoch_is_a_fresh_permutation_of_all_rows(two_files):
    reader = PromptReader(two_files, seed=3)
    key = [(r["data_source"], r["extra_info"]["index"]) for r in (next(reader) for _ in range(160))]
    first, second = key[:80], key[80:]
    assert len(set(first)) == 80 and set(first) == set(second)
    assert first != second
    unshuffled = PromptReader(two_files, shuffle=False)
    assert [next(unshuffled)["extra_info"]["index"] for _ in range(51)] == [*range(50), 0]


def test_mixing_weights_are_roughly_respected(two_files):
    reader = PromptReader(two_files, weights=[3, 1], seed=0)
    counts = Counter(next(reader)["data_source"] for _ in range(4000))
    assert counts["a"] / 4000 == pytest.approx(0.75, abs=0.03)


def test_a_file_with_weight_zero_is_never_drawn(two_files):
    reader = PromptReader(two_files, weights=[1, 0])
    assert {next(reader)["data_source"] for _ in range(200)} == {"a"}


@pytest.mark.parametrize("weights", [None, [0.6, 0.4]])
def test_resume_from_saved_state_continues_the_same_stream(two_files, weights):
    original = PromptReader(two_files, weights=weights, seed=11)
    for _ in range(97):  # past the first epoch of both files
        next(original)
    state = json.loads(json.dumps(original.state()))
    expected = [next(original) for _ in range(150)]
    resumed = PromptReader(two_files, weights=weights, seed=11)
    resumed.load_state(state)
    assert [next(resumed) for _ in range(150)] == expected


def test_state_of_other_files_is_refused(two_files, tmp_path):
    state = PromptReader(two_files).state()
    other = _write(tmp_path / "c.parquet", [_row("c", i) for i in range(5)])
    with pytest.raises(ValueError, match="does not fit these files"):
        PromptReader([two_files[0], other]).load_state(state)


def test_bad_weights_are_refused(two_files):
    with pytest.raises(ValueError, match="one per file"):
        PromptReader(two_files, weights=[1.0])
    with pytest.raises(ValueError, match="not all 0"):
        PromptReader(two_files, weights=[0, 0])
