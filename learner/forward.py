"""The learner's model forwards: per-token log-probs, entropies and values of a micro-batch.

Outputs are [b, T] aligned to *target* tokens (T = the batch's width - 1): position t holds
what concerns input_ids[:, t + 1], the layout of `logits[:, :-1]`. Packed, the model runs on
the micro-batch's real tokens only (`learner.packing`; shared, a group's prompt once) and the
outputs are unpacked into that layout (0 past a row's end); padded, on the right-padded rows.
Log-softmax and entropy are computed in float32 whatever the compute dtype, and only at
target positions (a packed forward never computes the vocabulary softmax of a pad token).
"""

from __future__ import annotations

from typing import Literal

import torch

from asyncrl.config import LearnerConfig
from learner.batch import TrainBatch
from learner.fsdp import attention_implementation
from learner.losses import entropy_from_logits
from learner.packing import SHARING_ATTENTIONS, pack_rows

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


def _outputs(model: torch.nn.Module, mb: TrainBatch, layout: Layout):
    """(model outputs at the target positions [M, ...], targets [M], unpack: [M] -> [b, T])."""
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
        out = model(input_ids=p.input_ids, position_ids=p.position_ids, **p.attention_kwargs())
        return out.logits[0, p.flat], p.targets(), lambda v: p.unpack(v, width)
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
    return out, mb.input_ids[:, 1:], lambda v: v


def policy_forward(
    model: torch.nn.Module,
    mb: TrainBatch,
    temperature: float,
    with_entropy: bool,
    layout: Layout,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p of each target token under softmax(logits / T), entropy or None), [b, T].
    The same log-prob the engines report as behaviour log-probs. The entropy carries a
    gradient only when `entropy_grad` (an entropy bonus); as a statistic it is computed from
    detached logits, so its vocabulary-sized intermediates are not kept for the backward."""
    logits, targets, unpack = _outputs(model, mb, layout)
    logits = logits.float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = unpack(entropy_from_logits(logits if entropy_grad else logits.detach()))
    return unpack(logp), entropy


def value_forward(critic: torch.nn.Module, mb: TrainBatch, layout: Layout) -> torch.Tensor:
    """V(state before each target token), [b, T]."""
    values, _, unpack = _outputs(critic, mb, layout)
    return unpack(values[..., 0].float())
