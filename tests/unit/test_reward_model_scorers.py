"""The reward-model scorers on tiny random models built here (nothing downloaded): a classifier's
score is its score head on the last real token's hidden state, computed here by hand; padding,
batching and truncation change nothing but what they must; a judge's answer is parsed as the
config says, and an answer without a score is an error scored 0, never a raise."""

from __future__ import annotations

import math
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from asyncrl.config.reward import RewardModelConfig
from asyncrl.demo.tiny_model import CHAT_TEMPLATE, build_tokenizer
from asyncrl.wire.protocol import ChatMessage
from asyncrl.wire.reward_protocol import ScoreItem
from reward_models.scorers import (
    ClassifierScorer,
    JudgeScorer,
    fill_template,
    keep_end,
    parse_judge_score,
    setup_scorer,
    unused_id,
)


def _llama_config(tokenizer, **kw) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **kw,
    )


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def classifier(tokenizer):
    torch.manual_seed(0)
    return LlamaForSequenceClassification(_llama_config(tokenizer, num_labels=1)).eval()


def _item(prompt: str, response: str, **kw) -> ScoreItem:
    messages = [ChatMessage("system", "Answer briefly."), ChatMessage("user", prompt)]
    return ScoreItem(messages=messages, response=response, **kw)


ITEMS = [
    _item("What is 2+3?", "5"),
    _item("Name a colour.", "Blue, the colour of the sky on a clear day."),
    _item("Say hi", ""),
    _item("What is 12*12? Think step by step.", "12*12 = 144. The answer is 144."),
]


def _by_hand(model, ids: list[int]) -> float:
    """The score head on the last token's hidden state: no padding, no pooling by HF."""
    with torch.inference_mode():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        return float(model.score(hidden)[0])


def _ids(tokenizer, item: ScoreItem) -> list[int]:
    messages = [{"role": m.role, "content": m.content} for m in item.messages]
    messages.append({"role": "assistant", "content": item.response})
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_classifier_scores_the_logit_at_the_end_of_the_conversation(tokenizer, classifier):
    scorer = ClassifierScorer(classifier, tokenizer, max_length=1024, max_batch=8)
    scored = scorer.score(ITEMS)
    expected = [_by_hand(classifier, _ids(tokenizer, item)) for item in ITEMS]
    assert [e for _, e in scored] == [""] * len(ITEMS)
    assert [s for s, _ in scored] == pytest.approx(expected, abs=1e-5)
    assert len({round(s, 6) for s, _ in scored}) == len(ITEMS)  # the texts differ, so do scores


def test_batching_and_padding_change_no_score(tokenizer, classifier):
    alone = ClassifierScorer(classifier, tokenizer, max_length=1024, max_batch=1).score(ITEMS)
    together = ClassifierScorer(classifier, tokenizer, max_length=1024, max_batch=3).score(ITEMS)
    assert [e for _, e in alone] == [e for _, e in together] == [""] * len(ITEMS)
    scores = torch.tensor([[s for s, _ in alone], [s for s, _ in together]])
    assert torch.allclose(scores[0], scores[1], atol=1e-5)


def test_a_pad_token_that_also_ends_each_message_does_not_move_the_score(classifier):
    """Padding with EOS (which the chat template writes after every message) would make HF
    score the token before the last one; the scorer pads with an id the batch never uses."""
    tok = build_tokenizer()
    tok.pad_token = tok.eos_token
    scored = ClassifierScorer(classifier, tok, max_length=1024, max_batch=8).score(ITEMS)
    expected = [_by_hand(classifier, _ids(tok, item)) for item in ITEMS]
    assert [s for s, _ in scored] == pytest.approx(expected, abs=1e-5)


def test_unused_id_prefers_the_pad_token_and_knows_when_there_is_none():
    assert unused_id([[1, 2], [3]], preferred=0, vocab_size=5) == 0
    assert unused_id([[0, 2], [3]], preferred=0, vocab_size=5) == 1
    assert unused_id([[0, 1, 2, 3, 4]], preferred=0, vocab_size=5) is None


def test_truncation_keeps_the_end_where_the_response_is(tokenizer, classifier):
    assert keep_end([1, 2, 3, 4], 2) == [3, 4] and keep_end([1, 2], 5) == [1, 2]
    item = _item("x" * 300, "The answer is 42.")
    full = _ids(tokenizer, item)
    scorer = ClassifierScorer(classifier, tokenizer, max_length=40, max_batch=4)
    (score, error), *_ = scorer.score([item, ITEMS[0]])
    assert error == "" and len(full) > 40
    assert score == pytest.approx(_by_hand(classifier, full[-40:]), abs=1e-5)
    assert tokenizer.decode(full[-40:], skip_special_tokens=True).endswith("The answer is 42.")


def test_one_item_the_template_refuses_fails_alone(classifier):
    tok = build_tokenizer()
    refuse = "{% if message['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    tok.chat_template = CHAT_TEMPLATE.replace(
        "{% for message in messages %}", "{% for message in messages %}" + refuse
    )
    bad = ScoreItem(messages=[ChatMessage("tool", "out")], response="r")
    scorer = ClassifierScorer(classifier, tok, max_length=1024, max_batch=8)
    scored = scorer.score([ITEMS[0], bad, ITEMS[1]])
    assert scored[1][0] == 0.0 and "no tools here" in scored[1][1]
    assert [s for s, _ in (scored[0], scored[2])] == pytest.approx(
        [s for s, _ in scorer.score([ITEMS[0], ITEMS[1]])], abs=1e-5
    )


def test_judge_answers_are_parsed_by_the_regex_times_the_scale():
    regex = re.compile(RewardModelConfig().score_regex)
    assert parse_judge_score("Score: 7", regex, 0.1) == pytest.approx((0.7, ""))
    assert parse_judge_score("I think... Score: 8.5\nScore: 1", regex, 1.0) == (8.5, "")
    assert parse_judge_score("Score:-2", regex, 0.5) == (-1.0, "")
    score, error = parse_judge_score("It is good. " * 20, regex, 0.1)
    assert score == 0.0 and error.startswith("no score in the judge's answer: 'It is good.")
    assert len(error) < 150  # the answer is quoted by its first 100 characters only
    for answer, pattern in [("Score: nan", r"Score: (\S+)"), ("Score: inf", r"Score: (\S+)")]:
        score, error = parse_judge_score(answer, re.compile(pattern), 1.0)
        assert score == 0.0 and error.startswith("no score")
    assert parse_judge_score("Score: x", re.compile(r"Score: (\d+)?"), 1.0)[0] == 0.0


def test_the_template_is_filled_once_so_braces_in_a_response_stay_as_written():
    item = ScoreItem(
        messages=[
            ChatMessage("user", "first"),
            ChatMessage("assistant", "a"),
            ChatMessage("user", "Q?"),
        ],
        response="{ground_truth} {x} }{",
        data_source="gsm8k",
        ground_truth="42",
    )
    filled = fill_template("[{prompt}|{response}|{ground_truth}|{data_source}|{other}]", item)
    assert filled == "[Q?|{ground_truth} {x} }{|42|gsm8k|{other}]"


def test_a_judge_whose_answer_holds_no_score_scores_zero_with_its_reason(tokenizer):
    torch.manual_seed(0)
    judge = LlamaForCausalLM(_llama_config(tokenizer)).eval()
    cfg = RewardModelConfig(
        kind="judge", max_new_tokens=6, max_batch=2, max_length=64, answer_prefix=""
    )
    scorer = JudgeScorer(judge, tokenizer, cfg)
    scored = scorer.score(ITEMS)
    assert all(s == 0.0 and e.startswith("no score in the judge's answer") for s, e in scored)
    # left padding: a row's answer does not depend on the rows batched with it
    alone = [scorer.answer([scorer.prompt_ids(item)])[0] for item in ITEMS[:3]]
    assert scorer.answer([scorer.prompt_ids(item) for item in ITEMS[:3]]) == alone
    assert len(scorer.prompt_ids(_item("y" * 500, "r"))) == 64


def test_the_judges_answer_starts_with_the_prefix_it_was_given(tokenizer, monkeypatch):
    """`answer_prefix` ends the judge's prompt, and the regex reads prefix + generated text:
    a judge that only writes " 7" scored 0.7; one that writes "seven" gets its error."""
    judge = LlamaForCausalLM(_llama_config(tokenizer)).eval()
    scorer = JudgeScorer(judge, tokenizer, RewardModelConfig(kind="judge", max_length=256))
    prefix = tokenizer("Score:", add_special_tokens=False)["input_ids"]
    assert scorer.prompt_ids(ITEMS[0])[-len(prefix) :] == prefix
    monkeypatch.setattr(scorer, "answer", lambda batch: [" 7", "seven"])
    (good, _), (bad, error) = scorer.score(ITEMS[:2])
    assert good == pytest.approx(0.7) and bad == 0.0
    assert error == "no score in the judge's answer: 'Score:seven'"


def test_setup_scorer_loads_either_kind_from_a_model_directory(tmp_path, tokenizer, classifier):
    classifier.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    scorer = setup_scorer(RewardModelConfig(path=str(tmp_path / "rm")), "cpu")
    direct = ClassifierScorer(classifier, tokenizer, 1024, 32).score(ITEMS)
    assert [s for s, _ in scorer.score(ITEMS)] == pytest.approx([s for s, _ in direct], abs=1e-5)
    torch.manual_seed(0)
    LlamaForCausalLM(_llama_config(tokenizer)).save_pretrained(tmp_path / "judge")
    tokenizer.save_pretrained(tmp_path / "judge")
    cfg = RewardModelConfig(path=str(tmp_path / "judge"), kind="judge", max_new_tokens=2)
    judge = setup_scorer(cfg, "cpu")
    assert isinstance(judge, JudgeScorer) and judge.score(ITEMS[:1])[0][0] == 0.0
    with pytest.raises(ValueError, match="path is not set"):
        setup_scorer(RewardModelConfig(), "cpu")
    assert math.isfinite(scorer.score(ITEMS[:1])[0][0])
