"""The transformers engine: runs anywhere (CPU or CUDA), in the rollout server's process.

`HFEngine` keeps a continuous request queue and one sampling thread; it applies a weight version
between batches, entirely or not at all (the `Engine` invariants in `base.py`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from asyncrl.learner_config import LoraConfig
from asyncrl.lora import AdapterMerger, adapter_specs
from asyncrl.weight_sync import SyncGroup, WeightReceiver, specs_of, weights_checksum
from rollout_servers.engines.base import (
    AppliedVersion,
    DeliveryError,
    Engine,
    GenerationOutput,
    SamplingParams,
    SyncTarget,
    check_delivery,
)

ATTN_IMPLEMENTATION = "sdpa"
"""Attention kernel of the HF engine; its log-probs match a right-padded sdpa or eager forward
to ~1e-6 in float32 (see tests/unit/test_engine.py)."""


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[GenerationOutput]


class HFEngine(Engine):
    """A transformers model behind a continuous request queue and one sampling thread.

    Callers on the event loop enqueue requests; one runner task takes every pending request
    (up to `max_batch_size`) as one batch and samples it in a dedicated worker thread, so the
    loop never blocks and requests that arrive during a batch form the next one. Rows of a
    batch may have different sampling parameters. A lock held for a whole batch and by
    `update_weights` makes a weight version apply only between batches.
    """

    def __init__(
        self,
        model_path: str | Path,
        device: str = "cpu",
        max_batch_size: int = 256,
        seed: int = 0,
        version: int = 0,
        dtype: str = "float32",
        lora: LoraConfig | None = None,
    ):
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype), attn_implementation=ATTN_IMPLEMENTATION
        ).to(self.device)
        self.model.eval()
        config = self.model.config
        eos = self.model.generation_config.eos_token_id
        eos = config.eos_token_id if eos is None else eos
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        # held by a batch, and by the weight receiver from a version's copy through its delivery
        # check (re-entrant: update_weights and probe_logprobs take it again inside)
        self._lock = threading.RLock()
        self._broken: DeliveryError | None = None
        self._version = version
        self._params = dict(self.model.state_dict())
        # LoRA (`asyncrl.lora`): versions carry adapters, merged into a copy of the base weights
        self._lora = lora if lora is not None and lora.rank else None
        self._merger = AdapterMerger.of_model(self.model, self._lora) if self._lora else None
        self._adapters_checksum: str | None = None
        self._pending: list[_Request] = []
        self._runner: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self.batches_run = 0
        """Batches sampled so far (batching is observable, e.g. in tests and stats)."""

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        loop = asyncio.get_running_loop()
        if (
            self._runner is not None
            and not self._runner.done()
            and self._runner.get_loop() is not loop
        ):
            raise RuntimeError("HFEngine serves one event loop at a time")
        request = _Request(list(prompt_ids), params, loop.create_future())
        self._pending.append(request)
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run_pending(), name="hf-engine-runner")
        return await request.future

    async def _run_pending(self) -> None:
        """Drain the queue batch by batch; exits when it is empty (generate restarts it)."""
        loop = asyncio.get_running_loop()
        while self._pending:
            batch = [r for r in self._pending[: self.max_batch_size] if not r.future.done()]
            del self._pending[: self.max_batch_size]
            if not batch:
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self._sample_batch, batch)
            except Exception as e:  # the callers own the failure: each of them re-raises it
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            for r, out in zip(batch, outputs, strict=True):
                if not r.future.done():
                    r.future.set_result(out)

    def _sample_batch(self, batch: list[_Request]) -> list[GenerationOutput]:
        """Sample every request of `batch` together (worker thread; holds the weight lock)."""
        with self._lock, torch.inference_mode():
            if self._broken is not None:  # weights that failed their delivery check
                raise self._broken
            self.batches_run += 1
            wall, start = time.time(), time.perf_counter()
            tokens, logprobs, reasons = _sample(
                self.model, batch, self._eos_ids, self._pad_id, self._generator, self.device
            )
            took = time.perf_counter() - start
            self.busy_s += took
            if self.on_batch is not None:
                self.on_batch(wall, took, len(batch), self._version)
            return [
                GenerationOutput(t, lp, self._version, reason)
                for t, lp, reason in zip(tokens, logprobs, reasons, strict=True)
            ]

    def follow_learner(self, target: SyncTarget) -> Iterator[AppliedVersion]:
        group = SyncGroup(
            target.host,
            target.port,
            target.rank,
            target.world_size,
            target.device,
            target.timeout_s,
        )
        specs = specs_of(self.named_weights())
        if self._lora is not None:
            specs = adapter_specs(self.model, self._lora, self.model.dtype)
        receiver = WeightReceiver(group, specs)
        while (got := receiver.receive()) is not None:
            start = time.perf_counter()
            with self._lock:  # no batch runs between the copy and the delivery check
                if self._merger is None:
                    self.update_weights(got.weights, got.version)
                else:
                    merged = self._merger.merged(got.weights)
                    self._adapters_checksum = weights_checksum(got.weights)
                    self.update_weights(merged, got.version, subset=True)
                got.release()  # copied into the model: the next version may reuse the staging
                try:
                    check_delivery(self, got.version, got.probe, self.model.config.vocab_size)
                except DeliveryError as e:
                    self._broken = e  # every later batch fails with it: nothing is sampled
                    raise
            yield AppliedVersion(got.version, time.perf_counter() - start)

    def probe_logprobs(self, ids: list[int]) -> torch.Tensor:
        """See `Engine.probe_logprobs`: one forward of the model that samples, between batches."""
        x = torch.tensor([ids], device=self.device)
        with self._lock, torch.no_grad():
            logits = self.model(input_ids=x).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1)

    def weights_checksum(self) -> str | None:
        """With LoRA, of the adapters last merged (what the learner sent), None before any."""
        if self._lora is not None:
            return self._adapters_checksum
        return weights_checksum(self.named_weights())

    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int, subset: bool = False
    ) -> None:
        """Apply a whole weight version (thread-safe); raises ValueError and applies nothing
        when a name, shape or dtype does not match the model. `subset`: the weights not given
        stay as they are (LoRA: only the adapted layers change)."""
        staged = list(weights)
        seen: set[str] = set()
        for name, tensor in staged:
            target = self._params.get(name)
            if target is None:
                raise ValueError(f"update_weights: unknown parameter {name!r}")
            if name in seen:
                raise ValueError(f"update_weights: parameter {name!r} given twice")
            if tensor.shape != target.shape or tensor.dtype != target.dtype:
                raise ValueError(
                    f"update_weights: parameter {name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                    f"the model has {tuple(target.shape)} {target.dtype}"
                )
            seen.add(name)
        missing = [n for n in self._params if n not in seen]
        if missing and not subset:
            raise ValueError(
                f"update_weights: missing parameter {missing[0]!r} (and {len(missing) - 1} more)"
            )
        with self._lock, torch.no_grad():
            for name, tensor in staged:
                self._params[name].copy_(tensor)
            self._version = version

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Live views of the weights; call from the thread that calls `update_weights` (the
        weight receiver), which is the only writer."""
        yield from self._params.items()

    async def close(self) -> None:
        if self._runner is not None and not self._runner.done():
            await self._runner
        self._executor.shutdown(wait=True)


def _sample(
    model: torch.nn.Module,
    batch: list[_Request],
    eos_ids: frozenset[int],
    pad_id: int,
    generator: torch.Generator,
    device: torch.device,
) -> tuple[list[list[int]], list[list[float]], list[Literal["stop", "length"]]]:
    """KV-cached sampling of left-padded prompts; a row leaves the batch once it finishes.

    Position ids come from the attention mask, so a left-padded row sees the same positions as
    it would unpadded (and as in the learner's right-padded forward).
    """
    n = len(batch)
    longest = max(len(r.prompt_ids) for r in batch)
    input_ids = torch.full((n, longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, longest), dtype=torch.long)
    for i, r in enumerate(batch):
        input_ids[i, longest - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        attention_mask[i, longest - len(r.prompt_ids) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    temperature = torch.tensor([r.params.temperature for r in batch], device=device)
    top_p = torch.tensor([r.params.top_p for r in batch], device=device)
    stops = [eos_ids | set(r.params.stop_token_ids) for r in batch]

    tokens: list[list[int]] = [[] for _ in batch]
    logprobs: list[list[float]] = [[] for _ in batch]
    reasons: list[Literal["stop", "length"]] = ["length"] * n
    rows = list(range(n))  # batch row of each live row of the model's inputs and cache
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    positions = positions[:, -1]
    while True:
        live = torch.tensor(rows, device=device)
        next_ids, next_lps = _sample_next(
            out.logits[:, -1].float(), temperature[live], top_p[live], generator
        )
        keep: list[int] = []
        for j, (row, tok, lp) in enumerate(
            zip(rows, next_ids.tolist(), next_lps.tolist(), strict=True)
        ):
            tokens[row].append(tok)
            logprobs[row].append(lp)
            if tok in stops[row]:
                reasons[row] = "stop"
            elif len(tokens[row]) < batch[row].params.max_new_tokens:
                keep.append(j)
        if not keep:
            return tokens, logprobs, reasons
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            next_ids, attention_mask, positions = (
                next_ids[index],
                attention_mask[index],
                positions[index],
            )
            rows = [rows[j] for j in keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=1)
        positions = positions + 1
        out = model(
            input_ids=next_ids[:, None],
            attention_mask=attention_mask,
            position_ids=positions[:, None],
            past_key_values=cache,
            use_cache=True,
        )


def _sample_next(
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
