"""The agent-loop interface: one prompt in, one trajectory out, many of them at once on one
event loop.

An agent loop owns the conversation with the engine for one sample. It returns token ids
(prompt and response), the loss mask (1 only on tokens the policy sampled), the behaviour
log-prob and policy version of every sampled token, and the response text for the reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from asyncrl.wire.protocol import PromptItem
from rollout_servers.engines.base import SamplingParams


@dataclass
class AgentResult:
    prompt_ids: list[int]
    response_ids: list[int]  # everything after the prompt
    loss_mask: list[int]  # 1 where the policy sampled the token
    logprobs: list[float]  # behaviour log-prob per response token (0.0 where mask is 0)
    versions: list[int]  # policy version per response token (-1 where mask is 0)
    response_text: str  # what the reward function reads
    finish_reason: str
    metrics: dict[str, float] = field(default_factory=dict)
    reward: float | None = None
    """The episode's own reward (the `openai` loop's agent returned one, or failed: 0); None:
    the server's reward function scores response_text."""


class AgentLoop(Protocol):
    async def run(self, prompt: PromptItem, params: SamplingParams | None = None) -> AgentResult:
        """One trajectory for `prompt`; `params` overrides the loop's sampling (e.g. greedy)."""
        ...
