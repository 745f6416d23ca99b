"""What the vLLM and SGLang engines share: an async engine on a private event loop, behind a
version gate.

Both wrap an engine whose async API must be driven from the event loop it was built on, while
the server's event loop runs agent loops and its weight-receiver thread applies versions. So
`GatedEngine` owns:
- a private event loop on a thread of its own, where the wrapped engine is built and every
  request runs (`generate` hops onto it; `_call` waits on it from any other thread);
- the version gate: `generate` enters only while it is open; a version closes it, drains (or,
  in inflight mode, aborts) the requests in flight, is loaded, checked (`check_delivery`) and
  reopens it under the new version number; a version that fails leaves it open onto the error,
  never onto weights (`_apply_version`);
- in inflight mode, the resume: a request aborted for a new version comes back to `_generate`
  with its tokens so far and goes on under the new version, its tokens appended to the prompt
  (the engine prefills that prefix under the new weights: `inflight_kv=recompute`); every
  token carries the version that sampled it;
- busy periods (from the first request in flight to none), this engine's "batch": both batch
  continuously, so busy time and trace spans are measured per period.

A subclass builds its engine (`_start_loop`), runs one request (`_run`), aborts requests
(`_abort`) and loads a version inside `_apply_version`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any, Literal, TypeGuard, TypeVar

from asyncrl.weights.probe import DeliveryProbe
from rollout_servers.engines.base import Engine, GenerationOutput, SamplingParams, check_delivery

T = TypeVar("T")


def _finished(reason: str) -> TypeGuard[Literal["stop", "length"]]:
    """A finish reason a `GenerationOutput` may carry (not an abort, nor an engine's own)."""
    return reason in ("stop", "length")


class GatedEngine(Engine):
    """An engine on a private event loop behind a version gate (module docstring)."""

    name = "the engine"  # in error messages
    _vocab: int  # the model's vocabulary size (the delivery check's bound); set by the subclass

    def _init_gate(self, version: int, weight_update_mode: Literal["drain", "inflight"]) -> None:
        self._version = version
        self.weight_update_mode = weight_update_mode
        self._live: set[str] = set()  # request ids in flight
        self._aborts = 0  # versions that aborted requests in flight (inflight mode)
        self._broken: BaseException | None = None  # a version failed: every request fails
        self._inflight = 0
        self._busy_since = 0.0
        self._busy_done = 0.0  # seconds of busy periods that ended
        self._period_requests = 0
        self._closed = False

    def _start_loop(self, thread_name: str, build: Callable[[], Any]) -> Any:
        """Start the private loop and return `build()`, called on it (the engine binds there)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name=thread_name
        )
        self._thread.start()

        async def on_loop() -> Any:
            self._open = asyncio.Event()
            self._open.set()
            self._drained = asyncio.Event()
            self._drained.set()
            return build()

        return self._call(on_loop())

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the engine's loop from any other thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def version(self) -> int:
        return self._version

    @property
    def busy_s(self) -> float:
        """Busy seconds so far, the busy period under way included (a server that never goes
        idle is not reported idle)."""
        current = time.time() - self._busy_since if self._inflight else 0.0
        return self._busy_done + current

    # ---- generation -------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        self._check_params(params)
        self.note_context_cap(len(prompt_ids), params.max_new_tokens)  # it ends at the context
        future = asyncio.run_coroutine_threadsafe(
            self._generate(list(prompt_ids), params), self._loop
        )
        return await asyncio.wrap_future(future)

    def _check_params(self, params: SamplingParams) -> None:
        """Refuse what the engine cannot sample, here rather than on the engine loop."""

    async def _generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        """On the engine loop: pass the gate, run the request; in inflight mode resume it after
        an abort for a new version (module docstring)."""
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            while not self._open.is_set():
                await self._open.wait()
            if self._broken is not None:  # weights that failed to load or their check
                raise self._broken
            version, aborts = self._version, self._aborts
            left = replace(params, max_new_tokens=params.max_new_tokens - len(tokens))
            self._enter()
            try:
                new, new_logprobs, reason = await self._run(prompt_ids + tokens, left)
            finally:
                self._leave(version)
            tokens += new
            logprobs += new_logprobs
            versions += [version] * len(new)
            if reason == "abort" and self._aborts != aborts:  # aborted for a new version
                if len(tokens) < params.max_new_tokens:
                    continue
                reason = "length"
            if not _finished(reason):
                raise RuntimeError(f"{self.name} finished a request with reason {reason!r}")
            first = versions[0] if versions else version
            mixed = versions if len(set(versions)) > 1 else None
            return GenerationOutput(tokens, logprobs, first, reason, token_versions=mixed)

    @abstractmethod
    async def _run(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], list[float], str]:
        """On the engine loop: one request, its id in `self._live` while it runs; (token ids,
        their log-probs, finish reason: stop, length or abort)."""

    def _enter(self) -> None:
        if self._inflight == 0:
            self._busy_since = time.time()
            self._period_requests = 0
            self._drained.clear()
        self._inflight += 1
        self._period_requests += 1

    def _leave(self, version: int) -> None:
        if self._inflight == 1:  # ends the period: counted before busy_s stops adding it
            took = time.time() - self._busy_since
            self._busy_done += took
        self._inflight -= 1
        if self._inflight == 0:
            if self.on_batch is not None:
                self.on_batch(self._busy_since, took, self._period_requests, version)
            self._drained.set()

    # ---- weights ----------------------------------------------------------------------------
    def _apply_version(
        self, version: int, load: Coroutine[Any, Any, None], probe: DeliveryProbe | None
    ) -> float:
        """Run `load` on the engine loop (it closes the gate with `_close_and_drain` and loads
        the version), check delivery, reopen; seconds taken. When loading or the delivery check
        fails the gate opens onto the error: no token is sampled from weights that are not the
        version's, and waiting and later callers fail with it instead of hanging."""
        start = time.perf_counter()
        try:
            self._call(load)
            check_delivery(self, version, probe, self._vocab)
        except BaseException as e:
            self._call(self._fail(e))
            raise
        self._call(self._reopen(version))
        return time.perf_counter() - start

    async def _close_and_drain(self) -> None:
        """On the engine loop: close the gate and wait for the requests in flight to finish
        (inflight mode: abort them; they resume under the new version)."""
        self._open.clear()
        if self.weight_update_mode == "inflight" and self._live:
            self._aborts += 1  # before the abort: each request sees it when its output returns
            await self._abort(list(self._live))
        await self._drained.wait()

    @abstractmethod
    async def _abort(self, request_ids: list[str]) -> None:
        """On the engine loop: abort these requests; each returns what it has, reason abort."""

    async def _fail(self, error: BaseException) -> None:
        self._broken = error
        self._open.set()

    async def _reopen(self, version: int) -> None:
        self._version = version
        self._open.set()
