"""Check a received value against the annotation of its wire field, and the error that refuses it.

`asyncrl.wire.codec` decodes a header with MessagePack; every value in it is then checked here
against the dataclass annotation of its field before any message is built:

- the type of every value against the annotation (bool is not an int; ints within int64;
  Literals, lists, dicts, optional unions and nested structs checked item by item);
- a free-form JSON object (`codec.JsonObject`): string keys, plain JSON values, nested at most
  MAX_JSON_DEPTH deep;
- anything else raises `ProtocolError`, which receivers count and answer; they never crash.
  Error texts quote sender input only through `short_repr`.
"""

from __future__ import annotations

import dataclasses
import reprlib
import types
from typing import (
    Annotated,
    Any,
    ClassVar,
    Literal,
    NoReturn,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

MAX_JSON_DEPTH = 32


class ProtocolError(ValueError):
    """A message that cannot be decoded; the text says what is wrong with it."""


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 3, 80, 80, 6, 6


def short_repr(value: Any) -> str:
    """A bounded repr of sender input, safe to put in an error text or a log line."""
    return _REPR.repr(value)


_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """The wire fields of a message or struct class: its annotations, ClassVars left out."""
    if cls not in _HINTS:
        _HINTS[cls] = {
            k: v
            for k, v in get_type_hints(cls, include_extras=True).items()
            if get_origin(v) is not ClassVar and v is not ClassVar
        }
    return _HINTS[cls]


def check_value(value: Any, tp: Any, path: str) -> Any:
    """Validate `value` against annotation `tp`; return it converted (nested structs built)."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        raise TypeError(f"{path}: Any is not allowed in a wire schema")
    if origin is Annotated and get_args(tp)[1:] == (("json",),):
        if not isinstance(value, dict):
            raise ProtocolError(f"{path}: expected a JSON object, got {type(value).__name__}")
        return check_json(value, path, 0)
    if origin in (Union, types.UnionType):
        return _check_union(value, tp, path)
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if INT64_MIN <= value <= INT64_MAX:
                return value
            raise ProtocolError(f"{path}: {value} does not fit in int64")
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is bytes:
        if isinstance(value, bytes):
            return value
    elif origin is Literal:
        if value in args:
            return value
    elif origin is list:
        if isinstance(value, list):
            return [check_value(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            return {
                check_value(k, args[0], f"{path}.key"): check_value(
                    v, args[1], f"{path}[{short_repr(k)}]"
                )
                for k, v in value.items()
            }
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return _check_struct(value, tp, path)
    else:
        raise TypeError(f"{path}: unsupported annotation {tp!r}")
    raise ProtocolError(
        f"{path}: expected {getattr(tp, '__name__', tp)}, got {type(value).__name__}"
    )


def _check_union(value: Any, tp: Any, path: str) -> Any:
    """`value` checked against the first member of union `tp` that it matches."""
    for arg in get_args(tp):
        try:
            return check_value(value, arg, path)
        except ProtocolError:
            continue
    raise ProtocolError(f"{path}: {short_repr(value)} matches none of {tp}")


def _check_struct(value: dict, tp: Any, path: str) -> Any:
    """A nested struct of class `tp` built from map `value`, each field checked."""
    struct_hints = hints(tp)
    if set(value) != set(struct_hints):
        got = short_repr(sorted(map(str, value)))
        raise ProtocolError(f"{path}: fields {got} != {sorted(struct_hints)}")
    return tp(**{k: check_value(value[k], struct_hints[k], f"{path}.{k}") for k in struct_hints})


def check_json(value: Any, path: str, depth: int) -> Any:
    """`value` if it is plain JSON no deeper than MAX_JSON_DEPTH, else ProtocolError. The
    common case (valid) is one level-by-level pass that builds nothing; only a value that
    fails is walked again, by `_json_error`, to name where."""
    level = [value]
    while level:
        if depth > MAX_JSON_DEPTH:
            _json_error_at(value, path)
        below: list[Any] = []
        for v in level:
            if isinstance(v, list):
                below.extend(v)
            elif isinstance(v, dict):
                if not all(isinstance(k, str) for k in v):
                    _json_error_at(value, path)
                below.extend(v.values())
            elif not (v is None or isinstance(v, (bool, int, float, str))):
                _json_error_at(value, path)
        level, depth = below, depth + 1
    return value


def _json_error(value: Any, path: str, depth: int) -> None:
    """Raise ProtocolError naming the first place where `value` is not plain JSON no deeper
    than MAX_JSON_DEPTH (recursion bounded: the header's depth was checked first)."""
    if depth > MAX_JSON_DEPTH:
        raise ProtocolError(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH}")
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _json_error(v, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ProtocolError(f"{path}: JSON object keys must be strings")
        for k, v in value.items():
            _json_error(v, f"{path}.{short_repr(k)}", depth + 1)
        return
    raise ProtocolError(f"{path}: {type(value).__name__} is not a JSON value")


def _json_error_at(value: Any, path: str) -> NoReturn:
    """`_json_error` from the JSON value's top: always raises."""
    _json_error(value, path, 0)
    raise ProtocolError(f"{path}: not plain JSON")  # unreachable while both walks agree
