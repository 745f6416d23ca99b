"""`stream=true` for the OpenAI-compatible endpoint: the finished reply as server-sent events in
the `chat.completion.chunk` shape the `openai` client (and the frameworks on it) assembles.

Engines sample a reply whole (`Engine.generate`), so the stream starts once the reply is
sampled and recorded: per choice, one chunk whose delta holds the role, the whole text and the
tool calls, then one with the finish reason; then, when `stream_options.include_usage`, a chunk
with the usage and no choices; then `data: [DONE]`. What the client assembles is the message a
non-streamed request returns, so a later request that sends it back continues the recorded
completion token-exactly, as any other.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


def reply_chunks(reply: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects of a `chat.completion` reply (module docstring)."""
    head = {k: reply[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    chunks = []
    for choice in reply["choices"]:
        message, index = choice["message"], choice["index"]
        delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        if message.get("tool_calls"):
            delta["tool_calls"] = [
                {"index": k, **call} for k, call in enumerate(message["tool_calls"])
            ]
        for part, finish in ((delta, None), ({}, choice["finish_reason"])):
            body = {"index": index, "delta": part, "finish_reason": finish}
            chunks.append(head | {"choices": [body]})
    if include_usage:
        chunks.append(head | {"choices": [], "usage": reply["usage"]})
    return chunks


async def stream_reply(
    request: web.Request, reply: dict[str, Any], include_usage: bool
) -> web.StreamResponse:
    """Send `reply` as server-sent events (module docstring)."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    for chunk in reply_chunks(reply, include_usage):
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
