"""Scorers: a reward model behind one method, `score(items) -> [(score, error)]`.

Two kinds (`reward.model.kind`):
- `ClassifierScorer`: a sequence-classification model with one label; the score is its logit
  at the last token of the prompt and response rendered by the tokenizer's chat template.
- `JudgeScorer`: a chat model answers `reward.model.template` about the response; the score is
  the number `reward.model.score_regex` finds in its answer, times `score_scale`.

Invariant: `score` returns one (score, error) per item, in order, and never raises for one bad
item; such an item gets (0.0, why) and the others are scored as if it were absent. A scorer is
deterministic (inference mode, greedy decoding), so a request scored twice gets the same scores.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from asyncrl.config.reward import RewardModelConfig
from asyncrl.dtypes import torch_dtype
from asyncrl.wire.reward_protocol import MAX_SCORE_ERROR_CHARS, ScoreItem

Scored = tuple[float, str]
"""(score, error): error "" when scored; else the score is 0.0 and the error says why."""
_TEMPLATE_KEYS = re.compile(r"\{(prompt|response|ground_truth|data_source)\}")


class Scorer(Protocol):
    """A reward model: one (score, error) per item, in order (see the module docstring)."""

    def score(self, items: list[ScoreItem]) -> list[Scored]: ...


def failed(reason: str) -> Scored:
    """An item that has no score: 0.0, and why (cut to what a `Scores` reply carries)."""
    return 0.0, reason[:MAX_SCORE_ERROR_CHARS]


def render_conversation(tokenizer: PreTrainedTokenizerBase, item: ScoreItem) -> str:
    """The item's messages and its response as one assistant turn: through the tokenizer's chat
    template when it has one (the text a reward model was trained on), else one paragraph per
    message, `role: content`."""
    messages = [{"role": m.role, "content": m.content} for m in item.messages]
    messages.append({"role": "assistant", "content": item.response})
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, tokenize=False))
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in messages)


def keep_end(ids: list[int], max_length: int) -> list[int]:
    """At most `max_length` ids, dropped from the left: a response is scored by its end."""
    return ids[-max_length:]


def unused_id(batch: Sequence[Sequence[int]], preferred: int | None, vocab_size: int) -> int | None:
    """A token id below `vocab_size` that no sequence of `batch` holds: `preferred` (the pad
    token) when it qualifies; None when the batch uses every id. HF's classifier scores each row
    at its rightmost token that is not `config.pad_token_id`, so a pad id that also ends a real
    text (many tokenizers pad with EOS) would move that row's score to the token before it."""
    used = {i for ids in batch for i in ids}
    if preferred is not None and preferred not in used and 0 <= preferred < vocab_size:
        return preferred
    return next((i for i in range(vocab_size) if i not in used), None)


def _tokenize(tokenizer: PreTrainedTokenizerBase, text: str, templated: bool) -> list[int]:
    # a chat template writes its own special tokens (BOS included); plain text gets them added
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


class ClassifierScorer:
    """A sequence-classification reward model with one label; the score is its logit."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_length: int,
        max_batch: int,
    ) -> None:
        if model.config.num_labels != 1:
            raise ValueError(
                f"a classifier reward model has 1 label, not {model.config.num_labels}"
            )
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_length, self.max_batch = max_length, max_batch
        self._templated = bool(getattr(tokenizer, "chat_template", None))

    def score(self, items: list[ScoreItem]) -> list[Scored]:
        out: list[Scored | None] = [None] * len(items)
        ready: list[tuple[int, list[int]]] = []  # (item index, token ids)
        for i, item in enumerate(items):
            try:
                text = render_conversation(self.tokenizer, item)
                ids = keep_end(_tokenize(self.tokenizer, text, self._templated), self.max_length)
            except Exception as e:  # a template that refuses these messages fails this item only
                out[i] = failed(f"cannot render the item: {type(e).__name__}: {e}")
                continue
            if ids:
                ready.append((i, ids))
            else:
                out[i] = failed("the item renders to no tokens")
        for start in range(0, len(ready), self.max_batch):
            chunk = ready[start : start + self.max_batch]
            logits = self.forward([ids for _, ids in chunk])
            for (i, _), value in zip(chunk, logits, strict=True):
                out[i] = (value, "") if math.isfinite(value) else failed(f"a score of {value}")
        return [s if s is not None else failed("not scored") for s in out]

    @torch.inference_mode()
    def forward(self, batch: list[list[int]]) -> list[float]:
        """The logit of each sequence, padded on the right to the longest (positions past a
        row's end are masked, and a causal model's earlier positions never see them)."""
        vocab = self.model.get_input_embeddings().num_embeddings
        pad = unused_id(batch, self.tokenizer.pad_token_id, vocab)
        if pad is None and len(batch) > 1:  # every id is real somewhere: no padding at all
            return [v for ids in batch for v in self.forward([ids])]
        # one row alone and no free id: None, so HF scores the last position (there is no pad)
        self.model.config.pad_token_id = pad
        width = max(len(ids) for ids in batch)
        device = self.model.device
        input_ids = torch.full((len(batch), width), pad or 0, dtype=torch.long, device=device)
        mask = torch.zeros((len(batch), width), dtype=torch.long, device=device)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, device=device)
            mask[row, : len(ids)] = 1
        logits = self.model(input_ids=input_ids, attention_mask=mask).logits
        return [float(v) for v in logits[:, 0].float().cpu()]


def fill_template(template: str, item: ScoreItem) -> str:
    """The judge's question: `{prompt}` (the last user message), `{response}`, `{ground_truth}`
    and `{data_source}` replaced in one pass, so a response that holds braces, or the name of
    another key, stays as written."""
    users = [m.content for m in item.messages if m.role == "user"]
    values = {
        "prompt": users[-1] if users else "",
        "response": item.response,
        "ground_truth": item.ground_truth,
        "data_source": item.data_source,
    }
    return _TEMPLATE_KEYS.sub(lambda m: values[m.group(1)], template)


def parse_judge_score(answer: str, regex: re.Pattern[str], scale: float) -> Scored:
    """The first group of `regex`'s first match in `answer`, times `scale`; no match, or a
    number that is not finite, is an error quoting the answer's start."""
    match = regex.search(answer)
    try:
        value = float(match.group(1)) * scale if match else math.nan
    except (TypeError, ValueError):  # an empty or non-numeric group
        value = math.nan
    if not math.isfinite(value):
        return failed(f"no score in the judge's answer: {answer[:100]!r}")
    return value, ""


class JudgeScorer:
    """A chat model that answers the judge's template (greedy); its answer holds the score."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        cfg: RewardModelConfig,
    ) -> None:
        self.model, self.tokenizer, self.cfg = model.eval(), tokenizer, cfg
        self.regex = re.compile(cfg.score_regex)
        pad = tokenizer.pad_token_id
        self._pad = pad if pad is not None else tokenizer.eos_token_id
        if self._pad is None:
            raise ValueError("the judge's tokenizer has neither a pad nor an EOS token")

    def prompt_ids(self, item: ScoreItem) -> list[int]:
        """The judge's question as a user turn with the generation prompt and the start of its
        answer (`answer_prefix`), its end kept."""
        question = [{"role": "user", "content": fill_template(self.cfg.template, item)}]
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                question, tokenize=False, add_generation_prompt=True
            )
            text = str(text) + self.cfg.answer_prefix  # the judge's answer starts so
            ids = _tokenize(self.tokenizer, text, templated=True)
        else:
            text = question[0]["content"] + "\n" + self.cfg.answer_prefix
            ids = _tokenize(self.tokenizer, text, templated=False)
        return keep_end(ids, self.cfg.max_length)

    def score(self, items: list[ScoreItem]) -> list[Scored]:
        out: list[Scored | None] = [None] * len(items)
        ready: list[tuple[int, list[int]]] = []
        for i, item in enumerate(items):
            try:
                ready.append((i, self.prompt_ids(item)))
            except Exception as e:  # a template that refuses this text fails this item only
                out[i] = failed(f"cannot render the judge's question: {type(e).__name__}: {e}")
        for start in range(0, len(ready), self.cfg.max_batch):
            chunk = ready[start : start + self.cfg.max_batch]
            answers = self.answer([ids for _, ids in chunk])
            for (i, _), answer in zip(chunk, answers, strict=True):
                answer = self.cfg.answer_prefix + answer  # what the judge "said", whole
                out[i] = parse_judge_score(answer, self.regex, self.cfg.score_scale)
        return [s if s is not None else failed("not scored") for s in out]

    @torch.inference_mode()
    def answer(self, batch: list[list[int]]) -> list[str]:
        """The judge's greedy answers, the batch padded on the left (generation continues
        every row from its last real token)."""
        width = max(len(ids) for ids in batch)
        device = self.model.device
        input_ids = torch.full((len(batch), width), self._pad, dtype=torch.long, device=device)
        mask = torch.zeros((len(batch), width), dtype=torch.long, device=device)
        for row, ids in enumerate(batch):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, device=device)
            mask[row, width - len(ids) :] = 1
        generated: Any = self.model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=self.cfg.max_new_tokens,
            pad_token_id=self._pad,
        )
        new = generated[:, width:].cpu()
        return [str(t) for t in self.tokenizer.batch_decode(new, skip_special_tokens=True)]


def resolve_device(device: str) -> str:
    """`reward.model.device` as torch names it: auto is the process's GPU if it has one."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def setup_scorer(cfg: RewardModelConfig, device: str) -> Scorer:
    """The scorer `cfg` describes, its model loaded from `cfg.path` onto `device`."""
    if cfg.path is None:
        raise ValueError("reward.model.path is not set: there is no reward model to serve")
    dtype, where = torch_dtype(cfg.dtype), torch.device(device)
    tokenizer = AutoTokenizer.from_pretrained(cfg.path)
    # transformers wraps `PreTrainedModel.to` in a decorator its stubs type as unbound
    if cfg.kind == "classifier":
        model: PreTrainedModel = AutoModelForSequenceClassification.from_pretrained(
            cfg.path, num_labels=1, dtype=dtype
        ).to(where)
        return ClassifierScorer(model, tokenizer, cfg.max_length, cfg.max_batch)
    judge = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=dtype)
    model = judge.to(where)  # type: ignore[arg-type]
    return JudgeScorer(model, tokenizer, cfg)
