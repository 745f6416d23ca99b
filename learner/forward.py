"""The learner's model forwards: per-token log-probs, entropies and values of a micro-batch.

Outputs are [b, T] aligned to *target* tokens (T = the batch's width - 1): position t holds
what concerns input_ids[:, t + 1], the layout of `logits[:, :-1]`. Packed, the model runs on
the micro-batch's real tokens only (`learner.packing`; shared, a group's prompt once) and the
outputs are unpacked into that layout (0 past a row's end); padded, on the right-padded rows.
Log-softmax and entropy are computed in float32 whatever the compute dtype, and only at
target positions (a packed forward never computes the vocabulary softmax of a pad token).

Log-probs of a micro-batch whose float32 logits outgrow `WHOLE_LOGITS_MAX_BYTES` (512 MiB)
come from the final hidden states through `learner.logprobs.chunked_logprobs`, in chunks of
256 MiB of float32 logits (523 tokens of a 128k vocabulary), never from a [tokens x vocabulary]
float32 copy of the logits; smaller ones take the full-logits path, which is faster (the
chunked backward computes the head again) and small at that size. The model still runs through
`model(...)` (FSDP2's hooks fire, so its root parameters, the output head's and the tied
embeddings' included, are unsharded), with its output head made to return its input for that
one call (`_head_returns_hidden`). A head that cannot be chunked exactly
(`full_logits_reason`) takes the full-logits path, as does `chunked=False`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, cast

import torch

from asyncrl.config import LearnerConfig
from learner.batch import TrainBatch
from learner.fsdp import attention_implementation, hf_config
from learner.logprobs import chunked_logprobs
from learner.losses import entropy_from_logits
from learner.packing import SHARING_ATTENTIONS, pack_rows

log = logging.getLogger(__name__)

POSTPROCESSED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config keys of models whose forward changes the head's output (Gemma 2/3's soft-capping,
Cohere's and Granite's scaling): their log-probs take the full-logits path."""

Layout = Literal["padded", "packed", "shared"]
"""How a micro-batch reaches the model: right-padded rows; packed rows; packed rows whose
groups share one copy of their prompt (`learner.packing`)."""


def layout_of(lc: LearnerConfig, device: torch.device) -> Layout:
    """The layout `lc` asks for that the models' attention on `device` can run
    (`learner.fsdp.attention_implementation`): the per-segment SDPA and FlexAttention share
    prompts, flash-attn's varlen kernel cannot."""
    if not lc.packing:
        return "padded"
    sharing = attention_implementation(lc, device) in SHARING_ATTENTIONS
    return "shared" if lc.share_prompts and sharing else "packed"


def _outputs(model: torch.nn.Module, mb: TrainBatch, layout: Layout, head_call: dict | None = None):
    """(model outputs at the target positions [M, ...], targets [M], unpack: [M] -> [b, T]).

    head_call: the record of `_head_returns_hidden`; the outputs are then hidden states, taken
    padded too only where the target is a real token (0 elsewhere once unpacked, as packed),
    and the model must have returned its head's output unchanged."""
    width = mb.input_ids.shape[1] - 1
    if layout not in ("padded", "packed", "shared"):
        raise ValueError(f"unknown layout {layout!r}: padded, packed or shared")
    if layout != "padded":
        shared = layout == "shared"
        p = pack_rows(
            mb.input_ids,
            mb.attention_mask,
            mb.prompt_lengths if shared else None,
            mb.group_index if shared else None,
        )
        inputs = dict(input_ids=p.input_ids, position_ids=p.position_ids, **p.attention_kwargs())
        out = _logits(model, inputs, head_call)
        return out[0, p.flat], p.targets(), lambda v: p.unpack(v, width)
    inputs = dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
    out, targets = _logits(model, inputs, head_call)[:, :-1], mb.input_ids[:, 1:]
    if head_call is None:
        return out, targets, lambda v: v
    real = mb.attention_mask[:, 1:].bool()
    return out[real], targets[real], lambda v: v.new_zeros(real.shape).index_put((real,), v)


def _logits(model: torch.nn.Module, inputs: dict, head_call: dict | None) -> torch.Tensor:
    logits = model(**inputs).logits
    if head_call is not None and logits is not head_call.get("hidden"):
        raise RuntimeError(
            f"{type(model).__name__} changes its output head's result before returning it as "
            "logits: add what it uses to learner.forward.POSTPROCESSED_LOGITS so that its "
            "log-probs take the full-logits path"
        )
    return logits


def policy_forward(
    model: torch.nn.Module,
    mb: TrainBatch,
    temperature: float,
    with_entropy: bool,
    layout: Layout,
    entropy_grad: bool = False,
    chunked: bool = True,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p of each target token under softmax(logits / T), entropy or None), [b, T].
    The same log-prob the engines report as behaviour log-probs. The entropy carries a
    gradient only when `entropy_grad` (an entropy bonus); as a statistic it is computed from
    detached logits, so its vocabulary-sized intermediates are not kept for the backward.

    chunked: from the hidden states, `chunk_tokens` at a time (`learner.logprobs`; None: its
    default by bytes, and the full path while the micro-batch's float32 logits fit
    `WHOLE_LOGITS_MAX_BYTES`), unless the model's head cannot be (`full_logits_reason`); else
    from the model's full logits (the path the chunked one is tested against)."""
    reason = full_logits_reason(model) if chunked else None
    if chunked and reason is None and chunk_tokens is None:
        chunked = not _logits_fit_whole(model, mb)
    if not chunked or reason is not None:
        if reason is not None:
            _say_full_logits(type(model).__name__, reason)
        return _full_logits_policy_forward(
            model, mb, temperature, with_entropy, layout, entropy_grad
        )
    head = _output_head(model)
    assert head is not None  # (full_logits_reason said so)
    with _head_returns_hidden(head) as seen:
        hidden, targets, unpack = _outputs(model, mb, layout, head_call=seen)
    logp, entropy = chunked_logprobs(
        hidden,
        seen["weight"],
        seen["bias"],
        targets,
        temperature,
        with_entropy,
        entropy_grad,
        chunk_tokens,
    )
    return unpack(logp), unpack(entropy) if entropy is not None else None


def _full_logits_policy_forward(
    model: torch.nn.Module,
    mb: TrainBatch,
    temperature: float,
    with_entropy: bool,
    layout: Layout,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`policy_forward` from the model's logits [M, V] and their float32 copies."""
    logits, targets, unpack = _outputs(model, mb, layout)
    logits = logits.float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = unpack(entropy_from_logits(logits if entropy_grad else logits.detach()))
    return unpack(logp), entropy


WHOLE_LOGITS_MAX_BYTES = 512 * 2**20
"""A micro-batch whose float32 logits fit in this takes the full-logits path: the chunked path
computes the head's matmul again in the backward (chunked / full tokens/s measured 0.86-0.90x
on a 4-layer SmolLM2-shaped model on CPU, `tools/bench_logprob_speed.py`), which buys nothing
while the logits are this small; the full path's peak is then about six such copies (~3 GiB)."""


def _logits_fit_whole(model: torch.nn.Module, mb: TrainBatch) -> bool:
    head = _output_head(model)
    vocab = getattr(head, "out_features", None)
    if vocab is None:
        return False
    tokens = int(mb.attention_mask.sum())  # every target position is a real token's
    return tokens * vocab * 4 <= WHOLE_LOGITS_MAX_BYTES


def full_logits_reason(model: torch.nn.Module) -> str | None:
    """Why `model`'s log-probs cannot be computed exactly from its hidden states and its
    output head's weight, or None when they can: the head must be a plain `torch.nn.Linear`
    (not a LoRA-adapted or separately sharded one) and the model must use its output as the
    logits unchanged."""
    head = _output_head(model)
    if type(head) is not torch.nn.Linear:
        return f"its output head is a {type(head).__name__}, not a plain Linear"
    config = hf_config(model).get_text_config()
    for key in POSTPROCESSED_LOGITS:
        if getattr(config, key, None) is not None:
            return f"its config sets {key}: the model changes the head's output"
    return None


def _output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The Hugging Face model's output head (lm_head; peft passes the call through)."""
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


@functools.cache
def _say_full_logits(model_name: str, reason: str) -> None:
    log.warning("log-probs of %s from its full logits: %s", model_name, reason)


@contextmanager
def _head_returns_hidden(head: torch.nn.Module) -> Iterator[dict]:
    """Within: calling `head` returns its input (the final hidden states) and records the
    weight and bias the head held at that call (under FSDP2, the root's unsharded ones; the
    root keeps them unsharded until its backward, tests/unit/test_chunked_logprobs.py).
    `_logits` checks that the model returned exactly that tensor as its logits."""
    seen: dict = {}

    def returns_hidden(hidden: torch.Tensor) -> torch.Tensor:
        weight = cast(torch.Tensor, head.weight)
        if weight.untyped_storage().size() == 0:  # FSDP2 would free it before the backward
            raise RuntimeError(
                "the output head's weight has no storage at its call: the root FSDP module "
                "must keep its parameters unsharded after forward (reshard_after_forward "
                "left at its default, learner.fsdp.setup_model) for the chunked log-probs"
            )
        # the model passes a view (hidden_states[:, slice]) and returns what this returns: an
        # FSDP2 root returning a view warns that an in-place op on it would skip its
        # pre-backward hook, so a view is returned as a copy ([tokens x hidden], small)
        out = hidden.clone() if hidden._is_view() else hidden
        seen.update(weight=weight, bias=head.bias, hidden=out)
        return out

    before = head.__dict__.get("forward")  # (a hook library may have set one)
    head.forward = returns_hidden
    try:
        yield seen
    finally:
        if before is None:
            del head.forward
        else:
            head.forward = before


def value_forward(critic: torch.nn.Module, mb: TrainBatch, layout: Layout) -> torch.Tensor:
    """V(state before each target token), [b, T]."""
    values, _, unpack = _outputs(critic, mb, layout)
    return unpack(values[..., 0].float())
