"""The transformers engine: runs anywhere (CPU or CUDA), in the rollout server's process.

`HFEngine` batches continuously: one sampling loop on a worker thread admits queued requests
between decode steps while it has room, and hands each response back as soon as its row
finishes (`hf_sampling.LiveBatch`). It applies a weight version entirely or not at all (the
`Engine` invariants in `base.py`): once the rows in flight finished, admitting none meanwhile
(`weight_update_mode="drain"`), or between two decode steps (`"inflight"`: later tokens carry
the new version, `hf_sampling`).

Modules: `hf` (`HFEngine`: the request queue and the sampling loop's thread), `hf_versions`
(`HFVersionGate`, its base: the weights, and how each version from the learner reaches them),
`hf_sampling` (`LiveBatch`: rows joining and leaving between decode steps), `hf_kv_cache` (what
is done to the KV cache tensors).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from asyncrl.config.learner import LoraConfig
from asyncrl.dtypes import torch_dtype
from rollout_servers.engines.base import (
    DeliveryError,
    GenerationOutput,
    SamplingParams,
)
from rollout_servers.engines.hf_sampling import AdmitError, InflightKV, LiveBatch, Row
from rollout_servers.engines.hf_versions import HFVersionGate

ATTN_IMPLEMENTATION = "sdpa"
"""Attention kernel of the HF engine; its log-probs match a right-padded sdpa or eager forward
to ~1e-6 in float32 (see tests/unit/test_engine.py)."""


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[GenerationOutput]


@dataclass
class _BusyPeriod:
    """From a row going live in an empty batch to the batch being empty again: the engine's
    "batch" for traces (`Engine.on_batch`), as vLLM's engine reports it."""

    wall: float = field(default_factory=time.time)
    start: float = field(default_factory=time.perf_counter)
    requests: int = 0
    """Requests admitted during the period."""
    version: int = 0
    """The version its first tokens were sampled with (inflight mode may apply more)."""


def _settle(
    future: asyncio.Future[GenerationOutput],
    out: GenerationOutput | None,
    error: BaseException | None,
) -> None:
    """On the event loop: hand a caller its response or failure (unless it gave up)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(out)  # type: ignore[arg-type]


def _answer(
    future: asyncio.Future[GenerationOutput],
    out: GenerationOutput | None,
    error: BaseException | None,
) -> None:
    """From the sampling thread: settle `future` on its own event loop (a loop that has closed
    has no one left to answer)."""
    with contextlib.suppress(RuntimeError):
        future.get_loop().call_soon_threadsafe(_settle, future, out, error)


def _output(row: Row) -> GenerationOutput:
    return GenerationOutput(
        row.tokens, row.logprobs, row.versions[0], row.reason, token_versions=row.versions
    )


class HFEngine(HFVersionGate):
    """A transformers model behind a continuous request queue and one sampling loop.

    Callers on the event loop enqueue requests; a runner task starts the sampling loop on a
    dedicated worker thread whenever requests wait and none runs, so the event loop never
    blocks. The loop admits queued requests between decode steps (at most `max_batch_size`
    live rows, each with its own sampling parameters) and resolves each caller's future,
    thread-safely, as soon as its row finishes. The loop holds the gate's lock while rows are
    live; versions come through the gate (`hf_versions.HFVersionGate`), so a steady stream of
    requests cannot hold a version back: drain mode stops admitting until it is applied.
    """

    busy_s: float = 0.0
    """Seconds the sampling loop spent admitting and stepping rows (`Engine.busy_s`)."""

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
        self.inflight_kv = inflight_kv
        self.max_batch_size = max_batch_size
        where = torch.device(device)
        # transformers wraps `PreTrainedModel.to` in a decorator its stubs type as unbound
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch_dtype(dtype), attn_implementation=ATTN_IMPLEMENTATION
        ).to(where)  # type: ignore[arg-type]
        model.eval()
        self._init_gate(model, where, version, lora, weight_update_mode)
        config = model.config
        eos = model.generation_config.eos_token_id
        eos = config.eos_token_id if eos is None else eos
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        # prompt and response together fit the positions the model has (the replay refuses
        # longer trajectories, so a response running past them would be generated for nothing)
        self._context = getattr(config, "max_position_embeddings", None) or 2**31
        self.context_tokens = self._context
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._closed = False
        self._pending: deque[_Request] = deque()  # appended by the loop, taken by the worker
        self._runner: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self.batches_run = 0
        """Busy periods so far (`_BusyPeriod`: batching is observable in tests and stats)."""
        self.live_rows = 0
        """Rows the sampling loop holds now (at most `max_batch_size`)."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        room = self._context - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"a prompt of {len(prompt_ids)} tokens leaves no room to sample in the model's "
                f"context of {self._context}"
            )
        if params.max_new_tokens > room:  # the response ends at the context ("length")
            self.note_context_cap(len(prompt_ids), params.max_new_tokens)
            params = dataclasses.replace(params, max_new_tokens=room)
        vocab = cast(int, self.model.get_input_embeddings().num_embeddings)
        if bad := [t for t in prompt_ids if not 0 <= t < vocab]:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the model's vocabulary [0, {vocab})"
            )
        if self._closed:
            raise RuntimeError("HFEngine is closed")
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
        """Run the sampling loop while requests wait; exits when none does (generate restarts
        it). The loop returns only with its queue empty, but a request may arrive just after."""
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                await loop.run_in_executor(self._executor, self._serve, loop)
        except Exception as e:  # the loop died: its error goes to every queued caller
            self._fail_pending(e)
        except BaseException as e:  # cancelled: nobody would answer the queued callers
            self._fail_pending(RuntimeError(f"the HF sampling loop stopped: {e!r}"))
            raise

    def _fail_pending(self, error: Exception) -> None:
        while self._pending:
            _settle(self._pending.popleft().future, None, error)

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        """Worker thread: sample until no row is live and nothing can be admitted. A failure
        fails the live rows (DeliveryError: and every later request, `_admit`); a version
        waiting while no row is live is applied first (it then holds back no request)."""
        batch = LiveBatch(
            self.model, self._eos_ids, self._pad_id, self._generator, self.inflight_kv
        )
        period: _BusyPeriod | None = None
        with self._lock, torch.inference_mode():
            try:
                while True:
                    if not batch:
                        self._end_period(period)
                        period = None
                        self._maybe_apply_waiting()
                    started = time.perf_counter()
                    admitted = self._admit(batch, loop)
                    if not batch:
                        return
                    if period is None:
                        period, self.batches_run = _BusyPeriod(), self.batches_run + 1
                        period.version = self._version
                    period.requests += admitted
                    self._step(batch, loop)
                    self.busy_s += time.perf_counter() - started
            except Exception as e:  # the callers own the failure: each of them re-raises it
                for row in batch.rows:
                    _answer(row.owner.future, None, e)
            finally:
                self.live_rows = 0
                self._end_period(period)

    def _step(self, batch: LiveBatch, loop: asyncio.AbstractEventLoop) -> None:
        """One decode step: a token for every live row, finished rows handed back at once,
        rows whose caller gave up dropped, then (inflight) a version may land before the
        forward of the new tokens."""
        self.live_rows = len(batch)
        for row in batch.sample(self._version):
            _answer(row.owner.future, _output(row), None)
        batch.remove([r for r in batch.rows if r.owner.future.done()])
        if batch:
            new = self._between_steps()
            batch.advance(weights_changed=new is not None)

    def _admit(self, batch: LiveBatch, loop: asyncio.AbstractEventLoop) -> int:
        """Queued requests join the batch while it has room; none while a version waits in
        drain mode (the live rows finish, then it is applied). Returns how many joined."""
        if self.weight_update_mode == "drain" and self._version_waiting():
            return 0
        taken: list[_Request] = []
        while batch.can_admit() and self._pending and len(batch) + len(taken) < self.max_batch_size:
            request = self._pending.popleft()
            if not request.future.done():  # not cancelled while queued
                taken.append(request)
        if not taken:
            return 0
        try:
            if self._broken is not None:  # weights that failed their delivery check
                raise self._broken
            batch.admit([(r.prompt_ids, r.params, r) for r in taken])
        except Exception as e:
            cause = e.__cause__ if isinstance(e, AdmitError) and e.__cause__ is not None else e
            for r in taken:
                _answer(r.future, None, cause)
            if isinstance(e, DeliveryError | AdmitError):  # the live rows are untouched
                return 0
            raise
        return len(taken)

    def _end_period(self, period: _BusyPeriod | None) -> None:
        """Report a busy period that just ended (see `_BusyPeriod`)."""
        if period is not None and self.on_batch is not None:
            took = time.perf_counter() - period.start
            self.on_batch(period.wall, took, period.requests, period.version)

    async def close(self) -> None:
        self._closed = True  # a later generate raises instead of waiting on a stopped executor
        if self._runner is not None and not self._runner.done():
            await self._runner
        self._executor.shutdown(wait=True)
