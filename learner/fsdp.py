"""FSDP2 sharding of a Hugging Face causal LM, and streaming its full weights back out.

Every decoder layer (the model's `_no_split_modules` classes) is wrapped with `fully_shard`,
then the root, so each layer's parameters are all-gathered just in time for its forward and
freed after. Parameter names (FQNs) are unchanged by FSDP2, which is what lets the learner and
the rollout engines agree on the weight layout.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from asyncrl.binds import bind_collectives_to, setup_store
from asyncrl.weight_sync import ParamSpec


def setup_distributed(device_kind: str, timeout_s: float = 3600.0) -> tuple[int, int, torch.device]:
    """Join the learner's default process group from torchrun-style env vars: NCCL on CUDA,
    gloo on CPU. Returns (rank, world_size, device).

    Its store (hosted by rank 0) and its gloo/NCCL sockets listen on MASTER_ADDR only (the
    run's `launch.host`, loopback by default; `asyncrl.binds`), not on every interface."""
    use_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    if device_kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("learner.device=cuda but CUDA is not available")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=timeout_s)
    bind_collectives_to(host)
    store = setup_store(host, port, world, rank == 0, timeout)
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world, timeout=timeout
    )
    return rank, world, device


def setup_model(
    model_path: str, device: torch.device, head: str = "lm", trainable: bool = True
) -> torch.nn.Module:
    """Load the model in float32 and shard it with FSDP2 over the default process group.

    head="lm": the causal LM (policy, reference). head="value": the same backbone with a
    one-output token-classification head (the critic; the head starts from scratch)."""
    if head == "value":
        model = AutoModelForTokenClassification.from_pretrained(
            model_path, num_labels=1, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.to(device)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module)
    fully_shard(model)
    return model


def param_specs(model: torch.nn.Module) -> list[ParamSpec]:
    """Full (unsharded) layout of the state dict, in state-dict order."""
    return [ParamSpec(n, tuple(t.shape), t.dtype) for n, t in model.state_dict().items()]


def iter_full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) in state-dict order. A collective: every rank must consume
    the whole iterator, in step."""
    for name, t in model.state_dict().items():
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t).detach()
