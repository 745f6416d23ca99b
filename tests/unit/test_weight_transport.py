"""The transport chosen for each member, the typed messages of a join and of a staged version,
and the /dev/shm slots of the shared-memory transport: made, mapped, unlinked, swept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from asyncrl.weights.layout import Bucket, ParamSpec
from asyncrl.weights.shm import SHM_DIR, sweep_dead_segments
from asyncrl.weights.transports import (
    ALIGN,
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
    unpack_message,
)
from asyncrl.wire.validation import ProtocolError

GB = 2**30


def place(host="a", device="cpu", gpu="", shm=64 * GB, shm_id="1:2", ipc="3:4") -> SyncPlace:
    return SyncPlace(host=host, device=device, gpu=gpu, shm_free=shm, shm=shm_id, ipc_ns=ipc)


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
        (place(), place(shm_id="9:9"), "gloo"),  # one machine, two containers' /dev/shm
        (GPU0, place(device="cuda", gpu="GPU-0", ipc="8:8"), "shm"),  # one GPU, no shared IPC
    ],
)
def test_auto_picks_the_cheapest_transport_that_joins_the_two_places(learner, server, want):
    transport, why = choose_transport(learner, server, "auto", version_bytes=GB)
    assert transport == want and why


@pytest.mark.parametrize(
    "learner, server, forced, refusal",
    [
        (GPU0, GPU1, "cuda_ipc", "not on learner rank 0's GPU"),
        (place(), place(host="b"), "shm", "no shared /dev/shm"),
        (place(shm=10), place(), "shm", "cannot hold a version"),
        (GPU0, GPU0, "nccl", "needs two GPUs"),
        (GPU0, place(), "nccl", "needs both ends on GPUs"),
        (GPU0, place(), "cuda_ipc", "needs both ends on GPUs"),
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
    h = SlotHandle(kind="shm", nbytes=4096, name="asyncrl-ws-12-4026531836-0-1-ab", cuda=None)
    assert read_handle_frame(handle_frame(h)) == h
    for bad in ("../../etc/passwd", "asyncrl-ws-12-4-x/y", "asyncrl-ws-12-x", "psm_1234", ""):
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


def test_the_sweep_removes_only_what_dead_processes_of_ours_left():
    """Segments of a dead learner of this pid namespace go, a live one's stay, another
    namespace's stay (its pids are not ours); CUDA's and torch's files go only for a process
    the caller started; a hostile name (a pid no kernel has) neither crashes the sweep nor
    goes."""
    from asyncrl.weights.shm import _pid_ns

    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    dead, ns, me = int(out.stdout), _pid_ns(), os.getpid()
    unstarted = dead + 1 if dead + 1 != me else dead + 2
    files = {
        "stale": f"asyncrl-ws-{dead}-{ns}-0-0-x",
        "live": f"asyncrl-ws-{me}-{ns}-0-0-x",
        "other_ns": f"asyncrl-ws-{dead}-1{ns}-0-0-x",
        "cuda_started": f"cuda.shm.0.{dead:x}.1",
        "torch_started": f"torch_{dead}_12345_0",
        "torch_not_started": f"torch_{unstarted}_1_0",
        "hostile": "torch_4294967297_1_1",
        "not_ours": f"psm_{dead}",
    }
    for name in files.values():
        (SHM_DIR / name).write_bytes(b"x")
    try:
        swept = set(sweep_dead_segments(started=[dead]))
        gone = {"stale", "cuda_started", "torch_started"}
        assert swept == {files[k] for k in gone}
        for key, name in files.items():
            assert (SHM_DIR / name).exists() == (key not in gone), key
    finally:
        for name in files.values():
            (SHM_DIR / name).unlink(missing_ok=True)


@pytest.mark.parametrize("forced", ["cuda_ipc", "nccl"])
def test_a_gpu_only_transport_with_a_cpu_end_is_refused_at_start(forced):
    from asyncrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"launch.weight_transport={forced}.*rollout.device"):
        load_config(None, [f"launch.weight_transport={forced}", "rollout.device=cpu"])
    load_config(None, ["launch.weight_transport=shm", "rollout.device=cpu"])  # fine
