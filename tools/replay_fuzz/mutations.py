"""Mutations of an encoded message: its bytes, its frames, its header's fields, its arrays.

Each mutator takes the frames of a valid message (`[header, *array frames]`) and a seeded
`random.Random` and returns the mutated frames and a short description of what it did (the
description is what a crash report names, so that a reader sees the cause at a glance).

Field-wise mutations decode the MessagePack header, change it, and pack it again. Some hostile
values cannot be written by `msgpack.packb` (a list nested 1,000 deep: its packer stops at 511;
an invalid UTF-8 string; a float32 NaN; a map with a duplicate key): they are `Raw` values,
spliced into the packed header as exact bytes.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

Frames = list[bytes]


@dataclass(frozen=True)
class Raw:
    """A value packed as exactly these MessagePack bytes."""

    data: bytes
    label: str  # how descriptions name it


def deep(depth: int, kind: str = "list") -> Raw:
    """A list (or map) nested `depth` deep around one integer."""
    level = b"\x91" if kind == "list" else b"\x81\xa1k"
    return Raw(level * depth + b"\x01", f"{kind} nested {depth} deep")


def pack(obj: Any) -> bytes:
    """MessagePack bytes of `obj`, with every `Raw` inside it spliced in as is."""
    raws: list[bytes] = []

    def default(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value.data)
            return f"\x00raw-{len(raws) - 1}-fz\x00"
        raise TypeError(f"cannot pack {type(value).__name__}")

    data = msgpack.packb(obj, default=default, use_bin_type=True)
    for k, raw in enumerate(raws):
        data = data.replace(msgpack.packb(f"\x00raw-{k}-fz\x00"), raw, 1)
    return data


def describe(value: Any) -> str:
    """A short name of a (possibly huge) value."""
    if isinstance(value, Raw):
        return value.label
    if isinstance(value, (str, bytes)) and len(value) > 40:
        return f"{type(value).__name__} of {len(value):,} chars"
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"{type(value).__name__} of {len(value):,} items"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


BIG_INTS = [-1, 2**31, -(2**31) - 1, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1, 10**12]
FLOATS = [math.nan, math.inf, -math.inf, 1e39, -0.0, 5e-324, 1e308]
ODD_STRINGS = ["", "\x00", "a\x00b", "\U0010ffff" * 3, "../../..", "accepted", "\n" * 10]
RAW_ODDITIES = [
    Raw(b"\xca\x7f\xc0\x00\x00", "float32 NaN"),
    Raw(b"\xa2\xff\xfe", "str of invalid UTF-8"),
    Raw(b"\xd3" + (5).to_bytes(8, "big"), "5 packed as int64"),
    Raw(b"\x82\xa1a\x01\xa1a\x02", "map with a duplicate key"),
    Raw(b"\xd6\xff" + (1).to_bytes(4, "big"), "msgpack timestamp"),
    Raw(b"\xc7\x00\x05", "empty ext"),
    Raw(b"\xdd\xff\xff\xff\xff", "array claiming 2**32-1 items"),
    Raw(b"\xc1", "reserved byte 0xc1"),
]


def huge_string(rng: random.Random) -> str:
    size = rng.choice([1_000, 65_536, 300_000])
    return rng.choice(["x", "é", "\U0001f600", "/"]) * size


def _containers(rng: random.Random) -> Any:
    return rng.choice(
        [
            [],
            [None],
            [1, "a", None, 2.5],
            {},
            {"a": 1},
            {b"k": 1},
            {1: "int key"},
            {"": None},
            list(range(rng.choice([100, 10_000]))),
            {f"k{i}": i for i in range(rng.choice([100, 5_000]))},
        ]
    )


def hostile_value(rng: random.Random) -> Any:
    """A value of the wrong type, size, range or shape for (almost) any field."""
    kind = rng.randrange(10)
    if kind == 0:
        return rng.choice(BIG_INTS)
    if kind == 1:
        return rng.choice(FLOATS)
    if kind == 2:
        return rng.choice([None, True, False])
    if kind == 3:
        return huge_string(rng)
    if kind == 4:
        return rng.choice(ODD_STRINGS)
    if kind == 5:
        return rng.choice([b"", b"\x00\xff", b"x" * 1000])
    if kind == 6:
        return _containers(rng)
    if kind == 7:
        return deep(rng.choice([100, 600, 1000, 1019]), rng.choice(["list", "map"]))
    if kind == 8:
        return msgpack.ExtType(rng.randrange(128), b"xyz")
    return rng.choice(RAW_ODDITIES)


# ---- bytes and frames -----------------------------------------------------------------------
def mutate_bytes(frames: Frames, rng: random.Random) -> tuple[Frames, str]:
    """Flip, set, insert, delete or truncate bytes of one frame (the header, mostly)."""
    i = 0 if len(frames) == 1 or rng.random() < 0.6 else rng.randrange(len(frames))
    data = bytearray(frames[i])
    pos = rng.randrange(len(data) + 1)
    op = rng.choice(["flip", "set", "insert", "delete", "truncate", "append", "random"])
    if op == "flip" and data:
        pos = min(pos, len(data) - 1)
        data[pos] ^= 1 << rng.randrange(8)
    elif op == "set" and data:
        data[min(pos, len(data) - 1)] = rng.choice([0x00, 0xFF, 0xC1, 0xDD, 0xDF, 0x7F])
    elif op == "insert":
        data[pos:pos] = rng.randbytes(rng.randint(1, 16))
    elif op == "delete":
        del data[pos : pos + rng.randint(1, 16)]
    elif op == "truncate":
        del data[pos:]
    elif op == "append":
        data += rng.randbytes(rng.randint(1, 64))
    else:
        data = bytearray(rng.randbytes(rng.randint(0, 64)))
    out = list(frames)
    out[i] = bytes(data)
    return out, f"bytes: {op} at {pos} of frame {i}"


def mutate_frames(frames: Frames, rng: random.Random) -> tuple[Frames, str]:
    """Drop, duplicate, reorder, add, split or merge whole frames."""
    out = list(frames)
    i, j = rng.randrange(len(out)), rng.randrange(len(out))
    op = rng.choice(["drop", "dup", "swap", "reverse", "add", "empty", "split", "merge", "many"])
    if op == "drop":
        del out[i]
    elif op == "dup":
        out.insert(i, out[i])
    elif op == "swap":
        out[i], out[j] = out[j], out[i]
    elif op == "reverse":
        out.reverse()
    elif op == "add":
        out.insert(rng.randrange(len(out) + 1), rng.randbytes(rng.randint(0, 32)))
    elif op == "empty":
        out.append(b"")
    elif op == "split":
        cut = rng.randrange(len(out[i]) + 1)
        out[i : i + 1] = [out[i][:cut], out[i][cut:]]
    elif op == "merge" and len(out) > 1:
        k = min(i, len(out) - 2)
        out[k : k + 2] = [out[k] + out[k + 1]]
    elif op == "many":
        out += [b"\x00"] * rng.choice([10, 100, 1000])
    if not out:  # zmq cannot send zero frames: an empty message is one empty frame
        out = [b""]
    return out, f"frames: {op} ({i}, {j})"


# ---- header fields --------------------------------------------------------------------------
def _paths(node: Any, prefix: tuple = (), out: list | None = None) -> list[tuple]:
    """Paths to every node of a decoded header (the first 2,000), depth first."""
    out = [] if out is None else out
    out.append(prefix)
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, child in items:
        if len(out) >= 2000:
            break
        _paths(child, (*prefix, key), out)
    return out


def _get(node: Any, path: tuple) -> Any:
    for key in path:
        node = node[key]
    return node


def _name(path: tuple) -> str:
    return ".".join(str(k) for k in path) or "<header>"


def mutate_header(frames: Frames, rng: random.Random, type_names: list[str]) -> tuple[Frames, str]:
    """Replace, delete, add or rename a header field (at any depth), or change the header's
    own shape: wrong types, huge values, deep nesting, missing and extra fields, unknown types."""
    header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    if not isinstance(header, dict):
        return frames, "header: not a map already"
    op = rng.choices(
        ["replace", "top", "delete", "add", "list", "type", "whole"], [8, 6, 2, 2, 1, 2, 1]
    )[0]
    if op in ("replace", "top"):
        paths = _paths(header)[1:]
        if op == "top":
            paths = [p for p in paths if len(p) == 1 or (len(p) == 2 and p[0] == "fields")]
        path, value = rng.choice(paths), hostile_value(rng)
        _get(header, path[:-1])[path[-1]] = value
        what = f"{_name(path)} := {describe(value)}"
    elif op in ("delete", "add"):
        maps = [p for p in _paths(header) if isinstance(_get(header, p), dict)]
        path = rng.choice(maps)
        target = _get(header, path)
        if op == "delete" and target:
            key = rng.choice(list(target))
            del target[key]
            what = f"delete {_name((*path, key))}"
        else:
            key = rng.choice(["zz", "", "v", "type", "request_id", "k" * 300, b"bin-key"])
            target[key] = hostile_value(rng)
            what = f"add {_name(path)}.{key!r:.40} = {describe(target[key])}"
    elif op == "list":
        lists = [p for p in _paths(header) if isinstance(_get(header, p), list)]
        path = rng.choice(lists)
        target = _get(header, path)
        if target and rng.random() < 0.5:
            target.append(target[rng.randrange(len(target))])
            what = f"duplicate an item of {_name(path)}"
        elif target:
            del target[rng.randrange(len(target)) :]
            what = f"shorten {_name(path)}"
        else:
            target.append(None)
            what = f"put None into {_name(path)}"
    elif op == "type":
        header["type"] = rng.choice([*type_names, "no_such_type", "LEASE_REQUEST", "", "error"])
        what = f"type := {header['type']!r}"
    else:
        header = rng.choice([hostile_value(rng), {k: header[k] for k in list(header)[:3]}])
        what = f"header := {describe(header)}"
    return [pack(header), *frames[1:]], f"header: {what}"


# ---- array descriptors ----------------------------------------------------------------------
DTYPES = [
    "<f8",
    ">i4",
    "|O",
    "V8",
    "object",
    "",
    "<i4\x00",
    "<U4",
    "|b1",
    "<M8[s]",
    "<c16",
    "S3",
    "<i8",
]
SHAPES: list[Any] = [
    [-1],
    [2**63],
    [2**64 - 1],
    [2**63 - 1],
    [2**62, 4],
    [2**32, 2**32],  # its element count wraps to 0 in int64
    [2**64 - 1, 2**64 - 1],  # ... to 1
    [2**33, 2**31, 2],
    [1] * 65,
    [0] * 65,
    [1] * 64,
    [3, 0, 2**40],
    [],
    [True, True],
    [1.0],
    [[1]],
    [None],
    "3",
    [1, -1],
]


def _fitting_frame(shape: Any, dtype: Any) -> bytes | None:
    """A frame whose length fits `shape` as int64 arithmetic counts it (wrapping around), so
    that the descriptor gets past the length check; None when no small frame does."""
    if not (isinstance(shape, list) and all(type(d) is int and 0 <= d < 2**64 for d in shape)):
        return None
    count = 1
    for d in shape:
        count = (count * d) % 2**64
    try:
        itemsize = np.dtype(dtype).itemsize if isinstance(dtype, str) else 4
    except TypeError:
        itemsize = 4
    return bytes(count * itemsize) if count * itemsize <= 1 << 16 else None


def mutate_arrays(frames: Frames, rng: random.Random) -> tuple[Frames, str]:
    """A hostile array descriptor: its name, dtype or shape, or a byte length that does not
    fit it. Frames are adjusted where that lets the descriptor get further into decoding."""
    header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
        return frames, "arrays: none"
    arrays, out = header["arrays"], list(frames)
    if not arrays:
        arrays.append(["prompt_ids", "<i4", [1]])
        out.append(b"\x00" * 4)
    i = rng.randrange(len(arrays))
    spec = arrays[i] if isinstance(arrays[i], list) and len(arrays[i]) == 3 else ["x", "<i4", [0]]
    arrays[i] = spec
    op = rng.choice(["name", "name", "dtype", "shape", "shape", "shape", "bytes", "spec"])
    if op == "name":
        names = [a[0] for a in arrays if isinstance(a, list) and a]
        spec[0] = rng.choice(
            [hostile_value(rng), [spec[0]], {spec[0]: 1}, rng.choice(names), "request_id"]
        )
        what = f"name := {describe(spec[0])}"
    elif op == "dtype":
        spec[1] = rng.choice([*DTYPES, hostile_value(rng)])
        what = f"dtype := {describe(spec[1])}"
    elif op == "shape":
        shape = rng.choice(SHAPES)
        spec[2] = list(shape) if isinstance(shape, list) else shape
        frame = _fitting_frame(spec[2], spec[1])
        if frame is not None and i + 1 < len(out):
            out[i + 1] = frame
        what = f"shape := {describe(spec[2])}"
    elif op == "bytes" and i + 1 < len(out):
        out[i + 1] = out[i + 1][: -rng.randint(1, 3)] if out[i + 1] else b"\x01"
        what = "frame length off"
    else:
        arrays[i] = rng.choice([hostile_value(rng), spec[:2], [*spec, 1], spec[0]])
        what = f"descriptor := {describe(arrays[i])}"
    out[0] = pack(header)
    return out, f"arrays[{i}]: {what}"
