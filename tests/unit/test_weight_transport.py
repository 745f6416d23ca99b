"""The transport chosen for each member, the typed messages of a join and of a staged version,
and the /dev/shm slots of the shared-memory transport: made, mapped, unlinked, swept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from asyncrl.codec import ProtocolError
from asyncrl.weight_layout import Bucket, ParamSpec
from asyncrl.weight_transport import (
    ALIGN,
    SHM_DIR,
    HostSlot,
    SlotHandle,
    SyncAnswer,
    SyncPlace,
    bucket_view,
    choose_transport,
    handle_frame,
    open_slot,
    pack_message,
    read_handle_frame,
    slot_offsets,
    sweep_dead_segments,
    unpack_message,
)

GB = 2**30


def place(host="a", device="cpu", gpu="", shm=64 * GB) -> SyncPlace:
    return SyncPlace(host=host, device=device, gpu=gpu, shm_free=shm)


GPU0, GPU1 = place(device="cuda", gpu="GPU-0"), place(device="cuda", gpu="GPU-1")


@pytest.mark.parametrize(
    "learner, server, want",
    [
        (GPU0, GPU0, "cuda_ipc"),  # one GPU shared: NCCL would refuse it
        (GPU0, GPU1, "nccl"),  # two GPUs of one host
        (GPU0, place(), "shm"),  # a CPU server beside a GPU learner: host staging
        (place(), place(), "shm"),  # the CPU default
        (place(shm=10), place(), "gloo"),  # /dev/shm too small for a version
        (place(), place(host="b"), "gloo"),  # another host
        (GPU0, place(host="b", device="cuda", gpu="GPU-0"), "nccl"),  # another host's GPU
        (GPU0, place(host="b"), "gloo"),  # another host, one end on CPU
    ],
)
def test_auto_picks_the_cheapest_transport_that_joins_the_two_places(learner, server, want):
    transport, why = choose_transport(learner, server, "auto", version_bytes=GB)
    assert transport == want and why


@pytest.mark.parametrize(
    "learner, server, forced, refusal",
    [
        (GPU0, GPU1, "cuda_ipc", "not on learner rank 0's GPU"),
        (place(), place(host="b"), "shm", "not on learner rank 0's host"),
        (place(shm=10), place(), "shm", "cannot hold a version"),
        (GPU0, GPU0, "nccl", "two different GPUs"),
        (GPU0, place(), "nccl", "two different GPUs"),
    ],
)
def test_a_forced_transport_that_cannot_work_is_refused_naming_the_key(
    learner, server, forced, refusal
):
    with pytest.raises(ValueError, match="launch.weight_transport") as e:
        choose_transport(learner, server, forced, version_bytes=GB)
    assert refusal in str(e.value)
    assert choose_transport(learner, server, "gloo", GB)[0] == "gloo"  # gloo always works


def test_join_messages_round_trip_and_garbage_is_refused():
    p = place(device="cuda", gpu="GPU-7")
    assert unpack_message(pack_message(p), SyncPlace) == p
    a = SyncAnswer(join=True, transport="shm", reason="same host")
    assert unpack_message(pack_message(a), SyncAnswer) == a
    with pytest.raises(ProtocolError):
        unpack_message(pack_message(a), SyncPlace)  # the wrong message
    with pytest.raises(ProtocolError):
        unpack_message(b"\x93garbage", SyncPlace)


def test_a_slot_handle_crosses_as_a_control_frame_and_a_bad_name_is_refused():
    h = SlotHandle(kind="shm", nbytes=4096, name="asyncrl-ws-12-0-1-abcd", cuda=None)
    assert read_handle_frame(handle_frame(h)) == h
    for bad in ("../../etc/passwd", "asyncrl-ws-12-x/y", "psm_1234", ""):
        frame = handle_frame(SlotHandle(kind="shm", nbytes=1, name=bad, cuda=None))
        with pytest.raises(ProtocolError):  # checked on decode: no path outside /dev/shm
            read_handle_frame(frame)


def test_buckets_lie_aligned_in_a_slot():
    f32, i64 = torch.float32, torch.int64
    buckets = [
        Bucket(f32, (ParamSpec("a", (3,), f32),)),
        Bucket(i64, (ParamSpec("b", (5,), i64),)),
    ]
    offsets, nbytes = slot_offsets(buckets)
    assert offsets == [0, ALIGN] and nbytes == 2 * ALIGN
    slot = torch.zeros(nbytes, dtype=torch.uint8)
    bucket_view(slot, buckets[1], offsets[1]).copy_(torch.arange(5))
    assert bucket_view(slot, buckets[1], offsets[1]).tolist() == [0, 1, 2, 3, 4]
    assert bucket_view(slot, buckets[0], 0).tolist() == [0.0, 0.0, 0.0]


def segments() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith("asyncrl-ws-")}


def test_a_host_slot_is_shared_unlinked_once_mapped_and_freed_at_close():
    before = segments()
    slot = HostSlot(8192, "t")
    assert slot.name in segments()
    mapped = open_slot(slot.handle(), torch.device("cpu"))
    assert slot.name not in segments()  # unlinked: the memory lives as long as the mappings
    slot.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert mapped[:4].tolist() == [1, 2, 3, 4]
    slot.close()
    unopened = HostSlot(8192, "t")
    unopened.close()  # never mapped by a server: the learner unlinks it
    assert segments() == before


def test_a_slot_dev_shm_cannot_hold_fails_at_once_and_leaves_nothing():
    before = segments()
    with pytest.raises(OSError):
        HostSlot(1 << 50, "huge")  # ENOSPC now, not SIGBUS at the first write
    assert segments() == before


def test_segments_of_dead_learners_are_swept_and_live_ones_kept():
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    ).stdout.strip()
    stale = SHM_DIR / f"asyncrl-ws-{dead}-0-0-dead"
    live = SHM_DIR / f"asyncrl-ws-{os.getpid()}-0-0-live"
    cuda_stale = SHM_DIR / f"cuda.shm.0.{int(dead):x}.1"  # CUDA's file for an IPC exporter
    cuda_live = SHM_DIR / f"cuda.shm.0.{os.getpid():x}.1"
    torch_stale = SHM_DIR / f"torch_{dead}_12345_0"  # torch's, for a killed process
    other = SHM_DIR / f"psm_{dead}"  # not ours: left alone
    for p in (stale, live, cuda_stale, cuda_live, torch_stale, other):
        p.write_bytes(b"x")
    try:
        swept = sweep_dead_segments()
        assert {stale.name, cuda_stale.name, torch_stale.name} <= set(swept)
        assert not stale.exists() and not cuda_stale.exists() and not torch_stale.exists()
        assert live.exists() and cuda_live.exists() and other.exists()
    finally:
        for p in (stale, live, cuda_stale, cuda_live, torch_stale, other):
            p.unlink(missing_ok=True)


@pytest.mark.parametrize("forced", ["cuda_ipc", "nccl"])
def test_a_gpu_only_transport_with_a_cpu_end_is_refused_at_start(forced):
    from asyncrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"launch.weight_transport={forced}.*rollout.device"):
        load_config(None, [f"launch.weight_transport={forced}", "rollout.device=cpu"])
    load_config(None, ["launch.weight_transport=shm", "rollout.device=cpu"])  # fine
