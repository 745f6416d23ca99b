"""The embedded reward model: it learns to prefer right `arith` answers in a few supervised
steps, saves a directory `AutoModelForSequenceClassification` loads, and is cached."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from asyncrl.demo.reward_model import (
    RewardModelSpec,
    heldout_accuracy,
    main,
    near_wrong,
    prepare_reward_model,
    render_scored,
)
from asyncrl.demo.tasks import ArithmeticTask
from asyncrl.demo.tiny_model import build_tokenizer

TEST_STEPS = 500
TEST_SPEC = RewardModelSpec(batch_prompts=16, lr=2e-3)
"""Half the CLI's batch at twice its rate, 500 of its 600 steps (~12 s alone on one core).
Held-out accuracy measured with this recipe over seeds 0-7: 0.74-0.98 (seed 0, the one
tested: 0.86)."""
MIN_ACCURACY = 0.7
"""Chance is 0.5; the worst of the 8 seeds measured gave 0.74."""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    cache = tmp_path_factory.mktemp("rm-cache")
    logs: list[str] = []
    path = prepare_reward_model(cache, ArithmeticTask(), TEST_STEPS, 0, logs.append, TEST_SPEC)
    return path, logs


def test_prefers_correct_answers_on_fresh_prompts(built: tuple[Path, list[str]]) -> None:
    path, logs = built
    report = json.loads((path / "asyncrl_reward_model.json").read_text())
    assert report["heldout_accuracy"] >= MIN_ACCURACY, report
    assert report["mean_gap"] > 0.5, report
    assert any("held-out accuracy" in line for line in logs)


def test_saved_directory_loads_as_a_one_label_classifier(built: tuple[Path, list[str]]) -> None:
    path, _ = built
    model = AutoModelForSequenceClassification.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.num_labels == 1
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    report = json.loads((path / "asyncrl_reward_model.json").read_text())
    accuracy, gap = heldout_accuracy(model, tokenizer, ArithmeticTask(), seed=0)
    assert accuracy == pytest.approx(report["heldout_accuracy"])
    assert gap == pytest.approx(report["mean_gap"], rel=1e-4, abs=1e-4)
    # a padded batch scores each text as it scores alone (the logit of its last real token)
    messages = ArithmeticTask().row(3, 4)["prompt"]
    short, long = render_scored(tokenizer, messages, "7"), render_scored(tokenizer, messages, "17")
    ids = torch.full((2, len(long)), tokenizer.pad_token_id)
    ids[0, : len(short)], ids[1] = torch.tensor(short), torch.tensor(long)
    with torch.inference_mode():
        batched = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long())
        alone = model(input_ids=torch.tensor([short])).logits[0, 0]
    assert batched.logits[0, 0] == pytest.approx(float(alone), abs=1e-4)


def test_cache_returns_the_same_directory_without_retraining(
    built: tuple[Path, list[str]],
) -> None:
    path, _ = built
    logs: list[str] = []
    again = prepare_reward_model(
        path.parent, ArithmeticTask(), TEST_STEPS, 0, logs.append, TEST_SPEC
    )
    assert again == path and logs == []


def test_texts_are_rendered_as_the_server_renders_a_rollout() -> None:
    tokenizer = build_tokenizer()
    ids = render_scored(tokenizer, [{"role": "user", "content": "3+4="}], "7")
    assert tokenizer.decode(ids) == "<|user|>3+4=</s><|assistant|>7</s>"


def test_near_wrong_answers_are_off_by_one_or_two_and_never_negative() -> None:
    rng = random.Random(0)
    for correct in range(19):
        for _ in range(50):
            wrong = near_wrong(rng, correct)
            assert wrong != correct and wrong >= 0 and abs(wrong - correct) <= 2


def test_cli_builds_and_prints_the_heldout_accuracy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir, cache = tmp_path / "rm", tmp_path / "cache"
    main(["--out", str(out_dir), "--steps", "0", "--cache-dir", str(cache)])
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and str(out_dir) in out
    assert (out_dir / "config.json").is_file()  # a plain model directory: reward.model.path=DIR
    main(["--out", str(out_dir), "--steps", "0", "--cache-dir", str(cache)])  # again: fine
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "busy"), "--steps", "0", "--cache-dir", str(cache)])
