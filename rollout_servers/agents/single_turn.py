"""The single-turn agent loop: render the prompt through the chat template, sample one answer."""

from __future__ import annotations

from typing import Any

from asyncrl.data.prompts import render_prompt_ids
from asyncrl.wire.protocol import PromptItem
from rollout_servers.agents.base import AgentResult
from rollout_servers.engines.base import Engine, SamplingParams


class SingleTurnAgentLoop:
    """Render the prompt through the chat template, sample one answer.

    Built with the keywords every registered loop accepts (see `registry.py`); it has no use for
    tools, interactions or limits.
    """

    def __init__(self, engine: Engine, tokenizer: Any, params: SamplingParams, **_unused: Any):
        self.engine, self.tokenizer, self.params = engine, tokenizer, params

    async def run(self, prompt: PromptItem, params: SamplingParams | None = None) -> AgentResult:
        messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
        prompt_ids = render_prompt_ids(self.tokenizer, messages)
        out = await self.engine.generate(prompt_ids, params or self.params)
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        n = len(out.token_ids)
        return AgentResult(
            prompt_ids,
            list(out.token_ids),
            [1] * n,
            list(out.logprobs),
            out.versions,
            text,
            out.finish_reason,
        )
