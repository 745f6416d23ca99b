"""The weight transports (`launch.weight_transport`) and what each needs of the two ends it joins.

One table of needs (`NEEDS`, `UNMET`) serves both checks that refuse a forced transport, so a
refusal reads the same from either (each may add what it knows after it) and names the key:
- at start-up, the config check (`asyncrl.config`), which knows only what the config says (an
  end with `device=cpu` has no GPU);
- at each server's join, `asyncrl.weights.transports.choose_transport`, which knows where both
  ends are (host, /dev/shm, GPU, IPC namespace).
It lives under the config because the config imports nothing of the weight sync
(tests/unit/test_layout.py, `CORE_ORDER`), and the weight sync reads it from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

Transport = Literal["cuda_ipc", "shm", "nccl", "gloo"]
"""How a version reaches one rollout server (`asyncrl.weights.transports`)."""
TransportChoice = Literal["auto", Transport]
"""What `launch.weight_transport` may say: one transport forced for every server, or `auto`
(chosen for each server at its join)."""
STAGED: frozenset[Transport] = frozenset({"cuda_ipc", "shm"})
"""Transports whose data goes through a slot the server maps, not through a collective."""

Need = Literal["both_gpus", "same_gpu", "other_gpus", "shm_room"]
"""Something a transport needs of the two ends it joins."""
NEEDS: dict[Transport, tuple[Need, ...]] = {
    "cuda_ipc": ("both_gpus", "same_gpu"),
    "shm": ("shm_room",),
    "nccl": ("both_gpus", "other_gpus"),
    "gloo": (),
}
"""What each transport needs, in the order it is checked (gloo joins any two ends)."""
UNMET: dict[Need, str] = {
    "both_gpus": "it needs both ends on GPUs (auto: shm on one host, gloo across hosts)",
    "same_gpu": "the server is not on learner rank 0's GPU and IPC space",
    "other_gpus": "NCCL needs two GPUs (one GPU shared: cuda_ipc)",
    "shm_room": "no shared /dev/shm with the server, or it cannot hold a version",
}
"""Why a transport is refused when one of its needs is not met."""


def is_staged(transport: Transport) -> bool:
    """Whether `transport`'s data goes through a slot the server maps (`STAGED`)."""
    return transport in STAGED


def refusal(wanted: TransportChoice, met: Mapping[Need, bool]) -> str | None:
    """Why `wanted` cannot join two ends, naming `launch.weight_transport`, or None when it may.
    `met`: what is known of the ends, need by need (a need left out is not known, and refuses
    nothing). `auto` is never refused: it picks what works."""
    if wanted == "auto":
        return None
    for need in NEEDS[wanted]:
        if not met.get(need, True):
            return f"launch.weight_transport={wanted} cannot be used: {UNMET[need]}"
    return None
