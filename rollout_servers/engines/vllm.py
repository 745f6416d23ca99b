"""`rollout.engine=vllm`: vLLM's async engine inside the rollout server, behind `Engine`.

Components:
- an `AsyncLLM` (continuous batching; vLLM runs its scheduler and model in processes of its
  own) driven from a private event loop on a thread of this engine, so the server's event loop
  only awaits futures and never runs vLLM's output processing;
- a gate in front of it: `generate` enters only while no weight version is being applied, and
  counts requests in flight;
- the worker extension (`vllm_worker.WeightSyncExtension`): vLLM's worker process joins the
  learner's weight-sync group itself and stages each version; `follow_learner` waits for its
  `staged` notices (ZeroMQ PULL) and applies each version through the gate.

Invariants (those of `Engine`, and how they are kept here):
- Behaviour log-probs are log_softmax(logits / T) of the sampled token: vLLM's
  `processed_logprobs` mode, which is exactly that while top-p is 1 (with top-p < 1 vLLM would
  return the truncated distribution's log-probs, so the config refuses it), and the T = 1
  softmax for greedy requests.
- A version is applied atomically: the gate closes, requests in flight finish on the old
  version, the worker loads the staged version bucket by bucket (`load_weights`), the prefix
  cache is reset, the delivery probe is scored (vLLM's prompt log-probs against the learner's,
  `check_delivery`), then the version number moves and the gate opens. Every output carries
  the version it was admitted under, which is the version of every one of its tokens. If a
  load or the delivery check fails the gate stays closed: no token is ever sampled from
  half-applied or undelivered weights.
- In-flight mode (`rollout.weight_update_mode=inflight`): instead of waiting for the requests
  in flight, the gate closes and aborts them; each keeps the tokens it has (all sampled by the
  old version) and, once the gate reopens on the new version, is resubmitted with those tokens
  appended to its prompt. vLLM prefills the prefix under the new weights (the prefix cache was
  reset), so every later token's log-prob is exactly the new version's: `inflight_kv=recompute`.
  Every token carries the version it was sampled under (`token_versions`). vLLM's `keep` pause
  would continue over the old KV cache but cannot say which tokens came before the pause, so
  `inflight_kv=keep` is refused for vLLM.
- LoRA (`learner.lora.rank > 0`): versions carry adapters; the worker merges them into the
  checkpoint's base weights and loads the adapted layers (`vllm_lora`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import zmq
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from asyncrl.config import VLLMConfig
from asyncrl.learner_config import LoraConfig
from asyncrl.lora import adapter_specs, adapter_targets
from asyncrl.protocol import WeightReceiverClosed, WeightReceiverFailed, WeightsStaged
from asyncrl.transport import decode_frames
from asyncrl.weight_sync import ParamSpec, specs_of
from rollout_servers.engines.base import (
    AppliedVersion,
    Engine,
    GenerationOutput,
    SamplingParams,
    SyncTarget,
    check_delivery,
)
from rollout_servers.engines.vllm_lora import check_targets

WORKER_EXTENSION = "rollout_servers.engines.vllm_worker.WeightSyncExtension"
T = TypeVar("T")


def meta_model(model_path: str | Path, dtype: str = "float32") -> torch.nn.Module:
    """The Hugging Face model of `model_path`'s config on the meta device (no weights)."""
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))


def learner_weight_specs(model_path: str | Path, dtype: str = "float32") -> list[ParamSpec]:
    """The learner's view of the weights (names, full shapes, the engine's `dtype`) in
    state-dict order, from the config alone: the layout the learner broadcasts (it casts to
    the engine's dtype before sending) and vLLM's `load_weights` reads."""
    return specs_of(meta_model(model_path, dtype).state_dict().items())


def eos_ids(model_path: str | Path) -> frozenset[int]:
    config = AutoConfig.from_pretrained(model_path)
    eos = config.eos_token_id
    if (Path(model_path) / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(model_path)
        eos = generation.eos_token_id if generation.eos_token_id is not None else eos
    return frozenset([eos] if isinstance(eos, int) else (eos or []))


def engine_args(model_path: str, options: VLLMConfig, seed: int, dtype: str = "float32") -> Any:
    """vLLM's `AsyncEngineArgs` as this engine uses them (tools/bench_engines.py drives bare
    vLLM with the same ones)."""
    from vllm import AsyncEngineArgs

    return AsyncEngineArgs(
        model=model_path,
        dtype=dtype,
        seed=seed,
        skip_tokenizer_init=True,  # token ids in, token ids out
        logprobs_mode="processed_logprobs",
        enforce_eager=options.enforce_eager,
        enable_prefix_caching=options.enable_prefix_caching,
        max_num_seqs=options.max_num_seqs,
        max_model_len=options.max_model_len or None,
        gpu_memory_utilization=options.gpu_memory_utilization,
        worker_extension_cls=WORKER_EXTENSION,
    )


def request_params(params: SamplingParams, eos_ids: frozenset[int]) -> Any:
    """asyncrl's sampling parameters as vLLM's, asking for each sampled token's log-prob."""
    from vllm import SamplingParams as VLLMSamplingParams

    return VLLMSamplingParams(
        n=1,
        temperature=params.temperature,
        top_p=params.top_p,
        max_tokens=params.max_new_tokens,
        logprobs=0,  # the sampled token's own log-prob
        stop_token_ids=sorted(
            (set() if params.ignore_eos else eos_ids) | set(params.stop_token_ids)
        ),
        ignore_eos=params.ignore_eos,
        detokenize=False,
    )


class VLLMEngine(Engine):
    """vLLM's AsyncLLM with asyncrl's version gate and weight sync."""

    def __init__(
        self,
        model_path: str | Path,
        options: VLLMConfig,
        device: str = "cpu",
        seed: int = 0,
        version: int = 0,
        dtype: str = "float32",
        lora: LoraConfig | None = None,
        weight_update_mode: Literal["drain", "inflight"] = "drain",
    ):
        from vllm.v1.engine.async_llm import AsyncLLM

        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.cpu_kvcache_space_gib))
        self.model_path = str(model_path)
        meta = meta_model(model_path, dtype)
        self._vocab = meta.config.vocab_size
        self._specs = specs_of(meta.state_dict().items())
        self._lora: dict[str, Any] | None = None
        if lora is not None and lora.rank:  # versions carry adapters (`vllm_lora`)
            self._specs = adapter_specs(meta, lora, getattr(torch, dtype))
            targets = adapter_targets(meta, lora)
            check_targets(self.model_path, targets)  # refused now, not when the worker joins
            self._lora = dict(model_path=self.model_path, targets=targets, scale=lora.scale)
            self._lora["dtype"] = dtype
        self._eos_ids = eos_ids(model_path)
        self._version = version
        self.weight_update_mode = weight_update_mode
        self._live: set[str] = set()  # vLLM request ids in flight
        self._aborts = 0  # versions that aborted requests in flight (inflight mode)
        self._broken: BaseException | None = None  # a version failed: every request fails
        self._inflight = 0
        self._busy_since = 0.0
        self._busy_done = 0.0  # seconds of busy periods that ended
        self._period_requests = 0
        self._closed = False

        args = engine_args(self.model_path, options, seed, dtype)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="vllm-engine-loop"
        )
        self._thread.start()

        async def build() -> Any:
            self._open = asyncio.Event()
            self._open.set()
            self._drained = asyncio.Event()
            self._drained.set()
            return AsyncLLM.from_engine_args(args)

        self.llm = self._call(build())

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
        future = asyncio.run_coroutine_threadsafe(
            self._generate(list(prompt_ids), params), self._loop
        )
        return await asyncio.wrap_future(future)

    async def _generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        """On the engine loop: pass the gate, run the request in vLLM. In inflight mode a
        request aborted for a new version comes back here with its tokens so far and goes on
        under the new version, its tokens appended to the prompt."""
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
            sample = await self._run(prompt_ids + tokens, left, version)
            new = list(sample.token_ids)
            tokens += new
            logprobs += [step[t].logprob for step, t in zip(sample.logprobs, new, strict=True)]
            versions += [version] * len(new)
            reason = sample.finish_reason
            if reason == "abort" and self._aborts != aborts:  # aborted for a new version
                if len(tokens) < params.max_new_tokens:
                    continue
                reason = "length"
            if reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a request with reason {reason!r}")
            first = versions[0] if versions else version
            mixed = versions if len(set(versions)) > 1 else None
            return GenerationOutput(tokens, logprobs, first, reason, token_versions=mixed)

    async def _run(self, prompt_ids: list[int], params: SamplingParams, version: int) -> Any:
        """One vLLM request, counted in flight under `version`; its final sample."""
        from vllm import TokensPrompt

        request_id = uuid.uuid4().hex
        self._enter()
        self._live.add(request_id)
        try:
            final = None
            async for out in self.llm.generate(
                TokensPrompt(prompt_token_ids=prompt_ids),
                request_params(params, self._eos_ids),
                request_id=request_id,
            ):
                final = out
        finally:
            self._live.discard(request_id)
            self._leave(version)
        if final is None:
            raise RuntimeError("vLLM returned no output")
        return final.outputs[0]

    def _enter(self) -> None:
        if self._inflight == 0:
            self._busy_since = time.time()
            self._period_requests = 0
            self._drained.clear()
        self._inflight += 1
        self._period_requests += 1

    def _leave(self, version: int) -> None:
        """A busy period (from the first request in flight to none) is this engine's "batch":
        vLLM batches continuously, so busy time and trace spans are measured per period."""
        if self._inflight == 1:  # ends the period: counted before busy_s stops adding it
            took = time.time() - self._busy_since
            self._busy_done += took
        self._inflight -= 1
        if self._inflight == 0:
            if self.on_batch is not None:
                self.on_batch(self._busy_since, took, self._period_requests, version)
            self._drained.set()

    # ---- weights ----------------------------------------------------------------------------
    def follow_learner(self, target: SyncTarget) -> Iterator[AppliedVersion]:
        ctx = zmq.Context.instance()
        notices = ctx.socket(zmq.PULL)
        # in a directory only this uid can enter: no other local user can send a notice
        private = Path(tempfile.mkdtemp(prefix="asyncrl-vllm-"))
        address = f"ipc://{private}/notices-{uuid.uuid4().hex[:12]}"
        notices.bind(address)
        try:
            specs = [(s.name, list(s.shape), str(s.dtype)) for s in self._specs]
            self._call(
                self.llm.collective_rpc(
                    "asyncrl_join_sync_group",
                    args=(
                        target.host,
                        target.port,
                        target.rank,
                        target.world_size,
                        specs,
                        address,
                        target.timeout_s,
                        self._lora,
                        target.server_id,
                        target.epoch,
                    ),
                )
            )
            while not self._closed:
                if not notices.poll(500):
                    continue
                notice = decode_frames(notices.recv_multipart())
                if isinstance(notice, WeightReceiverClosed):
                    return
                if isinstance(notice, WeightReceiverFailed):
                    raise RuntimeError(f"vLLM worker's weight receiver failed: {notice.error}")
                if not isinstance(notice, WeightsStaged):
                    raise RuntimeError(f"unexpected notice from the vLLM worker: {notice!r}")
                yield AppliedVersion(notice.version, self._apply(notice))
        finally:
            notices.close(linger=0)
            Path(address.removeprefix("ipc://")).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                private.rmdir()

    def _apply(self, notice: WeightsStaged) -> float:
        """Close the gate, drain, load, reset the prefix cache, check delivery, reopen; seconds
        taken. When loading or the delivery check fails the gate stays closed: no token is
        sampled from weights that are not the version's."""
        start = time.perf_counter()
        try:
            self._call(self._load(notice.version))
            probe = torch.tensor(notice.probe) if notice.probe else None
            check_delivery(self, notice.version, probe, self._vocab)
        except BaseException as e:  # waiting callers and later ones fail with it, not hang
            self._call(self._fail(e))
            raise
        self._call(self._reopen(notice.version))
        return time.perf_counter() - start

    async def _fail(self, error: BaseException) -> None:
        """On the engine loop: the gate opens onto `error` (it never reopens onto weights)."""
        self._broken = error
        self._open.set()

    async def _load(self, version: int) -> None:
        """On the engine loop: close the gate, drain (inflight mode: abort the requests in
        flight, which resume under the new version), load the staged version, reset the cache."""
        self._open.clear()
        if self.weight_update_mode == "inflight" and self._live:
            self._aborts += 1  # before the abort: each request sees it when its output returns
            await self.llm.abort(list(self._live))
        await self._drained.wait()
        await self.llm.collective_rpc("asyncrl_apply", args=(version,))
        if not await self.llm.reset_prefix_cache():  # False: blocks still in use
            raise RuntimeError(f"vLLM could not reset its prefix cache after version {version}")

    async def _reopen(self, version: int) -> None:
        self._version = version
        self._open.set()

    def probe_logprobs(self, ids: list[int]) -> torch.Tensor:
        """See `Engine.probe_logprobs`: vLLM's prompt log-probs of `ids` (raw logits, T = 1),
        scored past the gate, so also while it is closed for a version being checked."""
        return self._call(self._prompt_logprobs(ids))

    async def _prompt_logprobs(self, ids: list[int]) -> torch.Tensor:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm import TokensPrompt

        params = VLLMSamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        final = None
        async for out in self.llm.generate(
            TokensPrompt(prompt_token_ids=list(ids)), params, request_id=uuid.uuid4().hex
        ):
            final = out
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError("vLLM returned no prompt log-probs for the delivery probe")
        steps = final.prompt_logprobs[1:]  # the first token has none
        return torch.tensor([step[t].logprob for step, t in zip(steps, ids[1:], strict=True)])

    # ---- lifecycle --------------------------------------------------------------------------
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.llm.shutdown()
        del self.llm  # now, while the interpreter is whole (vLLM's __del__ shuts down again)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
