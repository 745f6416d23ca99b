"""The OpenAI chat-completions request and reply, as the endpoint reads and writes them (pure
functions: no engine, no socket; `openai_endpoint.py` serves them).

Read: messages (system, developer, user, assistant with optional `tool_calls`, tool), `tools`
(OpenAI function schemas, checked by `rollout_servers.agents.tools.check_tool_schema`), model,
n, temperature, top_p, max_tokens (or max_completion_tokens), stop, and stream with
`stream_options.include_usage` (`openai_stream.py`). No field is dropped without a word: a
field that would change what is sampled or what the reply holds (`logprobs`, `tool_choice`,
penalties, `logit_bias`, ...) is accepted only at the value that changes nothing (`DEFAULTS`),
a few that cannot change either are ignored (`IGNORED`), and any other field is refused. A
request that cannot be read (malformed JSON, NaN, a number out of range or too large to
convert, a lone surrogate in any string) is a `RequestError` (4xx, the OpenAI error shape),
never a server error.

Written: the assistant message of a sampled reply, its Hermes/Qwen `<tool_call>` blocks parsed
the way the tool agent parses them (`tool_agent.parse_tool_calls`) into OpenAI `tool_calls`.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

from rollout_servers.agents.tool_agent import _TOOL_CALL, ToolCall, parse_tool_calls
from rollout_servers.agents.tools import check_tool_schema

MAX_MESSAGES = 4096
MAX_N = 16
MAX_STOPS = 4
MAX_STOP_CHARS = 256
READ = frozenset(
    ("model", "messages", "tools", "n", "temperature", "top_p", "max_tokens", "stop")
    + ("max_completion_tokens", "stream", "stream_options")
)
IGNORED = frozenset(("user", "metadata", "store", "seed", "service_tier"))
"""Fields that change neither the sampled distribution nor the reply's shape, ignored (`seed`:
the engine draws from its own generator, at the same temperature)."""
DEFAULTS: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,),  # the behaviour log-probs go to the learner, not to the agent
    "top_logprobs": (0,),
    "tool_choice": ("auto",),  # the model decides; nothing forces or forbids a call
    "parallel_tool_calls": (True,),
    "presence_penalty": (0,),  # a penalty or bias would sample from another distribution
    "frequency_penalty": (0,),  # than the one the learner recomputes
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
}
"""Fields accepted only unset (null) or at these values, which change nothing; any other value
is refused (`unsupported_value`): honouring it would need sampling or a reply shape the
endpoint does not record (forced or forbidden tool calls, penalties, a JSON mode) or would
hand the agent what it does not need (log-probs)."""
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
    stream: bool = False
    """Answer with server-sent events (`openai_stream.py`)."""
    include_usage: bool = False
    """`stream_options.include_usage`: the stream ends with a usage chunk."""


def bad(message: str, code: str | None = None) -> RequestError:
    return RequestError(400, message, code=code)


def parse_json(raw: bytes) -> Any:
    """The decoded body, or 400: malformed JSON, NaN or Infinity, a number too long to read,
    nesting too deep, or a string anywhere that is not valid Unicode (a lone surrogate)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise bad(f"the body is not valid JSON: {_short(e)}") from e
    _check_strings(body)
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_strings(body: Any) -> None:
    """400 when any string (keys too) holds a lone surrogate, which no tokenizer can encode."""
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad(f"a string holds a lone surrogate: {_short(value)}") from e


def _short(value: Any) -> str:
    """A repr short enough for an error message, whatever the value's size."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**40 else "a huge integer"
    return text if len(text) <= 60 else text[:57] + "..."


def parse_chat_request(body: Any, model_name: str) -> ChatRequest:
    """The request in `body` (decoded JSON), or RequestError: 404 for another model, else 400."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_fields(body)
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
        stream=_flag(body, "stream"),
        include_usage=_stream_options(body),
    )


def _check_fields(body: dict[str, Any]) -> None:
    """400 for a field the endpoint would otherwise drop without a word (module docstring)."""
    for name, value in body.items():
        if name in READ or name in IGNORED or value is None:
            continue
        if name not in DEFAULTS:
            raise bad(
                f"the field {_short(name)} is not supported by this endpoint",
                code="unsupported_parameter",
            )
        if not any(_same(value, ok) for ok in DEFAULTS[name]):
            raise bad(
                f"{name}={_short(value)} is not supported: this endpoint samples and records "
                f"replies one way only (docs/agents.md); leave {name} unset",
                code="unsupported_value",
            )


def _same(value: Any, ok: Any) -> bool:
    """`value == ok`, with booleans and numbers kept apart (False is not 0 here)."""
    return (
        type(value) is type(ok)
        and value == ok
        or (_is_number(value) and _is_number(ok) and value == ok)
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(body, name, kind, low, high, low_open=False):
    """The field as `kind`, or 400: not a number (booleans included), NaN, a float where an
    integer is wanted, or out of range. Compared before any conversion, so an integer of 400
    digits is out of range, not an OverflowError."""
    value = body.get(name)
    if value is None:
        return None
    ok = _is_number(value)
    if ok and isinstance(value, float):
        ok = math.isfinite(value) and (kind is float or value.is_integer())
    if not ok or not (low < value if low_open else low <= value) or value > high:
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        kind_name = "an integer" if kind is int else "a number"
        raise bad(f"{name} must be {kind_name} in {bounds}: {_short(value)}")
    return kind(value)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad(f"{name} must be true or false: {_short(value)}")
    return bool(value)


def _stream_options(body: dict[str, Any]) -> bool:
    """`stream_options.include_usage`; the options only go with `stream: true`."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not _flag(body, "stream"):
        raise bad("stream_options is only allowed with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options may only hold include_usage", code="unsupported_parameter")
    return _flag(options, "include_usage")


def _stops(stop: Any) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        raise bad(f"stop must be a string or a list of at most {MAX_STOPS} strings")
    if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise bad(f"each stop sequence must be a string of 1 to {MAX_STOP_CHARS} characters")
    return stops


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be a list of function schemas")
    for schema in tools:
        try:
            check_tool_schema(schema)
        except (ValueError, AttributeError, TypeError, RecursionError) as e:
            raise bad(f"bad tool schema: {_short(e)}", code="invalid_tool_schema") from e
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


def bounded_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: Any, max_chars: int
) -> list[int]:
    """The chat template's ids of the whole request, or 400 (`context_length_exceeded`) when
    its rendered text holds more than `max_chars` characters: checked on the text before it is
    tokenized, so tool-call arguments and tool schemas count as much as contents do (a
    megabyte of them took a prepare thread a minute to tokenize). Tokenized as the template's
    own `tokenize=True` does: the text without added special tokens."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=False
    )
    if len(text) > max_chars:
        raise too_long(len(text), max_chars)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def too_long(chars: int, max_chars: int) -> RequestError:
    """400: more characters than the context's tokens could cover at the longest token."""
    return bad(
        f"the prompt holds {chars} characters: more than the model's context can take "
        f"({max_chars}: its tokens times the tokenizer's longest token)",
        code="context_length_exceeded",
    )


def first_stop(text: str, stops: list[str]) -> tuple[int | None, str]:
    """(where the first stop string starts in `text`, which one), or (None, "")."""
    found = sorted((text.find(s), s) for s in stops if s in text)
    return found[0] if found else (None, "")


def tokens_through(tokenizer: Any, ids: list[int], chars: int) -> int:
    """The fewest leading ids whose text holds `chars` characters (a binary search: the text
    of a prefix grows with it)."""
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= chars:
            high = mid
        else:
            low = mid + 1
    return high
