"""A rollout server's weight receiver without an engine, as a process of its own, for the
weight-sync membership tests: `python sync_peers.py PORT SERVER_ID EPOCH OUT [DIE_AT]`.

It joins the learner's weight sync as (SERVER_ID, EPOCH) exactly as `HFEngine.follow_learner`
does (`join_sync_group`, then `WeightReceiver`) and appends to OUT (JSON lines): `started`
before it joins, each version it receives with the checksum of the weights as received, and
how it ended (`closed`: the learner shut the sync down; `error`: the group failed, exit code 3).
With DIE_AT, it SIGKILLs itself in the middle of that version over a staged transport: after its
claim (the learner is writing its slot), before it reads the version.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

import asyncrl.weights.receiver as weight_receiver
from asyncrl.weights.group import join_sync_group
from asyncrl.weights.layout import ParamSpec, weights_checksum
from asyncrl.weights.receiver import WeightReceiver
from asyncrl.wire.auth import role_key, server_role, sync_key

SPECS = [
    ParamSpec("embed", (64, 8), torch.float32),  # a bucket of its own: sent uncopied
    ParamSpec("a", (16,), torch.float32),
    ParamSpec("b", (4, 4), torch.float32),
    ParamSpec("steps", (3,), torch.int64),
]
BUCKET_BYTES = 256
LEARNER_KEY = role_key(b"the weight-sync tests' run secret", "learner")
"""The learner's key of the tests' run: the `SyncFleet`'s, from which each peer's sync key is
derived (`member_key`), as the launcher derives a server's."""


def member_key(server_id: int, epoch: int) -> bytes:
    """The sync key a peer joins with (`asyncrl.wire.auth.sync_key`)."""
    return sync_key(LEARNER_KEY, server_role(server_id, epoch))


def version_tensors(version: int) -> list[torch.Tensor]:
    """The weights of `version` (different for every version, in `SPECS` order)."""
    g = torch.Generator().manual_seed(version)
    return [
        torch.randn(s.shape, generator=g).to(s.dtype)
        if s.dtype.is_floating_point
        else torch.full(s.shape, version, dtype=s.dtype)
        for s in SPECS
    ]


def version_checksum(version: int) -> str:
    return weights_checksum(zip((s.name for s in SPECS), version_tensors(version), strict=True))


def die_at(version: int) -> None:
    """SIGKILL this process once it has claimed `version` (its n-th), before it reads it."""
    read = weight_receiver.read_staged_header
    calls = []

    def reading(frame):
        calls.append(1)
        if len(calls) == version:
            os.kill(os.getpid(), signal.SIGKILL)
        return read(frame)

    weight_receiver.read_staged_header = reading  # type: ignore[assignment]


def main(port: int, server_id: int, epoch: int, out: Path) -> int:
    torch.set_num_threads(1)

    def write(record: dict) -> None:
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    write({"event": "started", "epoch": epoch})
    try:
        cpu, key = torch.device("cpu"), member_key(server_id, epoch)
        group = join_sync_group("127.0.0.1", port, 1, 2, cpu, 60.0, server_id, epoch, key=key)
        receiver = WeightReceiver(group, SPECS)
        while (got := receiver.receive()) is not None:
            write({"version": got.version, "checksum": weights_checksum(got.weights)})
            got.release()
    except Exception as e:  # the test reads how it ended
        write({"event": "error", "error": repr(e)[:300]})
        return 3
    write({"event": "closed"})
    return 0


if __name__ == "__main__":
    port, server_id, epoch, out = sys.argv[1:5]
    if len(sys.argv) > 5:
        die_at(int(sys.argv[5]))
    sys.exit(main(int(port), int(server_id), int(epoch), Path(out)))
