"""The transformers engine: runs anywhere (CPU or CUDA), in the rollout server's process.

`HFEngine` keeps a continuous request queue and one sampling thread; it applies a weight version
entirely or not at all (the `Engine` invariants in `base.py`): between batches
(`weight_update_mode="drain"`), or between two decode steps of the batch in flight
(`"inflight"`: its later tokens carry the new version, `hf_sampling`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM

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
from rollout_servers.engines.hf_sampling import InflightKV, sample_batch

ATTN_IMPLEMENTATION = "sdpa"
"""Attention kernel of the HF engine; its log-probs match a right-padded sdpa or eager forward
to ~1e-6 in float32 (see tests/unit/test_engine.py)."""


@dataclass
class _Incoming:
    """A received version on its way into the model (applied by whichever thread gets there
    first: the sampler between decode steps, or the weight receiver between batches)."""

    weights: list[tuple[str, torch.Tensor]]
    version: int
    probe: torch.Tensor | None
    subset: bool
    adapters_checksum: str | None
    applied: bool = False
    seconds: float = 0.0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


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
    batch may have different sampling parameters. A lock held for a whole batch and by the
    weight receiver makes a version apply between batches, or (inflight mode) the sampler
    takes it between two decode steps while holding that lock.
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
        weight_update_mode: Literal["drain", "inflight"] = "drain",
        inflight_kv: InflightKV = "recompute",
    ):
        self.device = torch.device(device)
        self.weight_update_mode = weight_update_mode
        self.inflight_kv = inflight_kv
        self._incoming: _Incoming | None = None  # inflight mode: a version the sampler may take
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
            out = sample_batch(
                self.model,
                [(r.prompt_ids, r.params) for r in batch],
                self._eos_ids,
                self._pad_id,
                self._generator,
                self._version,
                self._between_steps,
                self.inflight_kv,
            )
            took = time.perf_counter() - start
            self.busy_s += took
            if self.on_batch is not None:
                self.on_batch(wall, took, len(batch), self._version)
            return [
                GenerationOutput(t, lp, v[0], reason, token_versions=v)
                for t, lp, v, reason in zip(
                    out.tokens, out.logprobs, out.versions, out.reasons, strict=True
                )
            ]

    def _between_steps(self) -> int | None:
        """Sampler thread, between decode steps (holding the lock): take a received version
        (only inflight mode publishes one)."""
        incoming = self._incoming
        if incoming is None or incoming.applied:
            return None
        try:
            self._apply(incoming)
        except DeliveryError:
            raise  # the weights are not the version's: the batch fails, nothing is sampled
        except Exception:  # update_weights refused it before copying anything: the old weights
            return None  # sample on; the receiver raises the error and the server stops
        return incoming.version

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
            weights, checksum = got.weights, None
            if self._merger is not None:
                weights = self._merger.merged(got.weights)
                checksum = weights_checksum(got.weights)
            incoming = _Incoming(
                weights, got.version, got.probe, self._merger is not None, checksum
            )
            if self.weight_update_mode == "inflight":
                self._hand_over(incoming)
            else:
                with self._lock:  # between batches
                    self._apply(incoming)
            got.release()  # copied into the model: the next version may reuse the staging
            if incoming.error is not None:
                raise incoming.error
            # inflight: generation paused only for the copy and check; drain: also the wait
            held = time.perf_counter() - start
            if self.weight_update_mode == "inflight":
                held = incoming.seconds
            yield AppliedVersion(got.version, held)

    def _hand_over(self, incoming: _Incoming) -> None:
        """Inflight mode: the batch in flight takes the version between two decode steps; with
        no batch in flight, apply it here. Returns once applied, so the next version can be
        received while the same batch goes on."""
        self._incoming = incoming
        try:
            while not incoming.done.wait(0.01):
                if self._lock.acquire(blocking=False):  # no batch in flight
                    try:
                        if not incoming.applied:
                            self._apply(incoming)
                    finally:
                        self._lock.release()
        finally:
            self._incoming = None

    def _apply(self, incoming: _Incoming) -> None:
        """Copy a version into the model and check its delivery (the caller holds the lock, so
        no token is sampled between the two); weights failing the check fail every later batch."""
        incoming.applied = True
        start = time.perf_counter()
        try:
            self.update_weights(incoming.weights, incoming.version, subset=incoming.subset)
            if incoming.adapters_checksum is not None:
                self._adapters_checksum = incoming.adapters_checksum
            try:
                check_delivery(self, incoming.version, incoming.probe, self.model.config.vocab_size)
            except DeliveryError:
                raise
            except Exception as e:  # copied but unchecked: as bad as a failed check
                raise DeliveryError(
                    f"version {incoming.version} was applied but its delivery check failed: {e!r}"
                ) from e
        except DeliveryError as e:
            self._broken = e
            incoming.error = e
            raise
        except Exception as e:
            incoming.error = e
            raise
        finally:
            incoming.seconds = time.perf_counter() - start
            incoming.done.set()

    def probe_logprobs(self, ids: list[int]) -> torch.Tensor:
        """See `Engine.probe_logprobs`: one forward of the model that samples, under the lock."""
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
        weight receiver) once it applied its version: the writers (receiver, or the sampler
        in inflight mode) hold the lock."""
        yield from self._params.items()

    async def close(self) -> None:
        if self._runner is not None and not self._runner.done():
            await self._runner
        self._executor.shutdown(wait=True)
