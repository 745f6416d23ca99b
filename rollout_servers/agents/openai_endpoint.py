"""An OpenAI-compatible chat endpoint in front of a rollout server's engine that records every
completion token-exactly (docs/agents.md).

`OpenAIEndpoint` is an aiohttp web server on the rollout server's own event loop, bound to
`rollout.openai.host`:`port` (loopback unless `launch.allow_remote`). It serves
`POST /v1/chat/completions` and `GET /v1/models`. Each episode (one call of a user's agent) is
opened with a fresh random key; a request's `Authorization: Bearer KEY` selects the episode, and
a key unknown or already closed is 401. Requests a client gets wrong are 4xx in the OpenAI
error shape (`openai_protocol.RequestError`): malformed JSON 400, unknown model 404, a bad tool
schema 400, a prompt that leaves no room in the context 400, over the episode's request budget
or concurrency 429. None of them reaches the engine, and the server keeps serving.

Token in, token out. The prompt of a request that continues an earlier completion of its
episode (same tools, the same messages before it, the reply as returned, then only tool or user
messages) is that completion's prompt ids, its sampled ids and the template ids of the new
messages (`tool_agent.TurnRenderer`): the sampled text is never tokenized again. Any other
request is rendered whole by the chat template; when its episode already has completions, the
client rewrote history (or started a second conversation): that is drift, counted on the episode
(`Episode.drift`). What the agent loop does with it is `openai_agent.py`'s policy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from jinja2.exceptions import TemplateError

from asyncrl.rollout_config import OpenAIConfig
from rollout_servers.agents.openai_protocol import (
    ChatRequest,
    MessageKey,
    RequestError,
    bad,
    parse_chat_request,
    reply_key,
    reply_message,
)
from rollout_servers.agents.tool_agent import TurnRenderer, render_ids
from rollout_servers.engines.base import Engine, GenerationOutput, SamplingParams

log = logging.getLogger("asyncrl.openai_endpoint")

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
    """Ended by the model's own end or stop token: a later turn may follow its ids."""
    finish: str
    """"stop" (the model's end, a stop token or string) or "length"."""


@dataclass
class Episode:
    """One run of a user's agent: its key, its sampling defaults and what it recorded."""

    key: str
    params: SamplingParams
    completions: list[Completion] = field(default_factory=list)
    requests: int = 0
    in_flight: int = 0
    drift: int = 0
    """Requests that continued none of the episode's completions although it had some."""


class OpenAIEndpoint:
    """The endpoint (module docstring). `start` binds it; `open_episode` / `close_episode`
    bracket each agent run."""

    def __init__(self, engine: Engine, tokenizer: Any, cfg: OpenAIConfig):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.episodes: dict[str, Episode] = {}
        self.counters: Counter[str] = Counter()
        self._renderers: dict[str, TurnRenderer] = {}
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def start(self) -> str:
        """Bind and serve on the running loop; the base URL (`http://host:port/v1`)."""
        app = web.Application(client_max_size=16 * 2**20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port, backlog=1024)
        await site.start()
        port = self._runner.addresses[0][1]
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        self.base_url = f"http://{host}:{port}/v1"
        log.info("OpenAI-compatible endpoint at %s", self.base_url)
        return self.base_url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_episode(self, params: SamplingParams) -> Episode:
        episode = Episode(secrets.token_urlsafe(32), params)
        self.episodes[episode.key] = episode
        return episode

    def close_episode(self, episode: Episode) -> None:
        """Revoke the episode's key: later requests with it are 401."""
        self.episodes.pop(episode.key, None)

    # ---- HTTP ------------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._episode_of(request)
        except RequestError as e:
            return self._refuse(e)
        model = {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "asyncrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.Response:
        self.counters["requests"] += 1
        try:
            episode = self._episode_of(request)
            raw = await self._read_body(request)  # before any answer: else the client resets
            self._admit(episode)
            try:
                return web.json_response(await self._complete(episode, _json(raw)))
            finally:
                episode.in_flight -= 1
        except RequestError as e:
            return self._refuse(e)

    def _refuse(self, e: RequestError) -> web.Response:
        self.counters[f"status_{e.status}"] += 1
        return web.json_response(e.body(), status=e.status)

    def _episode_of(self, request: web.Request) -> Episode:
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        episode = self.episodes.get(key.strip()) if scheme.lower() == "bearer" else None
        if episode is None:
            raise RequestError(
                401, "no episode has this key (Authorization: Bearer KEY)", "invalid_api_key"
            )
        return episode

    def _admit(self, episode: Episode) -> None:
        """Count the request against the episode's budget and concurrency (429 when over)."""
        cfg = self.cfg
        if episode.requests >= cfg.max_requests_per_episode:
            raise RequestError(
                429, f"the episode made its {cfg.max_requests_per_episode} requests", "rate_limit"
            )
        if episode.in_flight >= cfg.max_concurrent_requests:
            raise RequestError(
                429,
                f"the episode has {cfg.max_concurrent_requests} requests in flight already",
                "rate_limit",
            )
        episode.requests += 1
        episode.in_flight += 1

    async def _read_body(self, request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge as e:
            raise RequestError(413, "the request body is too large") from e

    # ---- one request -----------------------------------------------------------------------
    async def _complete(self, episode: Episode, body: Any) -> dict[str, Any]:
        req = parse_chat_request(body, self.cfg.model_name)
        tools_key = json.dumps(req.tools, sort_keys=True)
        parent, prompt_ids = self._prompt_ids(episode, req, tools_key)
        params = self._params(episode, req, len(prompt_ids))
        outs = await asyncio.gather(
            *(self.engine.generate(prompt_ids, params) for _ in range(req.n))
        )
        choices = []
        for i, out in enumerate(outs):
            completion, message = self._record(out, prompt_ids, parent, req, tools_key, params)
            episode.completions.append(completion)
            finish = "tool_calls" if message.get("tool_calls") else out.finish_reason
            choices.append({"index": i, "message": message, "finish_reason": finish})
        sampled = sum(len(o.token_ids) for o in outs)
        return {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": 0,
            "model": self.cfg.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": sampled,
                "total_tokens": len(prompt_ids) + sampled,
            },
        }

    def _prompt_ids(
        self, episode: Episode, req: ChatRequest, tools_key: str
    ) -> tuple[Completion | None, list[int]]:
        """(the completion the request continues or None, the prompt ids); see the module
        docstring. A template that cannot render the request is 400."""
        try:
            for c in reversed(episode.completions):
                rest = _continuation(c, req, tools_key)
                if rest is not None:
                    turn = self._renderer(req.tools, tools_key).turn_ids(rest, c.token_ids[-1])
                    return c, c.prompt_ids + c.token_ids + turn
            if episode.completions:
                episode.drift += 1
            return None, render_ids(self.tokenizer, req.messages, req.tools)
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise bad(f"the chat template cannot render these messages: {e}") from e

    def _renderer(self, tools: list[dict[str, Any]] | None, tools_key: str) -> TurnRenderer:
        if tools_key not in self._renderers:
            if len(self._renderers) >= MAX_RENDERERS:
                self._renderers.pop(next(iter(self._renderers)))
            self._renderers[tools_key] = TurnRenderer(self.tokenizer, tools)
        return self._renderers[tools_key]

    def _params(self, episode: Episode, req: ChatRequest, prompt_len: int) -> SamplingParams:
        """The episode's sampling defaults with the request's overrides; the response budget
        cut to the room the context leaves (none left: 400)."""
        base = episode.params
        max_new = req.max_tokens or base.max_new_tokens
        context = self.engine.context_tokens
        if context is not None:
            if prompt_len >= context:
                raise bad(
                    f"the prompt has {prompt_len} tokens; the model's context is {context}",
                    code="context_length_exceeded",
                )
            max_new = min(max_new, context - prompt_len)
        single = [ids[0] for ids in map(self._stop_ids, req.stop) if len(ids) == 1]
        return replace(
            base,
            temperature=base.temperature if req.temperature is None else req.temperature,
            top_p=base.top_p if req.top_p is None else req.top_p,
            max_new_tokens=max_new,
            stop_token_ids=tuple(base.stop_token_ids) + tuple(single),
        )

    def _stop_ids(self, stop: str) -> list[int]:
        return list(self.tokenizer.encode(stop, add_special_tokens=False))

    def _record(
        self,
        out: GenerationOutput,
        prompt_ids: list[int],
        parent: Completion | None,
        req: ChatRequest,
        tools_key: str,
        params: SamplingParams,
    ) -> tuple[Completion, dict[str, Any]]:
        """The completion of one sampled reply and the assistant message the client gets. A
        stop string of one id is the engine's stop id (kept in the ids, not in the text); one of
        several ids is found in the text, and the ids are cut after it (the completion then
        counts as cut: no later turn continues its ids)."""
        ids, logprobs, versions = list(out.token_ids), list(out.logprobs), out.versions
        ended = out.finish_reason == "stop"
        if ended and ids and ids[-1] in params.stop_token_ids:  # a stop the engine applied
            text = self.tokenizer.decode(ids[:-1], skip_special_tokens=True)
        else:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            cut, stop = _first_stop(text, req.stop)
            if cut is not None:  # a stop string of several ids: cut after them
                keep = self._tokens_through(ids, cut + len(stop))
                ids, logprobs, versions = ids[:keep], logprobs[:keep], versions[:keep]
                text, ended = text[:cut], False
        message = reply_message(text)
        context = (tools_key, tuple(req.keys), reply_key(message))
        completion = Completion(
            prompt_ids, ids, logprobs, versions, text, parent, context, ended, out.finish_reason
        )
        return completion, message

    def _tokens_through(self, ids: list[int], chars: int) -> int:
        """The fewest leading ids whose text holds `chars` characters (a binary search: the
        text of a prefix grows with it)."""
        low, high = 1, len(ids)
        while low < high:
            mid = (low + high) // 2
            if len(self.tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= chars:
                high = mid
            else:
                low = mid + 1
        return high


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad(f"the body is not valid JSON: {e}") from e


def _first_stop(text: str, stops: list[str]) -> tuple[int | None, str]:
    """(where the first stop string starts in `text`, which one), or (None, "")."""
    found = sorted((text.find(s), s) for s in stops if s in text)
    return found[0] if found else (None, "")


def _continuation(c: Completion, req: ChatRequest, tools_key: str) -> list[dict[str, Any]] | None:
    """The messages `req` appends to completion `c` (tool and user messages only), or None
    when it does not continue `c`."""
    tools, before, reply = c.context
    k = len(before)
    if not c.ended or tools != tools_key or len(req.keys) <= k + 1:
        return None
    if tuple(req.keys[:k]) != before or req.keys[k] != reply:
        return None
    rest = req.messages[k + 1 :]
    if any(m["role"] not in ("tool", "user") for m in rest):
        return None
    return [{"role": m["role"], "content": m["content"]} for m in rest]
