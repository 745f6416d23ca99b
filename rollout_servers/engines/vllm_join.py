"""How the vLLM engine tells vLLM's worker to join the learner's weight sync: one typed message.

The engine (`vllm.VLLMEngine.follow_learner`) builds a `JoinWeightSync` (`join_message`): where
the learner's store is, the layout of every version it will broadcast, where to send the
worker's notices, and, with LoRA, what the worker merges the adapters into. The worker
(`vllm_worker.WeightSyncExtension.asyncrl_join_sync_group`) takes it and joins.

The message crosses as bytes of asyncrl's codec (`pack_join`, `unpack_join`: MessagePack,
validated field by field on decode): vLLM's `collective_rpc` carries its arguments as
MessagePack to its engine core, where a dataclass arrives as a plain map, and from there to the
workers through vLLM's own channel; bytes arrive as they were sent, and the worker gets the
typed message back. Dtypes travel as their names ("float32", "bfloat16"), turned into torch
dtypes on the worker side by `asyncrl.dtypes.torch_dtype`, the project's one such helper.
"""

from __future__ import annotations

import dataclasses

import torch

from asyncrl.dtypes import torch_dtype
from asyncrl.weights.layout import ParamSpec
from asyncrl.wire.codec import check, decode, encode, message, struct
from asyncrl.wire.validation import ProtocolError
from rollout_servers.engines.base import SyncTarget


@struct
class ParamLayout:
    name: str  # the parameter's name as the learner sends it (state-dict naming)
    shape: list[int]  # its full (unsharded) shape
    dtype: str  # the torch dtype it arrives in, by name ("float32"), the engine's dtype


@struct
class LoraMerge:
    model_path: str  # the checkpoint whose base weights the adapters are merged into
    targets: list[str]  # the adapted linear layers, in module order (`asyncrl.weights.lora`)
    scale: float  # alpha / rank: merged weight = W0 + scale x B @ A
    dtype: str  # the engine's dtype by name ("bfloat16"): each merged weight is rounded to it


@message("vllm_join_weight_sync")
class JoinWeightSync:
    host: str  # the learner's store (`SyncTarget.host`)
    port: int  # its port
    rank: int  # the worker's rank in the sync group (1 with `server_id`)
    world_size: int  # the group's size (2 with `server_id`)
    timeout_s: float  # how long to wait for the learner: to join, then for each collective
    server_id: int | None  # the rollout server's id (None: a plain group, tests and benches)
    epoch: int  # which start of that server this is (its group's store prefix names it)
    specs: list[ParamLayout]  # every tensor of a version, in the order the learner sends them
    notify_address: str  # the server's ZeroMQ PULL socket for the worker's notices (ipc://)
    lora: LoraMerge | None  # versions carry adapters, merged here; None: full weights
    sync_key: bytes | None = dataclasses.field(repr=False)  # seals its join (`SyncTarget.key`)

    def validate(self) -> None:
        check(0 < self.port < 65536, f"port {self.port} out of range")
        check(0 <= self.rank < self.world_size, f"rank {self.rank} of {self.world_size}")
        check(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")
        check(self.notify_address.startswith("ipc://"), "notices go to an ipc:// address")


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype's name as the message carries it ("float32" for torch.float32)."""
    return str(dtype).removeprefix("torch.")


def join_message(
    target: SyncTarget, specs: list[ParamSpec], notify_address: str, lora: LoraMerge | None
) -> JoinWeightSync:
    """The engine's side: the join for `target`, versions laid out as `specs`."""
    layouts = [ParamLayout(s.name, list(s.shape), dtype_name(s.dtype)) for s in specs]
    return JoinWeightSync(
        host=target.host,
        port=target.port,
        rank=target.rank,
        world_size=target.world_size,
        timeout_s=target.timeout_s,
        server_id=target.server_id,
        epoch=target.epoch,
        sync_key=target.key,
        specs=layouts,
        notify_address=notify_address,
        lora=lora,
    )


def pack_join(join: JoinWeightSync) -> bytes:
    """The message as the one bytes argument of `collective_rpc` (it has no array frames)."""
    (header,) = encode(join)
    return bytes(header)


def unpack_join(payload: bytes) -> JoinWeightSync:
    """The worker's side: the message back, every field checked (`ProtocolError` if not)."""
    join = decode([bytes(payload)])
    if not isinstance(join, JoinWeightSync):
        raise ProtocolError(f"expected the worker's join, got a {type(join).__name__}")
    return join


def param_specs(join: JoinWeightSync) -> list[ParamSpec]:
    """The worker's side: the layout each version is received into."""
    return [ParamSpec(s.name, tuple(s.shape), torch_dtype(s.dtype)) for s in join.specs]
