"""Encode typed messages as ZeroMQ frames and decode them back, validating everything.

A message is a frozen dataclass registered with `@message("name")`. On the wire it is one
MessagePack header frame followed by one raw frame per array field:

    frame 0: msgpack {"v": WIRE_VERSION, "type": name, "fields": {...}, "arrays": [[field, dtype, shape], ...]}
    frame k: the bytes of array k (C order, little-endian dtype named in the header)

Invariants:
- Nothing is ever unpickled: the header is MessagePack with strict limits and arrays are raw bytes
  reinterpreted with `numpy.frombuffer` after their dtype and size have been checked.
- Decoding checks the header's nesting depth first (so nothing after it can recurse too deep),
  then the wire version, the message type, the exact set of fields, the type of every value
  against the dataclass annotations (ints within int64), every array's name, dtype, shape (one
  dimension: every array is a flat vector) and byte length, and last the message's own
  `validate()` (ranges and sizes). Anything else raises `ProtocolError`, which receivers count and answer;
  they never crash. Error texts quote sender input only through `short_repr`. The values' checks
  and the error live in `asyncrl.wire.validation`.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Protocol, TypeVar, get_args, get_origin

import msgpack
import numpy as np
from typing_extensions import dataclass_transform

from asyncrl.wire.validation import MAX_JSON_DEPTH, ProtocolError, check_value, hints, short_repr

WIRE_VERSION = 1


class _Message(Protocol):
    """What `message` gives a class: its wire name."""

    TYPE: ClassVar[str]


_REGISTRY: dict[str, type[_Message]] = {}


_T = TypeVar("_T")


@dataclass_transform(frozen_default=True)
def message(name: str) -> Callable[[type[_T]], type[_T]]:
    """Class decorator: make a frozen dataclass a wire message called `name`."""

    def wrap(cls: Any) -> Any:
        cls = dataclasses.dataclass(frozen=True)(cls)
        cls.TYPE = name
        if name in _REGISTRY:
            raise RuntimeError(f"message type {name!r} registered twice")
        _REGISTRY[name] = cls
        return cls

    return wrap


@dataclass_transform(frozen_default=True)
def struct(cls: type[_T]) -> type[_T]:
    """Class decorator for a nested record inside a message (no arrays allowed)."""
    return dataclasses.dataclass(frozen=True)(cls)


# Annotations for a 1-D array field carried as a raw frame, one per dtype the protocol uses:
# `ids: Int32Array` (every array of the protocol is a flat vector; other shapes are refused on
# both ends). Spelled out, not built by a function, so a type checker reads them as types.
Int32Array = Annotated[np.ndarray, ("array", np.dtype("int32").str)]
Int64Array = Annotated[np.ndarray, ("array", np.dtype("int64").str)]
Float32Array = Annotated[np.ndarray, ("array", np.dtype("float32").str)]
Float64Array = Annotated[np.ndarray, ("array", np.dtype("float64").str)]
UInt8Array = Annotated[np.ndarray, ("array", np.dtype("uint8").str)]


JsonObject = Annotated[dict, ("json",)]
"""Annotation for a free-form JSON object (a dataset row's extra_info): string keys; values
None, bool, int, float, str, lists and objects, nested at most MAX_JSON_DEPTH deep."""
MAX_HEADER_DEPTH = MAX_JSON_DEPTH + 8  # message -> fields -> list -> struct -> JsonObject ...
BYTES_PER_NODE = 4
"""A receiver's bound on a header's values (`decode`'s max_nodes): one per BYTES_PER_NODE bytes
of its size limit. Checking and holding a value costs the same whatever it weighs, and an empty
list weighs 1 byte, so a size limit alone lets a message cost ~4x what its bytes suggest (a
prompt-heavy part of evaluation prompts holds one value per ~6 bytes)."""


def check(condition: bool, reason: str) -> None:
    """Raise ProtocolError(reason) unless `condition` (for a message's `validate()`)."""
    if not condition:
        raise ProtocolError(reason)


def _array_dtype(tp: Any) -> str | None:
    if get_origin(tp) is Annotated:
        meta = get_args(tp)[1]
        if isinstance(meta, tuple) and meta and meta[0] == "array":
            return meta[1]
    return None


def encode(msg: Any) -> list[bytes | memoryview]:
    """A message -> [header, *array frames]."""
    cls = type(msg)
    if getattr(cls, "TYPE", None) not in _REGISTRY:
        raise TypeError(f"{cls.__name__} is not a registered message")
    fields: dict[str, Any] = {}
    arrays: list[list[Any]] = []
    frames: list[bytes | memoryview] = []
    for name, tp in hints(cls).items():
        value = getattr(msg, name)
        dtype = _array_dtype(tp)
        if dtype is None:
            fields[name] = _to_plain(value)
            continue
        arr = np.ascontiguousarray(value, dtype=np.dtype(dtype))
        if arr.ndim != 1:
            raise ValueError(f"{cls.TYPE}.{name}: arrays are 1-D, got shape {list(arr.shape)}")
        arrays.append([name, arr.dtype.str, list(arr.shape)])
        frames.append(arr.data.cast("B"))
    header = msgpack.packb(
        {"v": WIRE_VERSION, "type": cls.TYPE, "fields": fields, "arrays": arrays}, use_bin_type=True
    )
    return [header, *frames]


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def decode(frames: list[bytes], max_bytes: int | None = None, max_nodes: int | None = None) -> Any:
    """[header, *array frames] -> a validated message, or `ProtocolError` (also when the
    header holds more than `max_nodes` values: `count_nodes`)."""
    if not frames:
        raise ProtocolError("empty message")
    size = sum(len(f) for f in frames)
    if max_bytes is not None and size > max_bytes:
        raise ProtocolError(f"oversized message: {size} bytes > limit {max_bytes}")
    collecting = gc.isenabled()
    gc.disable()  # a header of many small containers otherwise costs ~10x in collections
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
    except Exception as e:  # any msgpack failure is the sender's fault, never ours
        reason = f"{type(e).__name__}: {str(e)[:200]}"
        raise ProtocolError(f"header is not valid MessagePack ({reason})") from None
    finally:
        if collecting:
            gc.enable()
    count_nodes(header, MAX_HEADER_DEPTH, max_nodes)
    if not isinstance(header, dict) or set(header) != {"v", "type", "fields", "arrays"}:
        raise ProtocolError("header must be a map with keys v, type, fields, arrays")
    if type(header["v"]) is not int or header["v"] != WIRE_VERSION:
        raise ProtocolError(f"wire version {short_repr(header['v'])} != {WIRE_VERSION}")
    cls = _REGISTRY.get(header["type"]) if isinstance(header["type"], str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {short_repr(header['type'])}")
    field_hints = hints(cls)
    array_names = {k for k, tp in field_hints.items() if _array_dtype(tp) is not None}
    fields, arrays = header["fields"], header["arrays"]
    if not isinstance(fields, dict) or not isinstance(arrays, list):
        raise ProtocolError(f"{cls.TYPE}: fields must be a map and arrays a list")
    expected = set(field_hints) - array_names
    if set(fields) != expected:
        missing = sorted(expected - set(fields))
        extra = short_repr(sorted(map(repr, set(fields) - expected)))
        raise ProtocolError(f"{cls.TYPE}: missing fields {missing}, unexpected fields {extra}")
    if len(arrays) != len(array_names) or len(frames) != 1 + len(array_names):
        raise ProtocolError(
            f"{cls.TYPE}: expected {len(array_names)} arrays, header lists {len(arrays)}, "
            f"{len(frames) - 1} frames sent"
        )
    values = {
        name: check_value(fields[name], field_hints[name], f"{cls.TYPE}.{name}")
        for name in expected
    }
    for spec, frame in zip(arrays, frames[1:], strict=True):
        values.update(_decode_array(cls, spec, frame, field_hints, array_names, values))
    if set(values) != set(field_hints):
        raise ProtocolError(f"{cls.TYPE}: arrays {sorted(array_names - set(values))} missing")
    msg = cls(**values)
    validate = getattr(msg, "validate", None)
    if validate is not None:
        validate()
    return msg


def count_nodes(value: Any, depth_limit: int, max_nodes: int | None = None) -> int:
    """How many values `value` holds (itself, every item, map key and map value), or
    ProtocolError when containers nest deeper than `depth_limit` or the count passes
    `max_nodes`. One pass, level by level (no recursion, no per-node objects), so it costs
    about the same per node as MessagePack's own unpacking."""
    level, depth, nodes = [value], 0, 0
    while level:
        nodes += len(level)
        if max_nodes is not None and nodes > max_nodes:
            raise ProtocolError(f"header holds more than {max_nodes} values")
        below: list[Any] = []
        for v in level:
            if isinstance(v, list):
                below.extend(v)
            elif isinstance(v, dict):
                below.extend(v)
                below.extend(v.values())
            else:
                continue
            if depth >= depth_limit:
                raise ProtocolError(f"header nested deeper than {depth_limit}")
        level, depth = below, depth + 1
    return nodes


def _decode_array(
    cls: type[_Message],
    spec: Any,
    frame: bytes,
    field_hints: dict[str, Any],
    array_names: set[str],
    seen: dict[str, Any],
) -> dict[str, np.ndarray]:
    if not (
        isinstance(spec, list)
        and len(spec) == 3
        and isinstance(spec[0], str)
        and spec[0] in array_names
    ):
        raise ProtocolError(f"{cls.TYPE}: bad array descriptor {short_repr(spec)}")
    name, dtype, shape = spec
    if name in seen:
        raise ProtocolError(f"{cls.TYPE}.{name}: array sent twice")
    want = _array_dtype(field_hints[name])
    if not isinstance(dtype, str) or dtype != want:
        raise ProtocolError(f"{cls.TYPE}.{name}: dtype {short_repr(dtype)}, expected {want!r}")
    if not (
        isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0
    ):
        raise ProtocolError(f"{cls.TYPE}.{name}: bad shape {short_repr(shape)}")
    count = shape[0]  # a Python int: no overflow, whatever the sender claims
    if count * np.dtype(want).itemsize != len(frame):
        raise ProtocolError(
            f"{cls.TYPE}.{name}: {len(frame)} bytes do not fit shape {short_repr(shape)}"
        )
    return {name: np.frombuffer(frame, dtype=np.dtype(want)).reshape(shape)}


def registered_types() -> dict[str, type]:
    """Every message type known to the codec, by wire name."""
    return dict(_REGISTRY)


__all__ = [
    "Float32Array",
    "Float64Array",
    "Int32Array",
    "Int64Array",
    "JsonObject",
    "BYTES_PER_NODE",
    "WIRE_VERSION",
    "check",
    "count_nodes",
    "decode",
    "encode",
    "message",
    "struct",
    "UInt8Array",
]
