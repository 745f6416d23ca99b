"""GSM8K in the verl schema: the final-answer parser the reward uses, and the preparation of the
jsonl release (`asyncrl data gsm8k`) exactly as verl's `examples/data_preprocess/gsm8k.py` does it
(same instruction, same ground-truth extraction).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import pyarrow as pa

from asyncrl.data.prompts import write_rows

GSM8K_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
"""verl's gsm8k instruction, appended to every question after one space."""

_FINAL_ANSWER = re.compile(r"####\s*(-?)\s*\$?\s*(-?)(\d[\d,]*(?:\.\d+)?|\.\d+)")

_GSM8K_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("answer", pa.string()),
                    ("question", pa.string()),
                ]
            ),
        ),
    ]
)


# ---- GSM8K ----------------------------------------------------------------------------------
def gsm8k_final_answer(text: str) -> str | None:
    """The number after the last `#### ` in `text`, normalised (commas and `$` dropped), or None.

    Accepts what models write: `#### 1,234`, `#### $5`, `#### -3`, `#### 2.5`. The same parser
    reads the reference answers at preparation time and the responses at reward time, so a
    reference always scores 1.0 against itself.
    """
    matches = _FINAL_ANSWER.findall(text)
    if not matches:
        return None
    sign_before, sign_after, number = matches[-1]
    negative = (sign_before == "-") != (sign_after == "-")
    return ("-" if negative else "") + number.replace(",", "")


def same_number(answer: str, ground_truth: str) -> bool:
    """Whether a final answer equals the ground truth as a number (`1,000`, `$5` and `5.0` read
    as numbers; text that is not a number is compared as it is)."""
    truth = ground_truth.strip().replace(",", "").replace("$", "")
    try:
        return Decimal(answer) == Decimal(truth)
    except InvalidOperation:
        return answer == truth


def gsm8k_row(
    question: str, answer: str, ground_truth: str, split: str, index: int
) -> dict[str, Any]:
    """One verl-schema row of GSM8K (the layout of verl's gsm8k.py, field for field)."""
    return {
        "data_source": GSM8K_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def prepare_gsm8k(input_dir: str | Path, output_dir: str | Path) -> dict[str, int]:
    """`{train,test}.jsonl` of the GSM8K release -> `{train,test}.parquet`; returns row counts.

    Raises ValueError naming the file and 1-based line of the first malformed line (not JSON,
    no string `question`/`answer`, or an answer without a final `#### N`).
    """
    input_dir, output_dir = Path(input_dir), Path(output_dir)
    counts = {}
    for split in ("train", "test"):
        rows = [
            gsm8k_row(q, a, gt, split, i)
            for i, (q, a, gt) in enumerate(_read_gsm8k_jsonl(input_dir / f"{split}.jsonl"))
        ]
        write_rows(rows, output_dir / f"{split}.parquet", schema=_GSM8K_SCHEMA)
        counts[split] = len(rows)
    return counts


def _read_gsm8k_jsonl(path: Path) -> Iterator[tuple[str, str, str]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected the GSM8K {path.stem} split)")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            question, answer = record.get("question"), record.get("answer")
            if not isinstance(question, str) or not isinstance(answer, str):
                raise ValueError(f"{path}:{lineno}: needs string fields 'question' and 'answer'")
            ground_truth = gsm8k_final_answer(answer)
            if ground_truth is None:
                raise ValueError(f"{path}:{lineno}: answer has no final '#### N' line")
            yield question, answer, ground_truth
