"""The config tree described from its own fields: what `asyncrl config`, `--dry-run` and the
unknown-key error show.

Every key of `asyncrl.config.Config` has a type, a default, a bound where one applies and a
docstring (pydantic keeps it as the field's description). These functions read them from the
models, so what the command line shows cannot drift from what the code accepts.
"""

from __future__ import annotations

import difflib
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pydantic
import yaml


@dataclass(frozen=True)
class KeyDoc:
    """One leaf key of the tree."""

    path: str  # section.key (section.sub.key for nested sections)
    type: str  # int, float, "a" | "b", list[str], ...
    default: Any  # as YAML would write it
    bound: str  # ">= 0, <= 1" or ""
    doc: str  # the field's docstring, or ""
    variants: tuple[Any, ...] = ()  # a variant key's built-in classes (pydantic models)


def walk(model: type[pydantic.BaseModel], prefix: str = "") -> Iterator[KeyDoc]:
    """Every leaf key under `model`, in declaration order (sections are descended into)."""
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        section = _section_type(field.annotation)
        if section is not None:
            yield from walk(section, path + ".")
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, pydantic.BaseModel):
            default = default.model_dump(mode="json")
        yield KeyDoc(
            path,
            type_name(field.annotation),
            pydantic.TypeAdapter(Any).dump_python(default, mode="json"),
            bound_of(field.metadata),
            " ".join((field.description or "").split()),
            _variants(field.annotation),
        )


def section_doc(model: type[pydantic.BaseModel], path: str) -> tuple[type[pydantic.BaseModel], str]:
    """The section at `path` ("replay", "rollout.vllm") and its docstring; KeyError naming the
    sections there are when there is none."""
    section = model
    for part in path.split("."):
        field = section.model_fields.get(part)
        child = _section_type(field.annotation) if field is not None else None
        if child is None:
            raise KeyError(f"no config section {path!r}; sections: {', '.join(sections_of(model))}")
        section = child
    return section, " ".join((section.__doc__ or "").split())


def sections_of(model: type[pydantic.BaseModel], prefix: str = "") -> list[str]:
    """Every section path under `model`, nested ones included."""
    out = []
    for name, field in model.model_fields.items():
        child = _section_type(field.annotation)
        if child is not None:
            out.append(prefix + name)
            out += sections_of(child, f"{prefix}{name}.")
    return out


def describe(model: type[pydantic.BaseModel], section: str | None = None, width: int = 88) -> str:
    """Each key of the tree (or of one section) with its type, default, bound and docstring:
    what `asyncrl config [SECTION]` prints."""
    root, prefix, lines = model, "", []
    if section:
        root, doc = section_doc(model, section)
        prefix = section + "."
        if doc:
            lines += textwrap.wrap(doc, width) + [""]
    for key in walk(root, prefix):
        bound = f"  ({key.bound})" if key.bound else ""
        lines.append(f"{key.path}: {key.type} = {_flow(key.default)}{bound}")
        lines += textwrap.wrap(key.doc, width, initial_indent="    ", subsequent_indent="    ")
        for variant in key.variants:
            lines += _variant_lines(key.path, variant, width)
    return "\n".join(lines) + "\n"


def _variant_lines(path: str, variant: type[pydantic.BaseModel], width: int) -> list[str]:
    """One variant of a variant key: its `type` and each field of its own, documented."""
    name = variant.model_fields["type"].get_default()
    lines = [f"  {path}.type={name}:" + ("" if len(variant.model_fields) > 1 else " no fields")]
    for key in walk(variant, f"{path}."):
        if key.path.endswith(".type"):
            continue
        bound = f"  ({key.bound})" if key.bound else ""
        lines.append(f"    {key.path}: {key.type} = {_flow(key.default)}{bound}")
        lines += textwrap.wrap(key.doc, width, initial_indent=" " * 8, subsequent_indent=" " * 8)
    return lines


def annotated_yaml(model: type[pydantic.BaseModel], values: dict[str, Any], width: int = 88) -> str:
    """`values` (a `model_dump(mode="json")` of `model`) as YAML with each key's docstring as a
    comment above it: what `--dry-run` prints. Loads back to `values`."""
    return "\n".join(_annotated(model, values, 0, width)) + "\n"


def _annotated(model, values: dict[str, Any], depth: int, width: int) -> list[str]:
    pad = "  " * depth
    lines = []
    for name, field in model.model_fields.items():
        section = _section_type(field.annotation)
        doc = " ".join((field.description or (section.__doc__ if section else "") or "").split())
        lines += textwrap.wrap(
            doc, width - len(pad), initial_indent=pad + "# ", subsequent_indent=pad + "# "
        )
        if section is not None:
            lines.append(f"{pad}{name}:")
            lines += _annotated(section, values[name], depth + 1, width)
        else:
            lines.append(f"{pad}{name}: {_flow(values[name])}")
    return lines


def format_errors(err: pydantic.ValidationError, model: type[pydantic.BaseModel]) -> str:
    """A validation error of the tree `model` as one line per key: what is wrong, the value
    given, and for an unknown key the nearest known one and the keys allowed there."""
    lines = []
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"]) or "(config)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            where = ".".join(str(x) for x in e["loc"][:-1])
            # an unknown key's parents are sections (the tree has no unions of sections)
            section = section_doc(model, where)[0] if where else model
            allowed = ", ".join(sorted(section.model_fields))
            near = nearest_key(model, where, str(e["loc"][-1]))
            guess = f"; did you mean {near}?" if near else ""
            msg = f"unknown key{guess} (allowed here: {allowed})"
        elif "input" in e and e["type"] != "missing" and e["loc"]:  # not the whole tree
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"  {key}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def nearest_key(model: type[pydantic.BaseModel], section_path: str, key: str) -> str | None:
    """The known key closest to an unknown `key` typed in section `section_path` ("" for the
    top level): a close spelling in that section first, else the same or a close name in
    another section (max_staleness typed under trainer: `replay.max_staleness`)."""
    here = model if not section_path else section_doc(model, section_path)[0]
    close = difflib.get_close_matches(key, list(here.model_fields), n=1, cutoff=0.6)
    if close:
        return f"{section_path}.{close[0]}" if section_path else close[0]
    leaves = {k.path.rsplit(".", 1)[-1]: k.path for k in walk(model)}
    close = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.8)
    return leaves[close[0]] if close else None


def type_name(annotation: Any) -> str:
    """A short human name for a field's type: int, "a" | "b", list[str], float | None."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) if not isinstance(a, str) else f'"{a}"' for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args if a is not Ellipsis)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def bound_of(metadata: list[Any]) -> str:
    """ ">= 0, <= 1" from a field's annotated-types constraints; "" when none."""
    signs = {
        "ge": ">=",
        "gt": ">",
        "le": "<=",
        "lt": "<",
        "min_length": "length >=",
        "max_length": "length <=",
    }
    parts = []
    for m in metadata:
        for attr, sign in signs.items():
            if hasattr(m, attr):  # annotated-types' Ge, Le, MinLen, ...
                parts.append(f"{sign} {getattr(m, attr)}")
    return ", ".join(parts)


def _variants(annotation: Any) -> tuple[type[pydantic.BaseModel], ...]:
    """The classes of a union of models (a variant key, `asyncrl.algorithms.variants`); ()
    for any other annotation."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return ()
    args = typing.get_args(annotation)
    if all(isinstance(a, type) and issubclass(a, pydantic.BaseModel) for a in args):
        return args
    return ()


def _section_type(annotation: Any) -> type[pydantic.BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    return None


def _flow(value: Any) -> str:
    """A value as one line of YAML ("null", "[a, b]", "{}", "'1e-05'" stays a float)."""
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10**9)
        .strip()
        .removesuffix("\n...")
        .strip()
    )
