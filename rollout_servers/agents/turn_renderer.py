"""The template ids of tool and user turns appended to a conversation, rendered on their own
so that a trajectory keeps the very ids the engine sampled (token in, token out: the tool agent,
`rollout_servers.agents.tool_agent`, and the OpenAI endpoint,
`rollout_servers.agents.openai_endpoint`).

A turn's ids come from `TurnRenderer`: the template's rendering of a fixed canonical
conversation plus the new messages (with the generation prompt), minus the rendering of the
canonical conversation alone. That difference is the turn's ids for any template that renders a
conversation's prefix the same whatever follows it; the renderer checks this on every turn and
raises if a template is not prefix-stable. Ids the template puts after an assistant's end token
(Qwen's newline after `<|im_end|>`) are added after the sampled end token, so the trajectory
matches what the template would render for the whole conversation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2.exceptions import TemplateError


def render_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The chat template applied to `messages` as a flat id list (`render_prompt_ids` plus the
    `tools` and `add_generation_prompt` arguments)."""
    rendered: Any = tokenizer.apply_chat_template(
        list(messages), tools=tools or None, add_generation_prompt=add_generation_prompt
    )
    if not isinstance(rendered, list):
        rendered = rendered["input_ids"]
    return [int(t) for t in rendered]


class TemplateNotPrefixStableError(ValueError):
    """The chat template renders a conversation's prefix differently once more messages follow,
    so the ids of an appended turn cannot be rendered on their own."""


_U, _A = {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}
_CANONICAL_PREFIXES: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "system", "content": "S"}, _U, _A),
    (_U, _A),
    ({"role": "system", "content": "S"}, _U),
    (_U,),
)
"""Tried in order: ending with an assistant turn is the real context of a tool turn; the others
serve templates that render a last assistant turn specially (Qwen3 adds an empty think block)
or reject a system message."""


class TurnRenderer:
    """Template ids of tool and user turns appended to a conversation (how: the module
    docstring).

    The canonical prefix is the first of `_CANONICAL_PREFIXES` that the template renders and that
    stays a prefix of its rendering when a tool or a user message follows; setup fails with
    TemplateNotPrefixStableError when none does.
    """

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None):
        self.tokenizer, self.tools = tokenizer, tools
        self._tails: dict[int, list[int]] = {}
        problems: list[str] = []
        for prefix in _CANONICAL_PREFIXES:
            self._prefix = list(prefix)
            try:
                self._base = render_ids(tokenizer, self._prefix, tools, add_generation_prompt=False)
                self.delta_ids([{"role": "tool", "content": "T"}])
                self.delta_ids([{"role": "user", "content": "U"}])
                return
            except (TemplateError, ValueError) as e:
                problems.append(f"{[m['role'] for m in prefix]}: {e}")
        raise TemplateNotPrefixStableError(
            "the chat template cannot render an appended tool or user turn on its own (it is not "
            "prefix-stable for any canonical conversation): " + "; ".join(problems)
        )

    def delta_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Ids of `messages` appended after an ended assistant turn, with the generation prompt."""
        full = render_ids(self.tokenizer, [*self._prefix, *messages], self.tools, True)
        if full[: len(self._base)] != self._base:
            raise TemplateNotPrefixStableError(
                f"rendering {[m['role'] for m in self._prefix]} + {[m['role'] for m in messages]}"
                " changes the ids of the first part"
            )
        return full[len(self._base) :]

    def turn_ids(self, messages: list[dict[str, str]], after_id: int) -> list[int]:
        """Ids to append after a sampled turn that ended with `after_id`: whatever the template
        renders after that end token in an assistant message, then `delta_ids(messages)`."""
        if after_id not in self._tails:
            ids = render_ids(self.tokenizer, [_U, _A], self.tools, add_generation_prompt=False)
            ends = [i for i, t in enumerate(ids) if t == after_id]
            self._tails[after_id] = ids[ends[-1] + 1 :] if ends else []
        return self._tails[after_id] + self.delta_ids(messages)
