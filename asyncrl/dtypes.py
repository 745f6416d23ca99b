"""Dtype names as configs and the wire spell them -> `torch.dtype`, in one place.

Configs name dtypes as strings ("float32", "bfloat16", "float16"), and a weight layout sent
between processes spells them as `str(torch.float32)`, i.e. "torch.float32"; both forms mean
the same dtype. Config validation never imports this module: it keeps the names as strings, so
validating a config costs no torch import (`asyncrl.algorithms.estimators`).
"""

from __future__ import annotations

import torch


def torch_dtype(name: str) -> torch.dtype:
    """The `torch.dtype` called `name` ("bfloat16" or "torch.bfloat16"); ValueError naming
    `name` when torch has no dtype of that name."""
    found = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(found, torch.dtype):
        raise ValueError(
            f"{name!r} is not a torch dtype name (expected e.g. 'float32', 'bfloat16', "
            "'float16' or 'torch.float32')"
        )
    return found
