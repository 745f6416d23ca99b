"""The transformers engine's sampling loop: a batch of left-padded prompts, KV-cached decoding,
rows leaving the batch as they finish, and a hook between decode steps where a new weight
version may arrive (`rollout.weight_update_mode=inflight`).

Position ids come from the attention mask, so a left-padded row sees the same positions as it
would unpadded (and as in the learner's right-padded forward).

In-flight updates: when `between_steps` reports a new version, every later token is sampled
from the new weights and recorded with the new version. The KV cache of the rows in flight was
computed by the old weights; `inflight_kv` decides what happens to it:
- `recompute`: one forward of every live row's whole sequence (prompt and tokens so far) under
  the new weights rebuilds the cache, so the next token's log-prob equals a fresh forward's;
- `keep`: decoding goes on over the old cache, a mix of both versions (cheap, inexact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import DynamicCache

from rollout_servers.engines.base import SamplingParams

InflightKV = Literal["recompute", "keep"]


@dataclass
class SampledBatch:
    """Per row: sampled ids, their log-probs and policy versions, and why the row ended."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    reasons: list[Literal["stop", "length"]] = field(default_factory=list)

    @classmethod
    def empty(cls, n: int) -> SampledBatch:
        return cls([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)])


def sample_batch(
    model: torch.nn.Module,
    requests: list[tuple[list[int], SamplingParams]],
    eos_ids: frozenset[int],
    pad_id: int,
    generator: torch.Generator,
    version: int,
    between_steps: Callable[[], int | None] | None = None,
    inflight_kv: InflightKV = "recompute",
) -> SampledBatch:
    """Sample every request (prompt ids, parameters) together, starting at `version`.
    `between_steps()` runs after each decode step; it returns the version the model now holds
    when new weights were applied meanwhile, else None."""
    device = next(model.parameters()).device
    params = [p for _, p in requests]
    prompts, mask = _left_padded([ids for ids, _ in requests], pad_id, device)
    temperature = torch.tensor([p.temperature for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    stops = [(frozenset() if p.ignore_eos else eos_ids) | set(p.stop_token_ids) for p in params]
    out = SampledBatch.empty(len(requests))
    out.reasons = ["length"] * len(requests)
    rows = list(range(len(requests)))  # batch row of each live row of the inputs and cache
    logits, cache = _forward_whole(model, prompts, mask)
    while True:
        live = torch.tensor(rows, device=device)
        next_ids, next_lps = sample_next(logits, temperature[live], top_p[live], generator)
        keep = []
        for j, (row, tok, lp) in enumerate(
            zip(rows, next_ids.tolist(), next_lps.tolist(), strict=True)
        ):
            out.tokens[row].append(tok)
            out.logprobs[row].append(lp)
            out.versions[row].append(version)
            if tok in stops[row]:
                out.reasons[row] = "stop"
            elif len(out.tokens[row]) < params[row].max_new_tokens:
                keep.append(j)
        if not keep:
            return out
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            next_ids, mask = next_ids[index], mask[index]
            rows = [rows[j] for j in keep]
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
        new = between_steps() if between_steps is not None else None
        if new is not None:
            version = new
            if inflight_kv == "recompute":
                del logits, cache  # free the old cache before building the new one
                # live rows started together, so each has sampled as many tokens so far
                sampled = torch.tensor([out.tokens[r] for r in rows], device=device)
                seq = torch.cat([prompts[torch.tensor(rows, device=device)], sampled], dim=1)
                logits, cache = _forward_whole(model, seq, mask)
                continue
        position = mask.sum(dim=-1, keepdim=True) - 1  # of the newest token
        logits = (
            model(
                input_ids=next_ids[:, None],
                attention_mask=mask,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
            )
            .logits[:, -1]
            .float()
        )


def _left_padded(
    prompts: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _forward_whole(
    model: torch.nn.Module, seq: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, DynamicCache]:
    """The next-token logits of every row after a forward of its whole sequence, and the cache
    that forward filled."""
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=seq,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float(), cache


def sample_next(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: argmax where temperature is 0, else a draw from softmax(logits / T)
    restricted to the top-p nucleus. Returns (ids, log_softmax(logits / T)[ids]), the log-prob
    taken before truncation."""
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    ids = logits.argmax(dim=-1)
    sampled = (~greedy).nonzero().squeeze(-1)
    if sampled.numel():
        probs = logp[sampled].exp()
        nucleus = top_p[sampled] < 1
        if nucleus.any():
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Drop a token when the mass of the tokens ranked above it already reaches top_p.
            drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p[sampled][:, None]
            drop &= nucleus[:, None]
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        ids[sampled] = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)
