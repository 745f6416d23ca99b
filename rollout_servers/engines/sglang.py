"""`rollout.engine=sglang`: SGLang's offline engine inside the rollout server, behind `Engine`.

Components:
- an `sglang.Engine` (its scheduler and model run in processes of their own; its tokenizer
  manager runs here) built on and driven from a private event loop on a thread of this engine,
  so the server's event loop only awaits futures; token ids in and out (`skip_tokenizer_init`);
- a gate in front of it: `generate` enters only while no weight version is being applied, and
  counts requests in flight;
- the weight receiver, in this process: `follow_learner` joins the learner's weight-sync group
  with asyncrl's own `join_sync_group` / `WeightReceiver` (the one protocol every engine
  speaks: header, buckets, delivery probe, ack; per-server groups and epochs), stages each
  whole version, and applies it through the gate with SGLang's `begin_weight_update`,
  `update_weights_from_tensor`, `end_weight_update` and `flush_cache`.

Invariants (those of `Engine`, and how they are kept here):
- Behaviour log-probs are log_softmax(logits / T) of the sampled token: SGLang's sampler
  returns log(softmax(logits / T)) taken before top-k/top-p filtering, and for greedy requests
  (T = 0, which SGLang runs as top_k = 1 at T = 1) the T = 1 softmax. Options that would change
  the distribution it is taken from (top_p < 1) are refused, here and in the config.
- A version is applied atomically: the gate closes, requests in flight finish on the old
  version, the whole staged version is loaded in one `update_weights_from_tensor` between
  `begin_weight_update` and `end_weight_update`, the radix cache is flushed, the delivery probe
  is scored (SGLang's prompt log-probs against the learner's, `check_delivery`), then the
  version number moves and the gate opens. Every output carries the version it was admitted
  under, which is the version of every one of its tokens. If a load or the delivery check
  fails the gate stays closed: no token is ever sampled from half-applied or undelivered
  weights.
- In-flight mode (`rollout.weight_update_mode=inflight`): instead of waiting for the requests
  in flight, the gate closes and aborts them (SGLang's `abort_request`); each keeps the tokens
  it has (all sampled by the old version) and, once the gate reopens on the new version, is
  resubmitted with those tokens appended to its prompt. SGLang prefills the prefix under the
  new weights (the cache was flushed), so every later token's log-prob is exactly the new
  version's: `inflight_kv=recompute`, as the vLLM engine does. Every token carries the version
  it was sampled under (`token_versions`).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from asyncrl.config import SGLangConfig
from asyncrl.cpu import cpu_flags
from asyncrl.placement import OWN_GPU_FRACTION
from asyncrl.weights.group import join_sync_group
from asyncrl.weights.receiver import ReceivedVersion, WeightReceiver
from rollout_servers.engines.base import (
    AppliedVersion,
    SamplingParams,
    SyncTarget,
)
from rollout_servers.engines.gated import GatedEngine
from rollout_servers.engines.vllm import eos_ids, learner_weight_specs


def engine_kwargs(
    model_path: str,
    options: SGLangConfig,
    device: str,
    seed: int,
    dtype: str = "float32",
    gpu_memory_fraction: float = OWN_GPU_FRACTION,
    tensor_parallel: int = 1,
) -> dict[str, Any]:
    """`sglang.Engine`'s arguments as this engine uses them (tools/bench_engines.py drives bare
    SGLang with the same ones). `gpu_memory_fraction`: the server's share of each of its GPUs
    (`rollout.gpu_memory_fraction` as placed, `asyncrl.placement`; unused on CPU);
    `tensor_parallel`: its GPUs (`rollout.gpus_per_server`)."""
    return dict(
        model_path=model_path,
        device=device,
        dtype=dtype,
        random_seed=seed,
        skip_tokenizer_init=True,  # token ids in, token ids out
        mem_fraction_static=gpu_memory_fraction,
        tp_size=tensor_parallel,
        max_total_tokens=options.max_total_tokens,
        max_running_requests=options.max_running_requests,
        context_length=options.context_length or None,
        disable_radix_cache=options.disable_radix_cache,
        disable_cuda_graph=device == "cpu",
        log_level="error",
    )


SGLANG_CPU_FLAGS = ("avx512f", "avx512_bf16")
"""What SGLang's CPU kernel package executes: it is built for AVX-512 with bf16 instructions, even
in kernels an fp32 model runs (rmsnorm, rotary, silu_and_mul). Without avx512f, importing it dies
with SIGILL; without avx512_bf16, the first forward kills SGLang's scheduler with SIGILL, and
SGLang then sends SIGQUIT to its own parent: the rollout server, unexplained."""


def check_cpu_can_run_sglang(dtype: str = "float32", cpuinfo: str | None = None) -> None:
    """Refuse, naming the missing flags, a CPU that SGLang's CPU kernels would crash on, and a
    float32 model on a CPU with AMX, where SGLang takes its AMX kernels, whose rmsnorm has no
    float32 ("rmsnorm_kernel not implemented for 'Float'" kills the scheduler; seen). `cpuinfo`:
    /proc/cpuinfo's text, in tests; an unreadable one is not refused."""
    flags = cpu_flags(cpuinfo)
    missing = [f for f in SGLANG_CPU_FLAGS if flags is not None and f not in flags]
    if missing:
        raise RuntimeError(
            f"rollout.engine=sglang on this CPU: its flags lack {', '.join(missing)}, which "
            "SGLang's CPU kernels execute (they would die with SIGILL); use rollout.engine=hf "
            "or vllm here"
        )
    if flags is not None and "amx_tile" in flags and dtype == "float32":
        raise RuntimeError(
            "rollout.engine=sglang with rollout.dtype=float32 on this CPU: it has AMX, so SGLang "
            "runs its AMX kernels, whose rmsnorm has no float32; use rollout.dtype=bfloat16, or "
            "rollout.engine=hf or vllm"
        )


def setup_sglang(kwargs: dict[str, Any]) -> Any:
    """An `sglang.Engine` (on CPU with SGLang's CPU engine, set before sglang is imported).
    Call it on the event loop that will drive it: SGLang binds its tokenizer manager there."""
    if kwargs["device"] == "cpu":
        check_cpu_can_run_sglang(str(kwargs["dtype"]))
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sglang

    return sglang.Engine(**kwargs)


def request_params(params: SamplingParams, eos_ids: frozenset[int]) -> dict[str, Any]:
    """asyncrl's sampling parameters as SGLang's."""
    if params.top_p < 1:
        raise ValueError(
            f"top_p={params.top_p} with the SGLang engine: its log-probs would not be those of "
            "the untruncated softmax the learner recomputes; use top_p=1"
        )
    return {
        "temperature": params.temperature,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": sorted(
            (set() if params.ignore_eos else eos_ids) | set(params.stop_token_ids)
        ),
        "ignore_eos": params.ignore_eos,
    }


def parse_output(out: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """(token ids, their log-probs, finish reason) of one `async_generate` result."""
    meta = out["meta_info"]
    tokens = list(out["output_ids"])
    logprobs = [float(lp) for lp, _, *_ in meta["output_token_logprobs"]]
    if [t for _, t, *_ in meta["output_token_logprobs"]] != tokens:
        raise RuntimeError("SGLang's log-probs do not line up with its output ids")
    finish = meta.get("finish_reason") or {}
    return tokens, logprobs, finish.get("type", "") if isinstance(finish, dict) else str(finish)


class SGLangEngine(GatedEngine):
    """SGLang's offline engine with asyncrl's version gate and weight sync (`gated.GatedEngine`)."""

    name = "SGLang"

    def __init__(
        self,
        model_path: str | Path,
        options: SGLangConfig,
        device: str = "cpu",
        seed: int = 0,
        version: int = 0,
        dtype: str = "float32",
        weight_update_mode: Literal["drain", "inflight"] = "drain",
        gpu_memory_fraction: float = OWN_GPU_FRACTION,
        tensor_parallel: int = 1,
    ):
        self.model_path = str(model_path)
        self._specs = learner_weight_specs(model_path, dtype)
        from transformers import AutoConfig

        self._vocab = AutoConfig.from_pretrained(model_path).vocab_size
        self._eos_ids = eos_ids(model_path)
        self._init_gate(version, weight_update_mode)
        kwargs = engine_kwargs(
            self.model_path, options, device, seed, dtype, gpu_memory_fraction, tensor_parallel
        )
        self.llm = self._start_loop("sglang-engine-loop", lambda: setup_sglang(kwargs))

    # ---- generation -------------------------------------------------------------------------
    def _check_params(self, params: SamplingParams) -> None:
        request_params(params, self._eos_ids)  # refused here, not on the engine loop

    async def _run(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], list[float], str]:
        rid = uuid.uuid4().hex
        self._live.add(rid)
        try:
            out = await self.llm.async_generate(
                input_ids=prompt_ids,
                sampling_params=request_params(params, self._eos_ids),
                return_logprob=True,
                rid=rid,
            )
        finally:
            self._live.discard(rid)
        return parse_output(out)

    async def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.llm.tokenizer_manager.abort_request(rid)

    # ---- weights ----------------------------------------------------------------------------
    def follow_learner(self, target: SyncTarget) -> Iterator[AppliedVersion]:
        """Joins in this process (module docstring); the learner's next version waits in its
        broadcast until this one is applied and `receive` is called again."""
        args = (target.host, target.port, target.rank, target.world_size, target.device)
        group = join_sync_group(
            *args, target.timeout_s, target.server_id, target.epoch, key=target.key
        )
        receiver = WeightReceiver(group, self._specs)
        while not self._closed:
            got = receiver.receive()
            if got is None:
                return
            yield AppliedVersion(got.version, self._apply(got))

    def _apply(self, got: ReceivedVersion) -> float:
        """Close the gate, drain, load, flush the cache, check delivery, reopen
        (`GatedEngine._apply_version`); seconds taken. The staging memory is released either
        way: it may take the next version."""
        try:
            return self._apply_version(got.version, self._load(got), got.probe)
        finally:
            got.release()

    async def _load(self, got: ReceivedVersion) -> None:
        """On the engine loop: close the gate and drain, load the version in one weight-update
        session, flush the cache."""
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )
        from sglang.srt.utils.common import MultiprocessingSerializer

        weights = got.weights
        if got.borrowed:  # the learner's slot cannot be re-shared with SGLang's processes
            weights = [(name, t.clone()) for name, t in weights]
        payload = MultiprocessingSerializer.serialize(weights)  # shared, not copied
        await self._close_and_drain()
        version, manager = got.version, self.llm.tokenizer_manager
        steps = [
            ("begin_weight_update", BeginWeightUpdateReqInput()),
            (
                "update_weights_from_tensor",
                UpdateWeightsFromTensorReqInput(
                    serialized_named_tensors=[payload], flush_cache=False
                ),
            ),
            ("end_weight_update", EndWeightUpdateReqInput()),
        ]
        for name, request in steps:
            ok, message = await getattr(manager, name)(request, None)
            if not ok:
                raise RuntimeError(f"SGLang's {name} failed at version {version}: {message}")
        flushed = await manager.flush_cache()
        if not flushed.success:
            raise RuntimeError(f"SGLang could not flush its cache after version {version}")

    def probe_logprobs(self, ids: list[int]) -> torch.Tensor:
        """See `Engine.probe_logprobs`: SGLang's prompt log-probs of `ids` (T = 1), scored past
        the gate, so also while it is closed for a version being checked."""
        return self._call(self._prompt_logprobs(ids))

    async def _prompt_logprobs(self, ids: list[int]) -> torch.Tensor:
        out = await self.llm.async_generate(
            input_ids=list(ids),
            sampling_params={"temperature": 1.0, "max_new_tokens": 1},
            return_logprob=True,
            logprob_start_len=0,
            rid=uuid.uuid4().hex,
        )
        steps = out["meta_info"]["input_token_logprobs"][1:]  # the first token has none
        if [t for _, t, *_ in steps] != list(ids[1:]):
            raise RuntimeError("SGLang's prompt log-probs do not line up with the probe ids")
        return torch.tensor([float(lp) for lp, _, *_ in steps])

    # ---- lifecycle --------------------------------------------------------------------------
    async def close(self) -> None:
        """Shuts SGLang down: its shutdown ends every child process of this one (the server
        closes its reward workers and sandbox first)."""
        if self._closed:
            return
        self._closed = True
        self.llm.shutdown()
        self._call(_cancel_tasks())  # SGLang's own loop tasks (its output handler)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


async def _cancel_tasks() -> None:
    """Cancel every other task of the running loop and let them finish."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
