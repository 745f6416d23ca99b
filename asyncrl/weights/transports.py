"""How a version travels from learner rank 0 to one rollout server, and the staging memory of the
two transports that share it instead of sending it.

Four transports (`launch.weight_transport`, docs/gpus.md), chosen per server when it joins
(`choose_transport`), from where each end is (`SyncPlace`: its machine, device and GPU):
- `cuda_ipc`: the server shares learner rank 0's GPU. NCCL refuses two ranks on one device, so
  the learner packs each version into a device buffer of its own (`CudaSlot`) whose CUDA IPC
  handle the server opens once and reads from;
- `shm`: the server shares its host otherwise (a CPU server; a CPU learner): the same with a
  segment in /dev/shm (`HostSlot`), chosen only when /dev/shm has room for a version;
- `nccl`: GPUs on different hosts (or on one host, different GPUs): a NCCL broadcast per bucket;
- `gloo`: anything else (different hosts, a CPU end): a gloo broadcast per bucket.
`cuda_ipc` and `shm` are the staged transports: the bytes are written once into memory the
server maps, and only small control messages (header, slot handle, probe, acknowledgement) go
over a gloo group. The learner owns a slot per server epoch and writes it only after the server
has come back for the next version (the claim, `asyncrl.weights.sync`), so a version the server
is still applying is never overwritten.

Every control message here is a codec message (MessagePack, checked field by field; never
pickle): the server's place rides on its `ready` key, the learner's answer on `answer`, a slot's
handle on the control group (`handle_frame`, `read_handle_frame`).

Staging memory dies with the run: a server unlinks a /dev/shm segment as soon as it has mapped it
(the memory then lives exactly as long as the two mappings), the learner unlinks every segment
of a member it drops and at shutdown, and `asyncrl.weights.shm.sweep_dead_segments` (torch-free,
for the launchers) unlinks the segments of learner
processes that no longer exist (a SIGKILLed one): a learner runs it when its sync starts, and the
launcher once every process of a run has ended. The driver frees the GPU memory a process held
when it dies, but leaves a small file of its own in /dev/shm for every process that exported an
IPC handle, and torch one for its reference counters when its process is killed; the launcher's
sweep removes those of the processes it started. A CUDA slot is freed with its member, or kept
for the same server's next epoch when it died holding it (torch keeps a block an importer never
released).

"The same host" is the same boot id and hostname and the same /dev/shm (two containers of one
machine may each have their own), and for CUDA IPC the same IPC namespace too.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import weakref
from typing import Literal, TypeVar

import torch

from asyncrl.config.weight_transport import Need, Transport, TransportChoice, refusal
from asyncrl.weights.layout import Bucket
from asyncrl.weights.shm import (
    SEGMENT_NAME,
    SHM_DIR,
    host_id,
    identity,
    segment_name,
    shm_free_bytes,
    sweep_dead_segments,
    unlink_quietly,
)
from asyncrl.wire.codec import check, decode, encode, message, struct
from asyncrl.wire.validation import ProtocolError

ALIGN = 256
"""Byte alignment of each bucket in a slot (CUDA's, and a multiple of every element size)."""
HANDLE_FRAME = 1024
"""Bytes of the control tensor that carries a slot's handle (2 of length, then the message)."""


@message("weight_sync_place")
class SyncPlace:
    """Where one end of a weight sync runs, as it says in its join."""

    host: str  # this machine: its boot id and hostname (equal: the same kernel and /dev/shm)
    device: Literal["cpu", "cuda"]  # where its weights live
    gpu: str  # the GPU's UUID ("" on CPU): equal UUIDs are one physical device
    shm_free: int | None  # bytes free in /dev/shm (None: there is none)
    shm: str  # which /dev/shm ("device:inode"; "" when none): containers of one host differ
    ipc_ns: str  # its IPC namespace ("" when unknown): CUDA IPC needs the same one

    def validate(self) -> None:
        check(len(self.host) <= 512 and len(self.gpu) <= 128, "place fields too long")
        check(len(self.shm) <= 64 and len(self.ipc_ns) <= 64, "place fields too long")


@message("weight_sync_answer")
class SyncAnswer:
    """Learner rank 0's answer to a server epoch's join."""

    join: bool  # False: abandoned (the server fails and must restart to try again)
    transport: Transport  # how versions will reach it
    reason: str  # why that transport, or why it was abandoned

    def validate(self) -> None:
        check(len(self.reason) <= 1000, "reason too long")


@struct
class CudaIpcHandle:
    """What `UntypedStorage._share_cuda_()` returns for a slot (notes/gpu-weight-transfer.md)."""

    handle: bytes
    size: int
    offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync: bool


@message("weight_sync_slot")
class SlotHandle:
    """Where a staged version lies: a /dev/shm segment by name, or a CUDA IPC handle."""

    kind: Literal["shm", "cuda_ipc"]
    nbytes: int
    name: str  # the segment's name ("" for cuda_ipc)
    cuda: CudaIpcHandle | None  # (None for shm)

    def validate(self) -> None:
        check(self.nbytes > 0, f"slot of {self.nbytes} bytes")
        if self.kind == "shm":
            check(SEGMENT_NAME.fullmatch(self.name) is not None, "not an asyncrl segment name")
        check((self.cuda is None) == (self.kind == "shm"), "cuda handle iff kind is cuda_ipc")


def place_of(device: torch.device) -> SyncPlace:
    """This process's place with its weights on `device`."""
    gpu = ""
    if device.type == "cuda":  # (not run here: no GPU)
        gpu = str(torch.cuda.get_device_properties(device).uuid)
    kind: Literal["cpu", "cuda"] = "cuda" if device.type == "cuda" else "cpu"
    return SyncPlace(
        host=host_id(),
        device=kind,
        gpu=gpu,
        shm_free=shm_free_bytes(),
        shm=identity(str(SHM_DIR)),
        ipc_ns=identity("/proc/self/ns/ipc"),
    )


def choose_transport(
    learner: SyncPlace, server: SyncPlace, wanted: TransportChoice, version_bytes: int
) -> tuple[Transport, str]:
    """The transport for one server and why (module docstring); `wanted` is
    `launch.weight_transport`. Raises ValueError, naming that key, when the forced one cannot
    join these two places (the refusals of `asyncrl.config.weight_transport`, which the config
    check gives too)."""
    same_host = learner.host == server.host and learner.shm == server.shm != ""
    same_ipc = same_host and learner.ipc_ns == server.ipc_ns
    same_gpu = same_ipc and learner.gpu != "" and learner.gpu == server.gpu
    both_cuda = learner.device == server.device == "cuda"
    room = learner.shm_free is not None and learner.shm_free >= version_bytes
    free = "no /dev/shm" if learner.shm_free is None else f"{learner.shm_free} bytes free"
    if wanted != "auto":
        met: dict[Need, bool] = {
            "both_gpus": both_cuda,
            "same_gpu": same_gpu,
            "other_gpus": learner.gpu != server.gpu,
            "shm_room": same_host and room,
        }
        why = refusal(wanted, met)
        if why is None:
            return wanted, "launch.weight_transport names it"
        shm = f" (/dev/shm: {free}, a version: {version_bytes} bytes)" if wanted == "shm" else ""
        raise ValueError(why + shm)
    if same_gpu:
        return "cuda_ipc", "it shares learner rank 0's GPU"
    if same_host and both_cuda and learner.gpu != server.gpu:
        return "nccl", "it is on another GPU of learner rank 0's host"
    if same_host and room:
        return "shm", "it shares learner rank 0's host"
    if same_host:
        why = f"/dev/shm: {free}, a version needs {version_bytes}"
        return "gloo", f"shared memory is too small ({why})"
    if both_cuda:
        return "nccl", "it is on another host, both on GPUs"
    return "gloo", "it is on another host, not both on GPUs"


def slot_offsets(buckets: list[Bucket]) -> tuple[list[int], int]:
    """Each bucket's byte offset in a slot (aligned to `ALIGN`), and the slot's size."""
    offsets, end = [], 0
    for b in buckets:
        offsets.append(end)
        end += -(-b.numel * b.dtype.itemsize // ALIGN) * ALIGN
    return offsets, max(end, ALIGN)


def bucket_view(slot: torch.Tensor, bucket: Bucket, offset: int) -> torch.Tensor:
    """The flat tensor of `bucket` in a slot's bytes (uint8)."""
    return slot[offset : offset + bucket.numel * bucket.dtype.itemsize].view(bucket.dtype)


class HostSlot:
    """Learner side: a /dev/shm segment of its own, mapped here (module docstring)."""

    _swept = False

    def __init__(self, nbytes: int, tag: str):
        if not HostSlot._swept:
            sweep_dead_segments()
            HostSlot._swept = True
        self.name = segment_name(tag)
        self.nbytes = nbytes
        path = SHM_DIR / self.name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now, not SIGBUS at the first write
            self._map = mmap.mmap(fd, nbytes)
        except BaseException:
            path.unlink()
            raise
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self._unlink = weakref.finalize(self, unlink_quietly, path)  # also at exit, on an exception

    def handle(self) -> SlotHandle:
        return SlotHandle(kind="shm", nbytes=self.nbytes, name=self.name, cuda=None)

    def close(self) -> None:
        """Unlink the segment; this process unmaps it once no view of it is left (the tensors
        hold the mapping: closing it under a live view would fault), the server likewise."""
        self._unlink()
        del self.tensor, self._map


class CudaSlot:
    """Learner side: a device buffer of its own and its CUDA IPC handle (made once).
    (Not run here: no GPU.)"""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = nbytes
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        shared = self.tensor.untyped_storage()._share_cuda_()
        _, handle, size, offset, counter, counter_offset, event, event_sync = shared
        self._handle = CudaIpcHandle(
            handle, size, offset, counter, counter_offset, event, bool(event_sync)
        )

    def handle(self) -> SlotHandle:
        return SlotHandle(kind="cuda_ipc", nbytes=self.nbytes, name="", cuda=self._handle)

    def close(self) -> None:
        del self.tensor  # torch keeps the block until every importer has let go of it


def make_slot(
    transport: Transport, nbytes: int, device: torch.device, tag: str
) -> HostSlot | CudaSlot:
    """A learner-side slot for a staged transport (`device`: learner rank 0's)."""
    if transport == "cuda_ipc":
        return CudaSlot(nbytes, device)
    return HostSlot(nbytes, tag)


def open_slot(handle: SlotHandle, device: torch.device) -> torch.Tensor:
    """Server side: the slot's bytes (uint8) mapped into this process. A segment is unlinked at
    once (module docstring); a CUDA handle is opened on `device`, this process's own index of
    the learner's GPU (the same UUID: `choose_transport`)."""
    if handle.kind == "cuda_ipc":  # (not run here: no GPU)
        assert handle.cuda is not None and device.type == "cuda"
        torch.cuda._lazy_init()
        c = handle.cuda
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index or 0,
            c.handle,
            c.size,
            c.offset,
            c.ref_counter,
            c.ref_counter_offset,
            c.event,
            c.event_sync,
        )
        out = torch.empty(0, dtype=torch.uint8, device=device)
        return out.set_(storage, 0, (handle.nbytes,), (1,))
    path = SHM_DIR / handle.name
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < handle.nbytes:
            raise ProtocolError(f"segment {handle.name} is smaller than {handle.nbytes} bytes")
        mapped = mmap.mmap(fd, handle.nbytes)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return torch.frombuffer(mapped, dtype=torch.uint8)


HEADER = 5
"""int64 fields of a version's header (`asyncrl.weights.sync`, step 1)."""


def staged_header(header: torch.Tensor, handle: SlotHandle | None) -> torch.Tensor:
    """A staged member's header with its slot's handle after it, as one int64 tensor: the
    learner all-reduces it with the receiver's zeros (the claim), so one round trip carries
    both (None: no slot, the shutdown)."""
    frame = torch.zeros(HANDLE_FRAME, dtype=torch.uint8)
    if handle is not None:
        frame = handle_frame(handle)
    return torch.cat([header.cpu(), frame.view(torch.int64)])


def read_staged_header(got: torch.Tensor) -> tuple[list[int], SlotHandle | None]:
    """The header's fields and the slot's handle back (None when it carries none)."""
    frame = got[HEADER:].view(torch.uint8)
    handle = read_handle_frame(frame) if int(frame[0]) or int(frame[1]) else None
    return [int(x) for x in got[:HEADER]], handle


def handle_frame(handle: SlotHandle) -> torch.Tensor:
    """The slot handle as the uint8 control tensor the group broadcasts."""
    (payload,) = encode(handle)
    if len(payload) > HANDLE_FRAME - 2:
        raise ValueError(f"slot handle of {len(payload)} bytes does not fit a frame")
    frame = torch.zeros(HANDLE_FRAME, dtype=torch.uint8)
    frame[:2] = torch.tensor([len(payload) & 0xFF, len(payload) >> 8], dtype=torch.uint8)
    frame[2 : 2 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return frame


def read_handle_frame(frame: torch.Tensor) -> SlotHandle:
    """The slot handle back from its control tensor, every field checked."""
    raw = bytes(frame.cpu().numpy().tobytes())
    size = raw[0] | raw[1] << 8
    got = decode([raw[2 : 2 + size]])
    if not isinstance(got, SlotHandle):
        raise ProtocolError(f"expected a slot handle, got a {type(got).__name__}")
    return got


def pack_message(msg: SyncPlace | SyncAnswer) -> bytes:
    """A place or answer as the bytes of a store key."""
    (payload,) = encode(msg)
    return bytes(payload)


M = TypeVar("M", SyncPlace, SyncAnswer)


def unpack_message(raw: bytes, kind: type[M]) -> M:
    """A place or answer back from a store key, every field checked (`ProtocolError`)."""
    got = decode([bytes(raw)])
    if not isinstance(got, kind):
        raise ProtocolError(f"expected a {kind.__name__}, got a {type(got).__name__}")
    return got
