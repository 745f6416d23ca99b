"""The engine interface: what agent loops and the server need from an inference engine.

An `Engine` turns prompt token ids into sampled token ids with the behaviour log-probability
and policy version of every sampled token, and follows the learner's weight versions. Agent
loops only ever `await engine.generate(...)`; the server's weight-receiver thread only iterates
`engine.follow_learner(...)`, which joins the learner's weight-sync group and applies each
version as it comes. Engines: `HFEngine` (`hf.py`, transformers, in-process), `VLLMEngine`
(`vllm.py`, vLLM's async engine; its worker process joins the sync group itself, `vllm_worker.py`)
and `SGLangEngine` (`sglang.py`, SGLang's offline engine; this process receives each version and
hands it to SGLang's `update_weights_from_tensor`).

Invariants every engine keeps:
- The behaviour log-prob of a sampled token is log_softmax(logits / T)[token] (T = 1 when
  temperature is 0, i.e. greedy), taken before top-p truncation: exactly what the learner
  recomputes with one full-sequence forward.
- A weight version is applied entirely or not at all, between batches or (in-flight mode)
  between two decode steps; every token sampled after a version is applied carries the new
  version, and each output records each token's version.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the launcher checks agent-loop names through this module: no torch import
    import torch

    from asyncrl.config.weight_transport import Transport
    from asyncrl.weights.probe import DeliveryProbe

log = logging.getLogger("asyncrl.rollout")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax), with log-probs of the T = 1 softmax."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; applied after the behaviour log-prob is taken."""
    max_new_tokens: int = 16
    """Most tokens sampled; reaching it finishes with reason "length"."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra ids that end the response (the model's EOS too, unless `ignore_eos`); the stop id
    is kept."""
    ignore_eos: bool = False
    """Sample past the model's EOS (benchmarks that need exact lengths, as vLLM's option)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenerationOutput:
    token_ids: list[int]
    """Sampled ids, the stop token included when the response stopped on one."""
    logprobs: list[float]
    """Behaviour log-prob of each id in token_ids."""
    version: int
    """Policy version of the weights that sampled the first (oldest) token."""
    finish_reason: Literal["stop", "length"]
    """"stop": EOS or a stop id was sampled; "length": max_new_tokens was reached."""
    token_versions: list[int] | None = None
    """Policy version of each token when they differ (a version applied in flight); None: all
    are `version`."""

    @property
    def versions(self) -> list[int]:
        """The policy version of each token."""
        if self.token_versions is None:
            return [self.version] * len(self.token_ids)
        return list(self.token_versions)


@dataclass(frozen=True)
class SyncTarget:
    """Where an engine joins the learner's weight sync (`asyncrl.weights.group.join_sync_group`).

    A rollout server names itself (`server_id`, `epoch`) and joins its own group with learner
    rank 0, as rank 1 of 2, on the learner's store at host:port. Without `server_id` (tests and
    benches) the engine joins a plain group at host:port as `rank` of `world_size`."""

    host: str
    port: int
    rank: int
    """This server's rank in the group (learner rank 0 is rank 0); 1 with `server_id`."""
    world_size: int
    """2 with `server_id`."""
    device: torch.device
    """cuda: NCCL; cpu: gloo."""
    timeout_s: float = 3600.0
    """How long the engine waits for the learner: to join, then for each collective."""
    server_id: int | None = None
    """This server's id (its group's store prefix names it with the epoch)."""
    epoch: int = 0
    """Which start of this server this is (0 first, one more per restart): a restarted server
    joins under a new prefix, without stopping the others."""
    transport: Transport | None = None
    """Without `server_id`: the plain group's transport (`asyncrl.weights.transports`; default
    nccl on a GPU, gloo on the CPU). With it, the learner chooses at the join."""
    key: bytes | None = field(default=None, repr=False)
    """With `server_id`: this epoch's sync key (`asyncrl.wire.auth.sync_key`), which seals its
    join on the learner's store; never printed."""


@dataclass(frozen=True)
class AppliedVersion:
    version: int
    apply_s: float
    """Seconds new generation was held back to apply this version (drain mode: the wait for
    the requests in flight plus the load; in-flight mode: the copy and delivery check only)."""


class Engine(ABC):
    """Samples responses for many concurrent callers and swaps in new weights atomically."""

    responses_capped_by_context = 0
    """Requests whose response budget was cut to the room the prompt left in the model's
    context (counted in the server's stats; the first is logged): `note_context_cap`."""
    context_tokens: int | None = None
    """The most tokens (prompt plus response) the engine samples in one sequence, where it
    knows it; None: not checked."""

    def note_context_cap(self, prompt_len: int, max_new_tokens: int) -> None:
        """Count (and log the first) request whose response budget runs past the context:
        the engine ends such a response at the context ("length"), which would otherwise
        look like a response the model chose to make long."""
        context = self.context_tokens
        if context is None or prompt_len + max_new_tokens <= context:
            return
        if not self.responses_capped_by_context:
            log.warning(
                "a prompt of %d tokens leaves %d of the %d new tokens asked for in the "
                "model's context of %d: such responses end at the context (counted in stats "
                "as responses_capped_by_context; data.max_prompt_length bounds it)",
                prompt_len,
                max(0, context - prompt_len),
                max_new_tokens,
                context,
            )
        self.responses_capped_by_context += 1

    on_batch: Callable[[float, float, int, int], None] | None = None
    """Called after each busy period (from the first sequence in flight to none; both engines
    batch continuously) with (unix start, seconds, sequences admitted, version at its start)."""

    @property
    def busy_s(self) -> float:
        """Cumulative seconds spent sampling (the server reports idle time); engines override
        it with a counter they add to or a property, one that does not measure it reports 0."""
        return 0.0

    @property
    @abstractmethod
    def version(self) -> int:
        """Policy version of the weights the next batch will sample with."""

    @abstractmethod
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        """Sample one response to `prompt_ids`; concurrent calls are batched together."""

    @abstractmethod
    def follow_learner(self, target: SyncTarget) -> Iterator[AppliedVersion]:
        """Join the learner's weight sync (`target`) and apply every version it broadcasts, each
        entirely or not at all, yielding after each; returns when the learner closes the group,
        raises when the group fails (the learner dropped this server: it restarts to rejoin).
        Blocking: the server runs it in a thread of its own."""

    def weights_checksum(self) -> str | None:
        """`asyncrl.weights.layout.weights_checksum` of the live weights in the learner's naming,
        or None where the engine cannot read them back (vLLM repacks them)."""
        return None

    def probe_logprobs(self, ids: list[int]) -> torch.Tensor | None:
        """Log-probs [len(ids) - 1] of each of `ids` after the ones before it, under the live
        weights at temperature 1 (the delivery probe, `asyncrl.weights.probe`); None where the
        engine cannot score a given sequence (the probe is then not checked)."""
        return None

    async def close(self) -> None:  # noqa: B027 (optional hook; engines without resources keep it)
        """Finish queued work and release threads, processes and devices."""


class DeliveryError(RuntimeError):
    """The engine does not sample the policy the learner just sent."""


def check_delivery(engine: Engine, version: int, probe: DeliveryProbe | None, vocab: int) -> None:
    """After `version` is applied: the engine's log-probs of the probe ids must equal the
    learner's (`probe.logprobs`) within `probe.tolerance` on average."""
    if probe is None:
        return
    from asyncrl.weights.probe import probe_ids  # (torch: not at import, see above)

    mine = engine.probe_logprobs(probe_ids(vocab))
    if mine is None:
        return
    tolerance = probe.tolerance
    diff = float((mine.float().cpu() - probe.logprobs.float().cpu()).abs().mean())
    if not diff <= tolerance:  # NaN fails too
        raise DeliveryError(
            f"after applying version {version} the engine's log-probs of the delivery probe "
            f"differ from the learner's by {diff:.3g} on average > {tolerance:g}: it does not "
            "sample the policy the learner sent (an update that did not reach the weights it "
            "samples with)"
        )
