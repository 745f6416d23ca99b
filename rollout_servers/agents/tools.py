"""Tools an agent loop can call, declared in a YAML tool config with OpenAI function schemas.

A `Tool` is one server-wide object; per-trajectory state lives under an `instance_id`: the loop
calls `create(instance_id, **create_kwargs)` before a trajectory's first call of the tool,
`execute` for each call, `calc_reward` once at the end and `release` always (also when the
trajectory fails), so a tool never leaks state between trajectories.

A tool config (`load_tool_config`) lists tools in verl's layout:

    tools:
      - class_name: calculator          # a registered name, or package.module:ClassName
        config: {max_result_digits: 100}  # keyword arguments of the class
        tool_schema:                    # the OpenAI function schema the model sees
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, ...}}

Arguments are checked against the schema's `parameters` before `execute` runs, by a light
validator (`validate_arguments`: type, properties, required, enum, items,
additionalProperties: false), so a tool only ever sees arguments of the declared shape.

Built-ins, one module each: `calculator` (arithmetic without eval,
`rollout_servers.agents.calculator_tool`), `python` (runs code in the sandbox of
`rollout_servers.sandbox`, `rollout_servers.agents.python_tool`) and `search` (BM25 over a
local corpus, `rollout_servers.agents.search_tool`).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncrl.registry import Registry


@dataclass
class ToolResponse:
    text: str
    """What the model reads as the tool message."""
    reward: float | None = None
    """Step reward of this call, if the tool gives one (summed into the `tool_reward` metric)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-call numbers, summed per trajectory as `tool_<name>_<key>`."""


class Tool(ABC):
    """One tool the model can call; state of a trajectory is keyed by its instance id."""

    def __init__(self, schema: Mapping[str, Any]):
        check_tool_schema(schema)
        self.schema: dict[str, Any] = dict(schema)

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"].get("parameters", {"type": "object"})

    def create(self, instance_id: str, **create_kwargs: Any) -> None:  # noqa: B027 (optional)
        """Set up the state of one trajectory (the row's `tools_kwargs[name].create_kwargs`)."""

    @abstractmethod
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        """Run one call; `arguments` already match the schema. A failure the model should see
        is returned as text; an exception is reported to the model as a tool error."""

    def calc_reward(self, instance_id: str) -> float | None:
        """Trajectory-level reward of this tool (added to `tool_reward`), if it gives one."""
        return None

    def release(self, instance_id: str) -> None:  # noqa: B027 (optional)
        """Drop the state of one trajectory."""

    def close(self) -> None:  # noqa: B027 (optional)
        """Release server-wide resources (a sandbox's claimed uids) at shutdown."""


# ---- schemas and arguments -------------------------------------------------------------------
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
    "null": type(None),
}


def check_tool_schema(schema: Mapping[str, Any]) -> None:
    """Raise ValueError unless `schema` is an OpenAI function schema this module can validate."""
    is_function = isinstance(schema, Mapping) and schema.get("type") == "function"
    fn = schema.get("function") if is_function else None
    if not isinstance(fn, Mapping):
        raise ValueError(f"tool schema must be {{type: function, function: {{...}}}}: {schema}")
    name = fn.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        raise ValueError(f"tool schema needs a name of letters, digits, _ or -: {name!r}")
    params = fn.get("parameters", {"type": "object"})
    if not isinstance(params, Mapping) or params.get("type") != "object":
        raise ValueError(f"tool {name!r}: parameters must be a JSON schema of type object")
    properties = params.get("properties", {})
    required = params.get("required", [])
    if not isinstance(properties, Mapping) or not isinstance(required, list):
        raise ValueError(f"tool {name!r}: properties must be a mapping and required a list")
    missing = [key for key in required if key not in properties]
    if missing:
        raise ValueError(f"tool {name!r}: required {missing} are not among the properties")
    for key, prop in properties.items():
        types = prop.get("type", []) if isinstance(prop, Mapping) else None
        types = [types] if isinstance(types, str) else types
        if types is None or any(t not in _JSON_TYPES for t in types):
            raise ValueError(f"tool {name!r}: property {key!r} has an unsupported type {prop}")


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return next((t for t, py in _JSON_TYPES.items() if isinstance(value, py)), "unknown")


def _has_type(type_name: str, value: Any) -> bool:
    if isinstance(value, bool) and type_name in ("number", "integer"):
        return False
    return isinstance(value, _JSON_TYPES[type_name])


def validate_arguments(
    schema: Mapping[str, Any], value: Any, path: str = "arguments"
) -> str | None:
    """Why `value` does not match `schema`, or None when it does (the JSON-schema subset:
    type, properties, required, enum, items, additionalProperties: false)."""
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else types
    if types and not any(_has_type(t, value) for t in types):
        return f"{path} must be {' or '.join(types)}, got {_json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path} must be one of {schema['enum']}, got {value!r}"
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                return f"{path} is missing the required property {key!r}"
        for key, item in value.items():
            if key in properties:
                error = validate_arguments(properties[key], item, f"{path}.{key}")
                if error:
                    return error
            elif schema.get("additionalProperties") is False:
                return f"{path} has an unexpected property {key!r}"
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            error = validate_arguments(schema["items"], item, f"{path}[{i}]")
            if error:
                return error
    return None


class ToolSet:
    """The tools of one server by name, with their schemas for the chat template."""

    def __init__(self, tools: Iterable[Tool]):
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI function schemas, in config order (the template's `tools` argument)."""
        return [tool.schema for tool in self.tools.values()]

    def close(self) -> None:
        """Close every tool (call once, at server shutdown)."""
        for tool in self.tools.values():
            tool.close()

    def check_call(self, name: str, arguments: Any) -> str | None:
        """Why a call cannot run (unknown tool, arguments not matching the schema), or None."""
        tool = self.tools.get(name)
        if tool is None:
            return f"unknown tool {name!r}; available tools: {sorted(self.tools)}"
        error = validate_arguments(tool.parameters, arguments)
        return f"invalid arguments for {name!r}: {error}" if error else None


# ---- the registry and the config file --------------------------------------------------------
TOOL_CLASSES: Registry[type[Tool]] = Registry("tool", "asyncrl.tools")
"""Registered tool classes (also from the `asyncrl.tools` entry points of packages)."""
TOOL_CLASSES.register("calculator", "rollout_servers.agents.calculator_tool:CalculatorTool")
TOOL_CLASSES.register("python", "rollout_servers.agents.python_tool:PythonTool")
TOOL_CLASSES.register("search", "rollout_servers.agents.search_tool:SearchTool")

register_tool = TOOL_CLASSES.register
"""`@register_tool("my_tool")` over a Tool subclass, usable as class_name."""


def load_tool_config(path: str | Path, sandbox: Any = None) -> ToolSet:
    """The tools listed in the YAML file at `path` (layout in the module docstring); a bad
    entry raises ValueError naming the entry. Tools that run model code (`needs_sandbox`) get
    `sandbox.get()`, the server's one sandbox, when `sandbox` is given."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    entries = raw.get("tools") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a top-level `tools:` list")
    tools = []
    for i, entry in enumerate(entries):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"class_name", "config", "tool_schema"}:
            raise ValueError(f"{where}: expected only keys class_name, config, tool_schema")
        if "class_name" not in entry or "tool_schema" not in entry:
            raise ValueError(f"{where}: class_name and tool_schema are required")
        cls = TOOL_CLASSES.resolve(entry["class_name"])
        if not (isinstance(cls, type) and issubclass(cls, Tool)):
            raise ValueError(f"{where}: {entry['class_name']!r} is not a Tool subclass")
        options = dict(entry.get("config") or {})
        if getattr(cls, "needs_sandbox", False) and sandbox is not None:
            if "sandbox" in options or "sandbox_config" in options:
                raise ValueError(f"{where}: the sandbox is configured in rollout.sandbox")
            options["sandbox"] = sandbox.get()
        try:
            tools.append(cls(entry["tool_schema"], **options))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from e
    return ToolSet(tools)


def truncate_middle(text: str, max_chars: int) -> str:
    """`text` if short enough, else its head and tail around a marker that says how much was
    cut (a traceback's last line, usually the useful one, survives)."""
    if len(text) <= max_chars:
        return text
    head, tail = max_chars // 2, max_chars - max_chars // 2
    return f"{text[:head]}\n...[{len(text) - max_chars} characters cut]...\n{text[-tail:]}"
