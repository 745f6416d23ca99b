"""The transformers engine's sampling loop: a running batch that rows join and leave between
decode steps (continuous batching), KV-cached decoding, and the cache rebuild after a weight
version arrives in flight (`rollout.weight_update_mode=inflight`).

Rows join by a prefill of the new rows alone (in chunks of similar length), whose cache is then
merged into a running cohort's (`Cohort`: rows decoded by one forward): the shorter of the two
is left-padded along the sequence with zeros that the attention mask hides, and the two are
concatenated along the batch. A chunk that would pad a cohort too much starts a cohort of its
own (`LiveBatch`), so short rows do not attend over the padding of a long one. Position ids come
from the attention mask, so a left-padded row sees the same positions as it would unpadded (and
as in the learner's right-padded forward): a row's log-probs do not depend on which rows it
shared a cohort with. Columns that are padding for every row of a cohort (left by long rows
that finished) are trimmed, so its cache holds at most its longest row plus its padding. This
module decides which rows share a cache and when; what is done to the cache tensors (padding,
merging, trimming, a cache layer that grows in place) is `hf_kv_cache`.

In-flight updates: when a new version is applied between two decode steps, every later token is
sampled from the new weights and recorded with the new version. The KV cache of the rows in
flight was computed by the old weights; `inflight_kv` decides what happens to it:
- `recompute`: one forward of every live row's whole sequence (prompt and tokens so far, rows
  left-padded to the longest) under the new weights rebuilds the cache, so the next token's
  log-prob equals a fresh forward's;
- `keep`: decoding goes on over the old cache, a mix of both versions (cheap, inexact).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import PreTrainedModel

from rollout_servers.engines.base import SamplingParams
from rollout_servers.engines.hf_kv_cache import (
    Prefilled,
    concat_prefilled,
    forward_whole,
    left_padded,
    merges_caches,
    trim_front,
)

InflightKV = Literal["recompute", "keep"]

PAD_WASTE = 0.25
"""A prefill chunk's padding may add at most this share to its real tokens' compute; rows join
a cohort whose padding they raise by at most this share (or MERGE_SLACK_CELLS)."""
MERGE_SLACK_CELLS = 1024
"""Padding cells (rows x columns) a merge may always add: a decode step's fixed cost (a forward
of the tiny models' few layers, ~3 ms on the reference CPU) is worth ~1,000 cells of attention
and cache copying (~2.5 us each, the bench model at 32 rows x 64-1,000 columns)."""
MAX_COHORTS = 4
"""Cohorts decoded per step at most (each is one forward); beyond it rows join the cheapest."""


class AdmitError(RuntimeError):
    """Rows could not join (their prefill failed); the batch is as it was. The cause is the
    prefill's error."""


@dataclass
class Row:
    """One response being sampled: its request, what it sampled so far and why it ended."""

    prompt: list[int]
    params: SamplingParams
    stops: frozenset[int]
    """Ids that end the response (EOS unless ignored, and the request's stop ids)."""
    owner: Any
    """Whoever asked for the row (the engine's request); the batch never reads it."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Policy version of the weights that sampled each token."""
    reason: Literal["stop", "length"] = "length"


class Cohort:
    """Rows decoded by one forward: their attention mask, KV cache and next-token logits, every
    row left-padded to the longest. Invariant between steps: row i of `rows`, `mask`, the cache
    and the logits is the same response, and each row's mask is zeros (padding) then ones (its
    sequence so far)."""

    def __init__(self, rows: list[Row], prefilled: Prefilled, trims: bool = True):
        self.rows, self.trims = rows, trims
        self.logits: torch.Tensor | None  # next-token logits of every row, until sampled
        self.logits, self.cache, self.mask = prefilled
        self.next_ids: torch.Tensor | None = None  # sampled, not yet in the cache
        self._rows_changed()

    @property
    def cells(self) -> int:
        """Rows x columns: what one decode step attends over."""
        return self.mask.shape[0] * self.mask.shape[1]

    def merge_cost(self, other: Prefilled) -> tuple[int, int]:
        """(padding cells a merge with `other` would add, real tokens of both)."""
        width = max(self.mask.shape[1], other[2].shape[1])
        rows = self.mask.shape[0] + other[2].shape[0]
        added = rows * width - self.cells - other[2].numel()
        return added, int(self.mask.sum()) + int(other[2].sum())

    def absorb(self, rows: list[Row], other: Prefilled) -> None:
        assert self.logits is not None, "rows join between steps"
        self.logits, self.cache, self.mask = concat_prefilled(
            (self.logits, self.cache, self.mask), other
        )
        self.rows = self.rows + rows
        self._rows_changed()

    def sample(self, version: int, generator: torch.Generator) -> list[Row]:
        """One token for every row, recorded with `version`; rows that stop or reach
        max_new_tokens leave and are returned."""
        assert self.logits is not None and self.next_ids is None, "sample after admit/advance"
        ids, lps = sample_next(self.logits, self._temperature, self._top_p, generator)
        self.logits, self.next_ids = None, ids
        finished = []
        for row, tok, lp in zip(self.rows, ids.tolist(), lps.tolist(), strict=True):
            row.tokens.append(tok)
            row.logprobs.append(lp)
            row.versions.append(version)
            if tok in row.stops:
                row.reason = "stop"
            if tok in row.stops or len(row.tokens) >= row.params.max_new_tokens:
                finished.append(row)
        self.remove(finished)
        return finished

    def remove(self, rows: list[Row]) -> None:
        """Rows leave; padding columns no row needs any more go too (unless the cache cannot
        be trimmed: `LiveBatch.merges`)."""
        gone = {id(r) for r in rows}
        keep = [j for j, r in enumerate(self.rows) if id(r) not in gone]
        if len(keep) == len(self.rows):
            return
        if not keep:  # empty: the batch drops this cohort
            self.rows = []
            return
        self.rows = [self.rows[j] for j in keep]
        index = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        if self.next_ids is not None:
            self.next_ids = self.next_ids[index]
        if self.logits is not None:
            self.logits = self.logits[index]
        self._rows_changed()
        lead = int(self.mask.any(dim=0).int().argmax())
        if lead and self.trims:  # leading columns of padding only
            self.mask = self.mask[:, lead:]
            trim_front(self.cache, lead)

    def advance(self, model: PreTrainedModel) -> None:
        """Feed the tokens just sampled: one decode step over the cache."""
        assert self.next_ids is not None, "advance after sample"
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
        position = self.mask.sum(dim=-1, keepdim=True) - 1  # of the newest token
        self.logits = (
            model(
                input_ids=self.next_ids[:, None],
                attention_mask=self.mask,
                position_ids=position,
                past_key_values=self.cache,
                use_cache=True,
            )
            .logits[:, -1]
            .float()
        )
        self.next_ids = None

    def _rows_changed(self) -> None:
        params = [r.params for r in self.rows]
        device = self.mask.device
        self._temperature = torch.tensor([p.temperature for p in params], device=device)
        self._top_p = torch.tensor([p.top_p for p in params], device=device)


class LiveBatch:
    """The rows being sampled, in cohorts of similar length (`Cohort`: one forward each).

    One step is `sample` (a token for every row; finished rows leave) then `advance` (a forward
    of the new tokens); `admit` adds rows between two steps (after `advance`, or to an empty
    batch). New rows are prefilled in chunks of similar length; a chunk joins the cohort it
    pads least, unless that padding exceeds PAD_WASTE of the real tokens and MERGE_SLACK_CELLS,
    when it starts a cohort of its own (at most MAX_COHORTS; then it joins the cheapest). One
    padded batch would make every decode step attend over rows x the longest live row: on
    long-tailed lengths, a few long rows made every short row pay for their length.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        eos_ids: frozenset[int],
        pad_id: int,
        generator: torch.Generator,
        inflight_kv: InflightKV = "recompute",
    ):
        self.model, self.eos_ids, self.pad_id = model, eos_ids, pad_id
        self.generator, self.inflight_kv = generator, inflight_kv
        self.device = next(model.parameters()).device
        self.cohorts: list[Cohort] = []
        # caches other than plain full-attention layers (sliding windows, linear attention)
        # cannot be padded and merged: such models batch statically (rows join an empty batch)
        self.merges = merges_caches(model)

    @property
    def rows(self) -> list[Row]:
        return [r for c in self.cohorts for r in c.rows]

    def __len__(self) -> int:
        return sum(len(c.rows) for c in self.cohorts)

    def can_admit(self) -> bool:
        """Rows may join now (between two steps; not in a batch that cannot merge caches)."""
        between = all(c.next_ids is None for c in self.cohorts)
        return between and (self.merges or not self.cohorts)

    def admit(self, requests: list[tuple[list[int], SamplingParams, Any]]) -> list[Row]:
        """Add rows (prompt ids, parameters, owner), prefilled alone and placed in cohorts.
        Returns the new rows."""
        assert requests and self.can_admit(), "rows join between steps"
        rows = [
            Row(ids, p, (frozenset() if p.ignore_eos else self.eos_ids) | set(p.stop_token_ids), o)
            for ids, p, o in requests
        ]
        try:  # nothing of the batch changes before the prefill succeeds
            chunks = _prefill(
                self.model, [r.prompt for r in rows], self.pad_id, self.device, self.merges
            )
        except Exception as e:
            raise AdmitError(f"the prefill of {len(rows)} joining row(s) failed: {e!r}") from e
        for order, prefilled in chunks:
            self._place([rows[i] for i in order], prefilled)
        return rows

    def _place(self, rows: list[Row], prefilled: Prefilled) -> None:
        costs = [c.merge_cost(prefilled) for c in self.cohorts]
        if self.merges and costs:
            best = min(range(len(costs)), key=lambda i: costs[i][0])
            added, tokens = costs[best]
            cheap = added <= MERGE_SLACK_CELLS or added <= PAD_WASTE * tokens
            if cheap or len(self.cohorts) >= MAX_COHORTS:
                self.cohorts[best].absorb(rows, prefilled)
                return
        self.cohorts.append(Cohort(rows, prefilled, trims=self.merges))

    def sample(self, version: int) -> list[Row]:
        """Sample one token for every row, recorded with `version` (the weights that computed
        the logits); rows that stop or reach max_new_tokens leave the batch and are returned."""
        finished = [r for c in self.cohorts for r in c.sample(version, self.generator)]
        self.cohorts = [c for c in self.cohorts if c.rows]
        return finished

    def remove(self, rows: list[Row]) -> None:
        """Rows leave the batch (their caller gave up on them); padding columns no live row
        needs any more are trimmed from the mask and cache."""
        for c in self.cohorts:
            c.remove(rows)
        self.cohorts = [c for c in self.cohorts if c.rows]

    def advance(self, weights_changed: bool = False) -> None:
        """Feed the tokens just sampled: one decode step per cohort, or, when new weights were
        applied since the last step and `inflight_kv="recompute"`, a forward of every row's
        whole sequence that rebuilds the cache under the new weights."""
        if weights_changed and self.inflight_kv == "recompute":
            # rows joined at different steps: each is its prompt and its own tokens so far
            rows = self.rows
            self.cohorts = []  # free the old caches before building the new ones
            seqs = [r.prompt + r.tokens for r in rows]
            for order, prefilled in _prefill(
                self.model, seqs, self.pad_id, self.device, self.merges
            ):
                self._place([rows[i] for i in order], prefilled)
            return
        for c in self.cohorts:
            c.advance(self.model)


def _prefill(
    model: PreTrainedModel,
    seqs: list[list[int]],
    pad_id: int,
    device: torch.device,
    chunked: bool = True,
) -> list[tuple[list[int], Prefilled]]:
    """A forward of every sequence, in chunks of rows of similar length (sorted, a chunk closed
    before its padding would exceed PAD_WASTE of its tokens; one chunk unless `chunked`): long-
    tailed lengths padded to the longest as one batch would cost rows x longest instead of the
    sum of the lengths. Returns each chunk's indices into `seqs` and its prefill."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    chunks: list[list[int]] = [[]]
    tokens = 0
    for i in order:
        longest = len(seqs[i])  # ascending: the newest row is the chunk's longest
        wasteful = (len(chunks[-1]) + 1) * longest > (1 + PAD_WASTE) * (tokens + longest)
        if chunked and chunks[-1] and wasteful:
            chunks.append([])
            tokens = 0
        chunks[-1].append(i)
        tokens += longest
    out = []
    for chunk in chunks:
        ids, mask = left_padded([seqs[i] for i in chunk], pad_id, device)
        logits, cache = forward_whole(model, ids, mask)
        out.append((chunk, (logits, cache, mask)))
    return out


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
