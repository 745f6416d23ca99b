"""One fuzz case: which messages to send, from a seed and the case's index.

A case starts from a valid message of a registered type (the replay's own requests more often
than the types it must refuse) and applies one mutation family:

    valid      as built (valid traffic keeps the replay's state moving)
    bytes      flip / set / insert / delete / truncate bytes of a frame
    frames     drop / duplicate / reorder / add / split / merge frames
    header     a header field (at any depth) of a wrong type, size or range; missing and extra
               fields; unknown types; deep nesting anywhere, `type` and `v` included
    arrays     array descriptors: non-string names, wrong dtypes, huge, negative, overflowing
               or > 64-dimensional shapes, byte lengths that do not fit
    semantic   messages that decode but mean harm (see `scenarios`)

Reproducible: case `i` of seed `s` draws from `random.Random(f"{s}/{i}")` only, so the same seed
gives the same cases wherever they do not depend on the replay's answers (a semantic case aimed
at a group the replay leased uses that group's id, which differs from run to run).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.wire import protocol as P
from asyncrl.wire import samples as S
from asyncrl.wire.codec import decode, encode, registered_types

from .examples import Context, valid_message
from .mutations import Frames, mutate_arrays, mutate_bytes, mutate_frames, mutate_header
from .scenarios import SCENARIOS

FAMILIES = {"valid": 8, "bytes": 14, "frames": 8, "header": 36, "arrays": 14, "semantic": 20}
"""Mutation family -> weight."""
ACCEPTED = [
    P.LeaseRequest,
    S.Trajectory,
    S.Trajectories,
    S.BatchRequest,
    P.VersionUpdate,
    P.StatsRequest,
    P.Heartbeat,
    P.GroupFailed,
    P.EvalSubmit,
    P.EvalPoll,
    P.CheckpointRequest,
]
"""The replay's requests: three cases in four start from one of them."""


@dataclass
class Case:
    index: int
    family: str
    description: str  # what was done, for reports
    messages: list[Frames]  # each a list of frames, sent in order (one or a few)


def _frames(msg: Any) -> Frames:
    return msg if isinstance(msg, list) else [bytes(f) for f in encode(msg)]


def generate_case(seed: int, index: int, ctx: Context) -> Case:
    """Case `index` of the campaign seeded `seed` (see the module docstring)."""
    rng = random.Random(f"{seed}/{index}")
    family = rng.choices(list(FAMILIES), list(FAMILIES.values()))[0]
    name = f"{seed}-{index}"
    if family == "semantic":
        weights = [w for w, _ in SCENARIOS.values()]
        scenario = rng.choices(list(SCENARIOS), weights)[0]
        msgs, what = SCENARIOS[scenario][1](rng, ctx, name)
        return Case(index, family, f"{scenario}: {what}", [_frames(m) for m in msgs])
    types = registered_types()
    wire_name = {cls: name for name, cls in types.items()}
    cls = rng.choice(ACCEPTED) if rng.random() < 0.75 else rng.choice(list(types.values()))
    frames = _frames(valid_message(cls, rng, ctx, name))
    what = f"valid {wire_name[cls]}"
    if family == "bytes":
        frames, what = mutate_bytes(frames, rng)
    elif family == "frames":
        frames, what = mutate_frames(frames, rng)
    elif family == "header":
        frames, what = mutate_header(frames, rng, list(types))
    elif family == "arrays":
        frames, what = mutate_arrays(frames, rng)
    return Case(index, family, f"{wire_name[cls]}: {what}", [frames])


def writes_outside(frames: Frames, cwd: Path, scratch: Path) -> bool:
    """True when the replay would write outside `scratch` on receiving `frames` (a checkpoint
    request to a path elsewhere): the fuzzer never sends those. The replay writes the file, a
    `.tmp` next to it, and makes its parent directories, so every directory the path walks
    through must be inside `scratch` or one of its (existing) ancestors."""
    if b"checkpoint_request" not in frames[0]:
        return False
    try:
        msg = decode(frames)
    except Exception:  # rejected (or the decoder fails): the replay writes nothing
        return False
    if not isinstance(msg, P.CheckpointRequest) or "\x00" in msg.path:
        return False  # a NUL byte: the OS refuses the path before anything is written
    root = scratch.parts
    current: list[str] = []  # the directory walked to, as parts after the anchor
    for part in Path(cwd, msg.path).parts[1:]:
        if part == "..":
            current = current[:-1]
        else:
            current.append(part)
        n = min(len(current), len(root) - 1)
        if current[:n] != list(root[1 : n + 1]):  # neither inside scratch nor on the way to it
            return True
    return len(current) < len(root)  # scratch itself or above it
