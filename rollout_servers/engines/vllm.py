"""`rollout.engine=vllm`: vLLM's async engine inside the rollout server, behind `Engine`.

Components:
- an `AsyncLLM` (continuous batching; vLLM runs its scheduler and model in processes of its
  own) driven from a private event loop on a thread of this engine, so the server's event loop
  only awaits futures and never runs vLLM's output processing;
- a gate in front of it: `generate` enters only while no weight version is being applied, and
  counts requests in flight;
- the worker extension (`vllm_worker.WeightSyncExtension`): vLLM's worker process joins the
  learner's weight-sync group itself (told where and what by one typed message,
  `vllm_join.JoinWeightSync`) and stages each version; `follow_learner` waits for its `staged`
  notices (ZeroMQ PULL) and applies each version through the gate.

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

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import zmq
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from asyncrl.config import VLLMConfig
from asyncrl.config.learner import LoraConfig
from asyncrl.dtypes import torch_dtype
from asyncrl.placement import OWN_GPU_FRACTION
from asyncrl.weights.layout import ParamSpec, specs_of
from asyncrl.weights.lora import adapter_specs, adapter_targets
from asyncrl.weights.probe import DeliveryProbe
from asyncrl.wire.sockets import decode_frames
from rollout_servers.engines.base import (
    AppliedVersion,
    SamplingParams,
    SyncTarget,
)
from rollout_servers.engines.gated import GatedEngine
from rollout_servers.engines.vllm_join import LoraMerge, join_message, pack_join
from rollout_servers.engines.vllm_lora import check_targets
from rollout_servers.engines.vllm_notices import (
    WeightReceiverClosed,
    WeightReceiverFailed,
    WeightsStaged,
)

WORKER_EXTENSION = "rollout_servers.engines.vllm_worker.WeightSyncExtension"


def meta_model(model_path: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """The Hugging Face model of `model_path`'s config on the meta device (no weights)."""
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))


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


def engine_args(
    model_path: str,
    options: VLLMConfig,
    seed: int,
    dtype: str = "float32",
    gpu_memory_fraction: float = OWN_GPU_FRACTION,
    tensor_parallel: int = 1,
) -> Any:
    """vLLM's `AsyncEngineArgs` as this engine uses them (tools/bench_engines.py drives bare
    vLLM with the same ones). `gpu_memory_fraction`: the server's share of each of its GPUs
    (`rollout.gpu_memory_fraction` as placed, `asyncrl.placement`; unused on CPU);
    `tensor_parallel`: its GPUs (`rollout.gpus_per_server`)."""
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
        gpu_memory_utilization=gpu_memory_fraction,
        tensor_parallel_size=tensor_parallel,
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


class VLLMEngine(GatedEngine):
    """vLLM's AsyncLLM with asyncrl's version gate and weight sync (`gated.GatedEngine`)."""

    name = "vLLM"

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
        gpu_memory_fraction: float = OWN_GPU_FRACTION,
        tensor_parallel: int = 1,
    ):
        from vllm.v1.engine.async_llm import AsyncLLM

        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(options.cpu_kvcache_space_gib))
        self.model_path = str(model_path)
        meta = meta_model(model_path, dtype)
        self._vocab = meta.config.vocab_size
        self._specs = specs_of(meta.state_dict().items())
        self._lora: LoraMerge | None = None
        if lora is not None and lora.rank:  # versions carry adapters (`vllm_lora`)
            self._specs = adapter_specs(meta, lora, torch_dtype(dtype))
            targets = adapter_targets(meta, lora)
            check_targets(self.model_path, targets)  # refused now, not when the worker joins
            self._lora = LoraMerge(self.model_path, targets, lora.scale, dtype)
        self._eos_ids = eos_ids(model_path)
        self._init_gate(version, weight_update_mode)
        args = engine_args(
            self.model_path, options, seed, dtype, gpu_memory_fraction, tensor_parallel
        )
        self.llm = self._start_loop("vllm-engine-loop", lambda: AsyncLLM.from_engine_args(args))
        self.context_tokens = self.llm.model_config.max_model_len  # vLLM ends a response there

    # ---- generation -------------------------------------------------------------------------
    async def _run(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], list[float], str]:
        from vllm import TokensPrompt

        request_id = uuid.uuid4().hex
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
        if final is None:
            raise RuntimeError("vLLM returned no output")
        sample = final.outputs[0]
        new = list(sample.token_ids)
        logprobs = [step[t].logprob for step, t in zip(sample.logprobs, new, strict=True)]
        return new, logprobs, sample.finish_reason

    async def _abort(self, request_ids: list[str]) -> None:
        await self.llm.abort(request_ids)

    # ---- weights ----------------------------------------------------------------------------
    def follow_learner(self, target: SyncTarget) -> Iterator[AppliedVersion]:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        notices = ctx.socket(zmq.PULL)
        # in a directory only this uid can enter: no other local user can send a notice
        private = Path(tempfile.mkdtemp(prefix="asyncrl-vllm-"))
        address = f"ipc://{private}/notices-{uuid.uuid4().hex[:12]}"
        notices.bind(address)
        try:
            join = join_message(target, self._specs, address, self._lora)
            self._call(self.llm.collective_rpc("asyncrl_join_sync_group", args=(pack_join(join),)))
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
        """Close the gate, drain, load, reset the prefix cache, check delivery, reopen
        (`GatedEngine._apply_version`); seconds taken."""
        probe = DeliveryProbe.from_wire(torch.tensor(notice.probe)) if notice.probe else None
        return self._apply_version(notice.version, self._load(notice.version), probe)

    async def _load(self, version: int) -> None:
        """On the engine loop: close the gate and drain, load the staged version in the worker,
        reset the prefix cache."""
        await self._close_and_drain()
        await self.llm.collective_rpc("asyncrl_apply", args=(version,))
        if not await self.llm.reset_prefix_cache():  # False: blocks still in use
            raise RuntimeError(f"vLLM could not reset its prefix cache after version {version}")

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
