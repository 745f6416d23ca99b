"""Token in, token out for the OpenAI endpoint (`rollout_servers.agents.openai_endpoint`): what
a completion records, and the prompt ids of a request that continues one.

The prompt of a request that continues an earlier completion of its episode (same tools, the
same messages before it, the reply as returned, then only tool or user messages) is that
completion's prompt ids, its sampled ids and the template ids of the new messages
(`turn_renderer.TurnRenderer`): the sampled text is never tokenized again. Any other request is
rendered whole by the chat template. A reply that did not end with the model's own end id (cut
at `max_tokens`, or by a stop string of the request) is continued too: its ids are closed with
the template's end-of-turn id (context, never sampled), as the template closes the reply the
client sends back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import TemplateError

from rollout_servers.agents.openai_protocol import (
    ChatRequest,
    MessageKey,
    bad,
    bounded_prompt_ids,
    first_stop,
    reply_key,
    reply_message,
    tokens_through,
)
from rollout_servers.agents.turn_renderer import _A, _U, TurnRenderer, render_ids
from rollout_servers.engines.base import GenerationOutput, SamplingParams

MAX_RENDERERS = 64  # tool sets whose TurnRenderer is kept (a client could send endless ones)


@dataclass
class Completion:
    """One sampled reply of one request, as the engine produced it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    """The reply decoded without special tokens, cut before a stop string."""
    continues: Completion | None
    """The earlier completion whose prompt and sampled ids begin `prompt_ids`; None: rendered."""
    context: tuple[str, tuple[MessageKey, ...], MessageKey]
    """(tools, request messages, reply) keys: what a request continuing this one starts with."""
    ended: bool
    """Ended by the model's own end id (the engine's stop ids), so a later turn follows its ids
    directly; else (cut at the token limit or by a stop string of the request) a later turn
    first closes it with the template's end-of-turn id."""
    finish: str
    """"stop" (the model's end, a stop token or string) or "length" (cut at the token limit)."""


class ContinuationRenderer:
    """The prompt ids of requests (`prompt_ids`), with a `TurnRenderer` per tool set (at most
    MAX_RENDERERS) and the template's end-of-turn id; shared by the event loop and the
    endpoint's threads."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._renderers: dict[str, TurnRenderer] = {}
        self._lock = threading.Lock()  # the renderers, shared by the loop and the threads
        self._end_id: list[int | None] = []  # [the template's end-of-turn id] once looked up

    def prompt_ids(
        self, earlier: list[Completion], req: ChatRequest, tools_key: str, max_prompt_chars: int
    ) -> tuple[Completion | None, list[int]]:
        """(the completion the request continues or None, the prompt ids); see the module
        docstring. A template that cannot render the request is 400; a rendered prompt of more
        than `max_prompt_chars` characters is refused before it is tokenized."""
        try:
            end = self.template_end_id()
            for c in reversed(earlier):
                rest = continued_messages(c, req, tools_key)
                if rest is None or (not c.ended and end is None):
                    continue
                renderer = self._renderer(req.tools, tools_key)
                if c.ended:
                    turn = renderer.turn_ids(rest, c.token_ids[-1])
                else:  # a cut reply: closed as the template closes the returned message
                    assert end is not None
                    turn = [end, *renderer.turn_ids(rest, end)]
                return c, c.prompt_ids + c.token_ids + turn
            ids = bounded_prompt_ids(self.tokenizer, req.messages, req.tools, max_prompt_chars)
            return None, ids
        except (TemplateError, ValueError, TypeError, KeyError, RecursionError) as e:
            raise bad(f"the chat template cannot render these messages: {str(e)[:300]}") from e

    def _renderer(self, tools: list[dict[str, Any]] | None, tools_key: str) -> TurnRenderer:
        """The tool set's renderer; built outside the lock, which the loop may wait on."""
        with self._lock:
            renderer = self._renderers.get(tools_key)
        if renderer is None:
            renderer = TurnRenderer(self.tokenizer, tools)
            with self._lock:
                if len(self._renderers) >= MAX_RENDERERS:
                    self._renderers.pop(next(iter(self._renderers)))
                self._renderers[tools_key] = renderer
        return renderer

    def template_end_id(self) -> int | None:
        """The id that closes an assistant message in the chat template (its last special id:
        `<|im_end|>`, `<|eot_id|>`, `</s>`), or None when it renders none: then a cut reply
        cannot be continued (a request after it is drift), as when the template cannot render
        a user and an assistant message alone. Two threads may both look it up."""
        if not self._end_id:
            try:
                ids = render_ids(self.tokenizer, [_U, _A], add_generation_prompt=False)
            except (TemplateError, ValueError, TypeError, KeyError):
                ids = []
            special = set(self.tokenizer.all_special_ids)
            self._end_id[:] = [next((t for t in reversed(ids) if t in special), None)]
        return self._end_id[0]


def record_completion(
    tokenizer: Any,
    out: GenerationOutput,
    prompt_ids: list[int],
    parent: Completion | None,
    req: ChatRequest,
    tools_key: str,
    params: SamplingParams,
    own_stops: tuple[int, ...],
) -> tuple[Completion, dict[str, Any]]:
    """The completion of one sampled reply and the assistant message the client gets. A
    stop string of one id is an engine stop id (kept in the ids, not in the text); one of
    several ids is found in the text, and the ids are cut after it. Either way the reply
    did not end with the model's own end id (`Completion.ended` is False)."""
    ids, logprobs, versions = list(out.token_ids), list(out.logprobs), out.versions
    finish = out.finish_reason
    request_stops = set(params.stop_token_ids) - set(own_stops)
    ended = finish == "stop"
    if ended and ids and ids[-1] in params.stop_token_ids:  # a stop the engine applied
        text = tokenizer.decode(ids[:-1], skip_special_tokens=True)
        ended = ids[-1] not in request_stops
    else:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        cut, stop = first_stop(text, req.stop)
        if cut is not None:  # a stop string of several ids: cut after them
            keep = tokens_through(tokenizer, ids, cut + len(stop))
            ids, logprobs, versions = ids[:keep], logprobs[:keep], versions[:keep]
            text, ended, finish = text[:cut], False, "stop"
    message = reply_message(text)
    context = (tools_key, tuple(req.keys), reply_key(message))
    completion = Completion(
        prompt_ids, ids, logprobs, versions, text, parent, context, ended, finish
    )
    return completion, message


def continued_messages(
    c: Completion, req: ChatRequest, tools_key: str
) -> list[dict[str, Any]] | None:
    """The messages `req` appends to completion `c` (tool and user messages only), or None
    when it does not continue `c`."""
    tools, before, reply = c.context
    k = len(before)
    if tools != tools_key or len(req.keys) <= k + 1:
        return None
    if tuple(req.keys[:k]) != before or req.keys[k] != reply:
        return None
    rest = req.messages[k + 1 :]
    if any(m["role"] not in ("tool", "user") for m in rest):
        return None
    return [{"role": m["role"], "content": m["content"]} for m in rest]
