"""Plain values: how a value the candidate computed crosses from the sandbox to the judge.

`plain` (run inside the sandbox, as part of the harness's source) turns a value into tagged
JSON: None, bools, ints, finite floats and strings as themselves; `{"l": [...]}` a list,
`{"t": ...}` a tuple, `{"s": ...}` a set, `{"d": [[k, v], ...]}` a dict, `{"f": "inf"}` a float
that JSON cannot hold, `{"c": [re, im]}` a complex, `{"b": hex}` bytes. Anything else (an object
whose `__eq__` says yes to everything, an int subclass) is refused or reduced to its plain
value, so the judge never runs a method the candidate wrote. `unplain` (the judge, and the
harness too, so that both continue with the same values) reads it back.

Both are plain module-level functions with no imports: the harness embeds their source
(`inspect.getsource`), so there is one definition of the format.
"""

from __future__ import annotations

from typing import Any


def plain(v: Any, depth: int = 0) -> Any:
    """`v` as tagged JSON; TypeError for a value that is not plain data, ValueError past 30
    levels of nesting."""
    if depth > 30:
        raise ValueError("nested too deep")
    if v is None:
        return None
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, str):
        return str(v)
    if isinstance(v, float):
        f = float(v)
        return f if f == f and f not in (float("inf"), float("-inf")) else {"f": repr(f)}
    if isinstance(v, complex):
        return {"c": [repr(v.real), repr(v.imag)]}
    if isinstance(v, (bytes, bytearray)):
        return {"b": bytes(v).hex()}
    if isinstance(v, list):
        return {"l": [plain(x, depth + 1) for x in v]}
    if isinstance(v, tuple):
        return {"t": [plain(x, depth + 1) for x in v]}
    if isinstance(v, (set, frozenset)):
        return {"s": [plain(x, depth + 1) for x in v]}
    if isinstance(v, dict):
        return {"d": [[plain(k, depth + 1), plain(x, depth + 1)] for k, x in v.items()]}
    if hasattr(v, "tolist"):
        return plain(v.tolist(), depth + 1)
    raise TypeError(type(v).__name__ + " is not a plain value")


def unplain(v: Any) -> Any:
    """A tagged-JSON value back to a plain Python value (ValueError when malformed)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict) and len(v) == 1:
        ((tag, x),) = v.items()
        if tag == "l":
            return [unplain(e) for e in x]
        if tag == "t":
            return tuple(unplain(e) for e in x)
        if tag == "s":
            return {unplain(e) for e in x}
        if tag == "d":
            return {unplain(k): unplain(e) for k, e in x}
        if tag == "f":
            return float(x)
        if tag == "c":
            return complex(float(x[0]), float(x[1]))
        if tag == "b":
            return bytes.fromhex(x)
    raise ValueError("not a plain value: " + repr(v)[:80])
