"""The replay's part of a checkpoint: its whole state at the checkpoint's learner version, in one
MessagePack file (`replay.msgpack`, see `asyncrl.checkpoints`; never pickle).

What it holds (`ReplayState`), and what a resumed replay does with it:
1. The ready groups (complete, not yet trained), every sample whole: they go back in the buffer
   under their own group ids and are trained after the resume, not generated again. A group's
   samples may span policy versions; its version is recomputed from them on restore.
2. The lease ledger: every prompt leased but not complete (in flight, or expired and waiting to
   be re-issued). Its work cannot be resumed (the servers that held it are gone or restarted,
   and its partial samples are not kept), so those prompts are leased again first, as fresh
   leases of the same rows (new group ids). That is the one thing generated again: work that
   was not complete at the checkpoint.
3. The data position: the rows drawn so far and the prompt source's own state, so the stream
   continues at the next row: no prompt repeated or skipped.
4. The trajectory ids remembered for deduplication: a sender resending, after the resume, a
   trajectory accepted before the checkpoint is answered `duplicate` and it is not trained twice.
5. The counters, which go on from where they stopped.
Not kept: evaluation jobs (a resumed learner submits its validation again), fleet statistics and
held requests (their senders ask again).

Encoding: a MessagePack map of plain fields; prompts as the frames of a `LeaseGrant` and each
sample as the frames of its `Trajectory` (`asyncrl.wire.codec`: arrays as raw bytes), so reading a
state back runs every check a message from a peer gets. The prompt source's position is JSON
text inside it (a random generator's state holds integers wider than MessagePack's 64 bits).

The state is taken when the learner asks (`CheckpointRequest`), after it published the version
of the weights it is saving and before it asks for the next batch, so the groups ready then are
exactly those no weights up to that version were trained on (`replay.service` refuses a request
for any other version). It is written from the replay's loop, synchronously: the learner waits
for it anyway, and the servers' messages wait the moment it takes (the state is at most the
staleness window of groups).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from asyncrl.checkpoints import IncompleteCheckpoint
from asyncrl.metrics import write_bytes_atomic
from asyncrl.wire.codec import check, decode, encode
from asyncrl.wire.protocol import LeaseGrant, PromptItem
from asyncrl.wire.samples import Trajectory
from asyncrl.wire.validation import ProtocolError
from replay.buffer import SavedGroup

FORMAT = 2  # the layout of the map below; a reader refuses any other but 1, which it upgrades
_KEYS = {
    "format",
    "version",
    "rows_drawn",
    "prompt_source",
    "reissue",
    "ready_items",
    "ready",
    "seen_ids",
    "counters",
}
_GROUP_KEYS = {"lease_version", "server_id", "latencies", "samples"}


@dataclass
class ReplayState:
    """The replay's state at one checkpoint (see the module docstring)."""

    version: int  # the learner version of the checkpoint's weights
    rows_drawn: int  # rows drawn from the prompt source so far (the next row's index)
    prompt_source: dict[str, Any]  # the source's position (`PromptSource.state`)
    reissue: list[PromptItem]  # leased, never completed: leased again first, as fresh leases
    ready: list[SavedGroup]  # complete, untrained groups with their samples, oldest lease first
    seen_ids: list[str]  # trajectory ids remembered for `duplicate` answers, oldest first
    counters: dict[str, int]  # every counter of the replay


def encode_state(state: ReplayState) -> bytes:
    """`state` as one MessagePack document."""
    doc = {
        "format": FORMAT,
        "version": state.version,
        "rows_drawn": state.rows_drawn,
        "prompt_source": json.dumps(state.prompt_source),
        "reissue": _frames(LeaseGrant(0, state.reissue)),
        "ready_items": _frames(LeaseGrant(0, [g.item for g in state.ready])),
        "ready": [
            {
                "lease_version": g.lease_version,
                "server_id": g.server_id,
                "latencies": [float(x) for x in g.latencies],
                "samples": [_frames(t) for t in g.samples],
            }
            for g in state.ready
        ],
        "seen_ids": list(state.seen_ids),
        "counters": dict(state.counters),
    }
    return msgpack.packb(doc, use_bin_type=True)


def decode_state(data: bytes) -> ReplayState:
    """What `encode_state` wrote, every field checked; ProtocolError says what is wrong."""
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # a truncated or foreign file: say so, whatever msgpack raised
        raise ProtocolError(f"not valid MessagePack ({type(e).__name__}: {e})") from None
    check(isinstance(doc, dict) and set(doc) == _KEYS, f"not a replay state (keys {sorted(_KEYS)})")
    check(doc["format"] in (1, FORMAT), f"format {doc['format']!r}, this replay reads {FORMAT}")
    if doc["format"] == 1:  # its prompts had no `failures` (`GroupFailed` came with format 2)
        for key in ("reissue", "ready_items"):
            doc[key] = _prompts_of_format_1(doc[key])
    for key in ("version", "rows_drawn"):
        check(_is_index(doc[key]), f"{key} {doc[key]!r} is not an integer >= 0")
    check(isinstance(doc["prompt_source"], str), "prompt_source is not JSON text")
    items = _unframe(doc["ready_items"], LeaseGrant).prompts
    groups = doc["ready"]
    check(isinstance(groups, list) and len(groups) == len(items), "ready groups != their items")
    seen, counters = doc["seen_ids"], doc["counters"]
    check(isinstance(seen, list) and all(isinstance(x, str) for x in seen), "bad seen_ids")
    check(
        isinstance(counters, dict) and all(type(v) is int for v in counters.values()),
        "bad counters",
    )
    return ReplayState(
        version=doc["version"],
        rows_drawn=doc["rows_drawn"],
        prompt_source=json.loads(doc["prompt_source"]),
        reissue=_unframe(doc["reissue"], LeaseGrant).prompts,
        ready=[_saved_group(item, g) for item, g in zip(items, groups, strict=True)],
        seen_ids=seen,
        counters=counters,
    )


def write_state(path: str | Path, state: ReplayState) -> None:
    """Write `state` to `path` atomically (a reader sees the old file or the whole new one)."""
    write_bytes_atomic(path, encode_state(state))


def read_state(path: str | Path) -> ReplayState:
    """The state `write_state` wrote to `path`; IncompleteCheckpoint naming the file if it is
    missing, unreadable or damaged."""
    try:
        return decode_state(Path(path).read_bytes())
    except (OSError, ValueError) as e:
        raise IncompleteCheckpoint(f"cannot resume the replay from {path}: {e}") from None


def _saved_group(item: PromptItem, g: Any) -> SavedGroup:
    check(isinstance(g, dict) and set(g) == _GROUP_KEYS, f"group {item.group_id!r}: bad fields")
    check(_is_index(g["lease_version"]) and _is_index(g["server_id"]), "bad version or server")
    latencies = g["latencies"]
    check(
        isinstance(latencies, list) and all(isinstance(x, float) for x in latencies),
        f"group {item.group_id!r}: bad latencies",
    )
    check(isinstance(g["samples"], list), f"group {item.group_id!r}: samples is not a list")
    samples = [_unframe(frames, Trajectory) for frames in g["samples"]]
    return SavedGroup(item, g["lease_version"], g["server_id"], samples, latencies)


def _prompts_of_format_1(frames: Any) -> Any:
    """A format-1 `LeaseGrant`'s frames with `failures: 0` added to each prompt (anything that
    is not such frames is left for `_unframe` to refuse)."""
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=True)
        for prompt in header["fields"]["prompts"]:
            prompt.setdefault("failures", 0)
        return [msgpack.packb(header, use_bin_type=True), *frames[1:]]
    except Exception:  # damaged: whatever it is, the checks of `_unframe` name it
        return frames


def _frames(msg: Any) -> list[bytes]:
    return [bytes(f) for f in encode(msg)]


def _unframe(frames: Any, cls: type) -> Any:
    """Decode one message kept as its frames, and check it is a `cls`."""
    check(
        isinstance(frames, list) and all(isinstance(f, bytes) for f in frames),
        f"a {cls.__name__} is not a list of frames",
    )
    msg = decode(frames)
    check(isinstance(msg, cls), f"expected a {cls.__name__}, got {type(msg).__name__}")
    return msg


def _is_index(value: Any) -> bool:
    return type(value) is int and value >= 0
