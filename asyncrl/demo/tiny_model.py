"""The embedded tiny model: a character-level tokenizer and a small Llama, built locally.

Nothing is downloaded. `prepare_embedded_model` builds the tokenizer and a randomly initialised
`LlamaForCausalLM`, warm-starts it with a short supervised run on the embedded arithmetic task's
noisy demonstrations (so it knows the answer format and is right only part of the time), and
saves a plain Hugging Face model directory that every fleet loads with `from_pretrained`.

Invariants:
- Every prompt is rendered by the chat template through `render_prompt_ids`, so the warm-start,
  the rollout servers and any evaluation see the same token ids for the same messages.
- The cache directory for one (spec, task, warmstart_steps, seed, p_correct, format) exists only
  when complete: it is written to a temporary sibling and renamed into place.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from asyncrl.data.prompts import render_prompt_ids
from asyncrl.demo.model_cache import (
    P_CORRECT,
    EmbeddedTask,
    TinyModelSpec,
    cache_key,
    embedded_model_dir,
)
from asyncrl.demo.tasks import ArithmeticTask

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '</s>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""Each message renders as `<|role|>content</s>`; the generation prompt is `<|assistant|>`.
No BOS: the role marker already starts every sequence."""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: the special tokens, then printable ASCII and newline.

    Every character is its own token (the pre-tokenizer isolates each one, newlines included)
    and the decoder concatenates tokens without separators, so decode(encode(s)) == s for any
    text made of the vocabulary's characters. Role markers are special tokens: single ids that
    are never split and that `skip_special_tokens` removes.
    """
    chars = [chr(c) for c in range(ord(" "), ord("~") + 1)] + ["\n"]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        clean_up_tokenization_spaces=False,
        padding_side="right",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase, spec: TinyModelSpec, seed: int
) -> LlamaForCausalLM:
    """A randomly initialised float32 Llama sized for `tokenizer`, seeded without touching the
    caller's global RNG state."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # transformers wraps `to` with functools.wraps(Module.to), which mypy reads unbound
        model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    gen = model.generation_config
    gen.bos_token_id = tokenizer.bos_token_id
    gen.eos_token_id = tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id
    return model


def render_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]
) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of a whole conversation: the chat template's ids, mask 1 exactly on
    each assistant message's ids (its content and end token), 0 elsewhere.

    Each assistant message's ids are the rendering of the conversation up to and including it,
    minus the rendering of what precedes it with the generation prompt; every other span is
    template ids. This is the token layout the tool agent loop produces (sampled assistant
    turns, template ids for tool turns), so a warm-start on it trains what the loop will see.
    """
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_prompt_ids(tokenizer, messages[:i])
        through = _render_ids(tokenizer, messages[: i + 1])
        if before[: len(ids)] != ids or through[: len(before)] != before:
            raise ValueError("the chat template is not prefix-stable for this conversation")
        ids, mask = (
            through,
            [*mask, *[0] * (len(before) - len(ids)), *[1] * (len(through) - len(before))],
        )
    if len(ids) != len(_render_ids(tokenizer, messages)):
        raise ValueError("a conversation for the warm-start must end with an assistant message")
    return ids, mask


def _render_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    rendered: Any = tokenizer.apply_chat_template(messages, tokenize=True)
    if not isinstance(rendered, list):
        rendered = rendered["input_ids"]
    return [int(t) for t in rendered]


def prepare_embedded_model(
    cache_dir: str | Path,
    task: EmbeddedTask,
    warmstart_steps: int,
    seed: int,
    spec: TinyModelSpec = TinyModelSpec(),  # noqa: B008 (frozen, so a shared default is safe)
    p_correct: float = P_CORRECT,
    log: Callable[[str], None] = print,
) -> Path:
    """The warm-started embedded model as a Hugging Face directory, built once and cached.

    The directory name is a hash of everything that determines its contents, so a hit is
    returned at once without retraining; a miss builds, warm-starts and renames a finished
    temporary directory into place (a crash leaves at most a stray temporary, never a
    half-written cache entry; if two processes race, the first rename wins).
    """
    cache_dir = Path(cache_dir)
    key = cache_key(task, warmstart_steps, seed, spec, p_correct)
    final = embedded_model_dir(cache_dir, key)
    if final.is_dir():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, spec, seed)
    warm_start(model, tokenizer, task, warmstart_steps, seed, p_correct, log)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache_dir))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "asyncrl_cache_key.json").write_text(json.dumps(key, indent=1, sort_keys=True))
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # a concurrent builder finishing first is the only benign case
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def warm_start(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    task: EmbeddedTask,
    steps: int,
    seed: int,
    p_correct: float,
    log: Callable[[str], None] = print,
    batch_size: int = 64,
    lr: float = 3e-3,
    warmup_steps: int = 20,
) -> None:
    """Supervised training on `task.demonstration`, in place.

    Each sequence is the rendered prompt, the answer and `</s>`; the loss covers only the answer
    tokens and the final `</s>`, so the model learns to answer (and to stop) but is never
    trained to predict prompts. A tool task's demonstration (`ToolArithmeticTask`,
    `SearchQATask`) is a whole conversation rendered by `render_conversation`: the loss covers
    its assistant turns only, never the tool outputs. The learning rate warms up linearly, then
    decays by a cosine to a tenth of its peak.
    """
    if steps <= 0:
        return
    rng = random.Random(seed)
    demonstrations = _Demonstrations(task, tokenizer, p_correct)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(warmup_steps, steps))
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        rows = [demonstrations.row(rng) for _ in range(batch_size)]
        loss = _answer_loss(model, rows, tokenizer.pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 50 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - start
            log(f"warm-start step {step + 1}/{steps} loss {loss.item():.4f} {elapsed:.1f}s")
    model.eval()


def _warmup_cosine(warmup_steps: int, steps: int) -> Callable[[int], float]:
    """The learning rate's factor at a step: a linear warm-up over `warmup_steps`, then a cosine
    decay to a tenth of the peak at `steps`."""

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return lr_factor


class _Demonstrations:
    """Rows (ids, loss mask) of the task's demonstrations, each prompt or conversation rendered
    once (`warm_start`'s docstring says which ids the loss covers)."""

    def __init__(self, task: EmbeddedTask, tokenizer: PreTrainedTokenizerBase, p_correct: float):
        self.task, self.tokenizer, self.p_correct = task, tokenizer, p_correct
        self.prompts: dict[str, list[int]] = {}
        self.conversations: dict[str, tuple[list[int], list[int]]] = {}

    def row(self, rng: random.Random) -> tuple[list[int], list[int]]:
        task, tokenizer = self.task, self.tokenizer
        if not isinstance(task, ArithmeticTask):
            messages = task.demonstration(rng, self.p_correct)
            key = json.dumps(messages)
            if key not in self.conversations:
                self.conversations[key] = render_conversation(tokenizer, messages)
            return self.conversations[key]
        prompt, answer = task.demonstration(rng, self.p_correct)
        if prompt not in self.prompts:
            self.prompts[prompt] = render_prompt_ids(
                tokenizer, [{"role": "user", "content": prompt}]
            )
        target = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        return self.prompts[prompt] + target, [0] * len(self.prompts[prompt]) + [1] * len(target)


def _answer_loss(
    model: LlamaForCausalLM, rows: list[tuple[list[int], list[int]]], pad_id: int
) -> torch.Tensor:
    """The mean next-token loss over the ids whose loss mask is 1."""
    input_ids, loss_mask = _right_padded(rows, pad_id)
    attention_mask = (loss_mask >= 0).long()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    targets, weights = input_ids[:, 1:], (loss_mask[:, 1:] > 0).float()
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none"
    )
    return (nll * weights.reshape(-1)).sum() / weights.sum()


def _right_padded(
    rows: list[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, loss_mask) for (ids, mask) rows: the row's mask (1 where trained, 0
    elsewhere), -1 on padding (so one tensor also gives the attention mask)."""
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    loss_mask = torch.full((len(rows), length), -1, dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        loss_mask[i, : len(mask)] = torch.tensor(mask)
    return input_ids, loss_mask
