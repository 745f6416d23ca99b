"""An OpenAI-compatible chat endpoint in front of a rollout server's engine that records every
completion token-exactly (docs/agents.md).

`OpenAIEndpoint` is an aiohttp web server on the rollout server's own event loop, bound to
`rollout.openai.host`:`port` (loopback unless `launch.allow_remote`). It serves
`POST /v1/chat/completions` (`stream=true` as server-sent events, `openai_stream.py`) and
`GET /v1/models`. Each episode (one call of a user's agent) is opened with a fresh random key;
a request's `Authorization: Bearer KEY` selects the episode, and a key unknown or already
closed is 401. Requests a client gets wrong are 4xx in the OpenAI
error shape (`openai_protocol.RequestError`): malformed JSON 400, unknown model 404, a bad tool
schema 400, a prompt that leaves no room in the context 400, a field the endpoint does not honour
400, over the episode's request budget or concurrency 429. None of them reaches the engine, and
the server keeps serving.

Bounded work on the event loop. The loop also carries the server's heartbeats, so a request may
not hold it for long (`launch.server_timeout_s` declares a silent server dead): decoding the
body, validating it, rendering and tokenizing its prompt run in the endpoint's own threads
(`PREPARE_THREADS`; not the loop's default executor, where sync agents wait on this endpoint)
unless the body is small (`INLINE_BYTES`, a few milliseconds of tokenizing at most), and a
prompt whose rendered text (contents, tool-call arguments, tool schemas) holds more characters
than the model's context could take at the tokenizer's longest token is refused before it is
tokenized (`max_prompt_chars`; the contents alone are counted before rendering too).

One temperature. The learner recomputes every trained token's log-prob at the episode's
temperature (`rollout.temperature`), so a request asking for another `temperature` or `top_p`
is refused (400, `unsupported_value`): its behaviour log-probs would be of another softmax and
its importance ratios wrong.

Token in, token out. The prompt of a request that continues an earlier completion of its
episode is that completion's prompt ids, its sampled ids and the template ids of the new
messages: the sampled text is never tokenized again (`openai_continuation.py` says when a
request continues one). Any other request is rendered whole by the chat template; when its
episode already has completions, the client rewrote history (or started a second conversation):
that is drift, counted on the episode (`Episode.drift`). What the agent loop does with it is
`openai_agent.py`'s policy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from asyncrl.config.rollout import OpenAIConfig
from rollout_servers.agents.openai_continuation import (
    Completion,
    ContinuationRenderer,
    record_completion,
)
from rollout_servers.agents.openai_protocol import (
    ChatRequest,
    RequestError,
    bad,
    parse_chat_request,
    parse_json,
    too_long,
)
from rollout_servers.agents.openai_stream import stream_reply
from rollout_servers.engines.base import Engine, SamplingParams

log = logging.getLogger("asyncrl.openai_endpoint")

PREPARE_THREADS = 2  # threads that decode, validate and tokenize requests off the event loop
INLINE_BYTES = 16 * 2**10  # bodies this small are prepared on the loop (a thread costs more)
UNKNOWN_CONTEXT = 1 << 17  # tokens assumed for the character bound of an engine that has none


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
        self.continuations = ContinuationRenderer(tokenizer)
        self._pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="openai-prepare")
        self.max_token_chars = max(map(len, tokenizer.get_vocab()), default=1)
        """Characters of the tokenizer's longest token: no token covers more of a text."""
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
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def max_prompt_chars(self) -> int:
        """Message characters past which a prompt cannot fit the model's context, whatever
        the text: each token covers at most `max_token_chars` characters of it."""
        return (self.engine.context_tokens or UNKNOWN_CONTEXT) * self.max_token_chars

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

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.counters["requests"] += 1
        try:
            episode = self._episode_of(request)
            raw = await self._read_body(request)  # before any answer: else the client resets
            self._admit(episode)
            try:
                req, reply = await self._complete(episode, raw)
                if req.stream:
                    return await stream_reply(request, reply, req.include_usage)
                return web.json_response(reply)
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
    async def _complete(self, episode: Episode, raw: bytes) -> tuple[ChatRequest, dict[str, Any]]:
        """(the request, its `chat.completion` reply), its completions recorded."""
        earlier = list(episode.completions)
        if len(raw) <= INLINE_BYTES:
            req, tools_key, parent, prompt_ids = self._prepare(raw, earlier)
        else:
            req, tools_key, parent, prompt_ids = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._prepare, raw, earlier
            )
        if parent is None and earlier:
            episode.drift += 1
        params = self._params(episode, req, len(prompt_ids))
        outs = await asyncio.gather(
            *(self.engine.generate(prompt_ids, params) for _ in range(req.n))
        )
        choices = []
        for i, out in enumerate(outs):
            completion, message = record_completion(
                self.tokenizer,
                out,
                prompt_ids,
                parent,
                req,
                tools_key,
                params,
                episode.params.stop_token_ids,
            )
            episode.completions.append(completion)
            finish = completion.finish
            if finish == "stop" and message.get("tool_calls"):
                finish = "tool_calls"  # a reply cut at the token limit stays "length"
            choices.append({"index": i, "message": message, "finish_reason": finish})
        sampled = sum(len(o.token_ids) for o in outs)
        return req, {
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

    def _prepare(
        self, raw: bytes, earlier: list[Completion]
    ) -> tuple[ChatRequest, str, Completion | None, list[int]]:
        """(the request, its tools key, the completion it continues or None, its prompt ids),
        or RequestError; in a thread of the endpoint's pool, off the event loop (module
        docstring). A prompt too long for the context is refused before any tokenizing."""
        req = parse_chat_request(parse_json(raw), self.cfg.model_name)
        chars = sum(len(m["content"]) for m in req.messages)  # before rendering too
        if chars > self.max_prompt_chars:
            raise too_long(chars, self.max_prompt_chars)
        tools_key = json.dumps(req.tools, sort_keys=True)
        parent, prompt_ids = self.continuations.prompt_ids(
            earlier, req, tools_key, self.max_prompt_chars
        )
        return req, tools_key, parent, prompt_ids

    def _params(self, episode: Episode, req: ChatRequest, prompt_len: int) -> SamplingParams:
        """The episode's sampling parameters with the request's stops and response budget,
        cut to the room the context leaves (none left: 400). A temperature or top_p other than
        the episode's is 400: the learner recomputes log-probs at the episode's."""
        base = episode.params
        for name, asked, own in (
            ("temperature", req.temperature, base.temperature),
            ("top_p", req.top_p, base.top_p),
        ):
            if asked is not None and asked != own:
                raise bad(
                    f"{name}={asked} is not this run's: it samples and trains at {name}={own} "
                    f"(rollout.{name}; the learner recomputes every trained token's log-prob "
                    f"there), so a reply sampled at another would train with wrong importance "
                    f"ratios. Leave {name} unset or send {own}.",
                    code="unsupported_value",
                )
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
            max_new_tokens=max_new,
            stop_token_ids=tuple(base.stop_token_ids) + tuple(single),
        )

    def _stop_ids(self, stop: str) -> list[int]:
        return list(self.tokenizer.encode(stop, add_special_tokens=False))
