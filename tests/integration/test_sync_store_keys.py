"""A local process without the run's keys against the weight-sync store (issue 40, finding 6):
learner rank 0's TCPStore takes any connection, so before the joins were sealed such a process
read every server's place (its host's boot id among them) and, by pre-writing "abandon" answers
for a server's next epochs, made each of its restarts fail until the launcher dropped it.

Here a real `SyncFleet` hosts the store, receivers (`sync_peers.py`) join as a rollout server
does, and the attacker is a process of its own holding only the store's address: it lists and
reads every entry, pre-writes abandon answers and garbled places for epochs 0-3 of server 0,
overwrites what it finds between versions, and overwrites a restarted epoch's genuine `ready`
before the learner reads it (the server sets it again every second while it waits). Every join
still goes through and every version arrives byte for byte; nothing it read holds a place.
(`asyncrl.weights.sealed_store` says what such a process can still do: delete or overwrite entries
without pause, a denial of service, as killing the run's processes is.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from sync_peers import BUCKET_BYTES, LEARNER_KEY, SPECS, version_checksum, version_tensors

from asyncrl.metrics import JsonlWriter, read_jsonl
from asyncrl.weights.transports import place_of
from asyncrl.wire.sockets import free_port
from learner.sync_fleet import SyncFleet, SyncFleetSpec

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

ATTACKER = textwrap.dedent(
    """
    import datetime, json, sys, time
    import torch.distributed as dist
    from asyncrl.weights.transports import SyncAnswer, pack_message

    port, action = int(sys.argv[1]), sys.argv[2]
    store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    abandon = pack_message(SyncAnswer(join=False, transport="gloo", reason="forged"))
    garbage = b"\\x93not a place"
    if action == "prewrite":
        for epoch in range(4):
            store.set(f"server_0/epoch_{epoch}/answer", abandon)
            store.set(f"server_0/epoch_{epoch}/ready", garbage)
    if action == "overwrite-pending":  # once the waiting epoch 1 has set its own ready
        while store.get("server_0/epoch_1/ready") in (garbage, abandon):
            time.sleep(0.01)
        store.set("server_0/epoch_1/ready", garbage)
    keys = store.list_keys()
    values = {k: store.get(k).hex() for k in keys}
    if action == "overwrite":  # every key it can see, after the genuine writes
        for k in keys:
            if k.endswith("/answer") or k.endswith("/ready"):
                store.set(k, abandon)
    print(json.dumps(values))
    """
)


def attack(port: int, action: str) -> dict[str, bytes]:
    """Run the keyless process; every store entry it read (key -> raw value)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("ASYNCRL_")}  # no key of the run
    out = subprocess.run(
        [sys.executable, "-c", ATTACKER, str(port), action],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return {k: bytes.fromhex(v) for k, v in json.loads(out.stdout).items()}


def start_peer(port: int, epoch: int, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = ROOT / "tests" / "integration" / "sync_peers.py"
    return subprocess.Popen(
        [sys.executable, str(script), str(port), "0", str(epoch), str(out)], env=env
    )


def received(out: Path) -> dict[int, str]:
    return {r["version"]: r["checksum"] for r in read_jsonl(out) if "version" in r}


def wait_received(out: Path, versions: list[int]) -> None:
    want = {v: version_checksum(v) for v in versions}
    deadline = time.monotonic() + 30
    while received(out) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert received(out) == want, read_jsonl(out)


def test_a_keyless_process_can_neither_read_forge_nor_abandon_a_join(tmp_path):
    listed = {0: 0}
    port = free_port()
    spec = SyncFleetSpec(
        host="127.0.0.1",
        port=port,
        num_servers=1,
        device=torch.device("cpu"),
        bucket_bytes=BUCKET_BYTES,
        timeout_s=10.0,
        first_join_s=60.0,
    )
    fleet = SyncFleet(
        spec=spec,
        server_epochs=lambda: dict(listed),
        learner_key=LEARNER_KEY,
        events=JsonlWriter(tmp_path / "sync_members.jsonl"),
    )
    peers: list[subprocess.Popen] = []
    try:
        attack(port, "prewrite")  # abandon answers and garbled places, epochs 0-3
        peers.append(start_peer(port, 0, tmp_path / "epoch_0.jsonl"))
        version = 1
        assert fleet.broadcast(SPECS, iter(version_tensors(version)), version) == {0: 0}
        wait_received(tmp_path / "epoch_0.jsonl", [1])

        seen = attack(port, "overwrite")  # read everything, then overwrite every join entry
        place = place_of(torch.device("cpu"))
        joined = {k: v for k, v in seen.items() if k.startswith("server_0/epoch_0/")}
        assert {"server_0/epoch_0/ready", "server_0/epoch_0/answer"} <= set(joined)
        assert len(joined) > 2  # the group's rendezvous entries too
        for value in joined.values():  # what the learner and the server wrote
            assert place.host.encode() not in value and b"shm_free" not in value
            assert b"join" not in value and b"transport" not in value  # no readable answer
            assert b"127.0.0.1" not in value  # no rendezvous address

        peers[0].kill()  # the server dies and restarts as epoch 1, whose abandon was planted
        peers[0].wait(timeout=30)
        peers.append(start_peer(port, 1, tmp_path / "epoch_1.jsonl"))
        attack(port, "overwrite-pending")  # its genuine ready, overwritten before the join
        listed[0] = 1  # the replay lists it: the learner joins it now
        version = 2
        assert fleet.broadcast(SPECS, iter(version_tensors(version)), version) == {0: 1}
        wait_received(tmp_path / "epoch_1.jsonl", [2])
        events = [(r["event"], r["epoch"]) for r in read_jsonl(tmp_path / "sync_members.jsonl")]
        assert ("joined", 0) in events and ("joined", 1) in events
        assert not any(event == "not_joined" for event, _ in events)
    finally:
        fleet.shutdown()
        for peer in peers:
            if peer.poll() is None:
                peer.kill()
            peer.wait(timeout=30)
