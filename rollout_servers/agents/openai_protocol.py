"""The OpenAI chat-completions request and reply, as the endpoint reads and writes them (pure
functions: no engine, no socket; `openai_endpoint.py` serves them).

Read: messages (system, developer, user, assistant with optional `tool_calls`, tool), `tools`
(OpenAI function schemas, checked by `rollout_servers.agents.tools.check_tool_schema`), model,
n, temperature, top_p, max_tokens (or max_completion_tokens) and stop. Every other field is ignored. A request
that cannot be read is a `RequestError` (4xx, the OpenAI error shape), never a server error.

Written: the assistant message of a sampled reply, its Hermes/Qwen `<tool_call>` blocks parsed
the way the tool agent parses them (`tool_agent.parse_tool_calls`) into OpenAI `tool_calls`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from rollout_servers.agents.tool_agent import _TOOL_CALL, ToolCall, parse_tool_calls
from rollout_servers.agents.tools import check_tool_schema

MAX_MESSAGES = 4096
MAX_N = 16
MAX_STOPS = 4
ROLES = ("system", "developer", "user", "assistant", "tool")

MessageKey = tuple[str, str, tuple[tuple[str, str], ...]]
"""(role, text, ((tool name, canonical JSON arguments), ...)): what a message says, whatever
optional fields a client adds or leaves out (ids, `null` against missing, key order)."""


class RequestError(Exception):
    """A request the endpoint refuses: an HTTP status and the OpenAI error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code=None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    """Messages as the chat template reads them (text content; tool-call arguments as dicts)."""
    keys: list[MessageKey]
    """`message_key` of each message."""
    tools: list[dict[str, Any]] | None
    n: int
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    stop: list[str]


def bad(message: str, code: str | None = None) -> RequestError:
    return RequestError(400, message, code=code)


def parse_chat_request(body: Any, model_name: str) -> ChatRequest:
    """The request in `body` (decoded JSON), or RequestError: 404 for another model, else 400."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if body.get("model") != model_name:
        raise RequestError(
            404,
            f"the model {body.get('model')!r} does not exist; this endpoint serves {model_name!r}",
            code="model_not_found",
        )
    raw = body.get("messages")
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_MESSAGES:
        raise bad(f"messages must be a list of 1 to {MAX_MESSAGES} messages")
    messages = [_template_message(m, i) for i, m in enumerate(raw)]
    return ChatRequest(
        messages=messages,
        keys=[message_key(m) for m in messages],
        tools=_tools(body.get("tools")),
        n=_number(body, "n", int, 1, MAX_N) or 1,
        temperature=_number(body, "temperature", float, 0.0, 2.0),
        top_p=_number(body, "top_p", float, 0.0, 1.0, low_open=True),
        max_tokens=_number(body, "max_tokens", int, 1, 1 << 20)
        or _number(body, "max_completion_tokens", int, 1, 1 << 20),
        stop=_stops(body.get("stop")),
    )


def _number(body, name, kind, low, high, low_open=False):
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and kind is int:
        ok = float(value).is_integer()
    if not ok or not (low < value if low_open else low <= value) or value > high:
        raise bad(f"{name} must be a number in {'(' if low_open else '['}{low}, {high}]: {value!r}")
    return kind(value)


def _stops(stop: Any) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        raise bad(f"stop must be a string or a list of at most {MAX_STOPS} strings")
    if not all(isinstance(s, str) and s for s in stops):
        raise bad("each stop sequence must be a non-empty string")
    return stops


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be a list of function schemas")
    for schema in tools:
        try:
            check_tool_schema(schema)
        except (ValueError, AttributeError, TypeError) as e:
            raise bad(f"bad tool schema: {e}", code="invalid_tool_schema") from e
    return tools or None


def _text(content: Any, i: int) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad(f"messages[{i}].content must be a string or a list of text parts")


def _template_message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise bad(f"messages[{i}] must be an object with a role among {ROLES}")
    out: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"), i)}
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and calls:
        out["tool_calls"] = [_template_call(c, i) for c in _as_list(calls, i)]
    return out


def _as_list(calls: Any, i: int) -> list[Any]:
    if not isinstance(calls, list):
        raise bad(f"messages[{i}].tool_calls must be a list")
    return calls


def _template_call(call: Any, i: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    arguments = fn.get("arguments", "{}") if isinstance(fn, dict) else None
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except (json.JSONDecodeError, RecursionError):
        parsed = None
    if not isinstance(name, str) or not isinstance(parsed, dict):
        raise bad(f"messages[{i}].tool_calls: each needs function.name and JSON object arguments")
    return {"type": "function", "function": {"name": name, "arguments": parsed}}


def message_key(m: dict[str, Any]) -> MessageKey:
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in m.get("tool_calls", ())
    )
    return m["role"], m["content"], calls


def reply_message(text: str) -> dict[str, Any]:
    """The assistant message of a sampled reply (decoded without special tokens): its valid
    `<tool_call>` blocks become `tool_calls` and leave the content (null when nothing else is
    left); malformed ones stay in the content, for the agent to see."""
    calls = [c for c in parse_tool_calls(text) if isinstance(c, ToolCall)]
    if not calls:
        return {"role": "assistant", "content": text}
    rest = _TOOL_CALL.sub(
        lambda m: "" if isinstance(parse_tool_calls(m.group(0))[0], ToolCall) else m.group(0),
        text,
    ).strip()
    return {
        "role": "assistant",
        "content": rest or None,
        "tool_calls": [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in calls
        ],
    }


def reply_key(message: dict[str, Any]) -> MessageKey:
    """`message_key` of a reply as the client will send it back."""
    return message_key(_template_message(message, 0))
