"""FSDP2 sharding of a Hugging Face causal LM, and streaming its full weights back out.

Every decoder layer (the model's `_no_split_modules` classes) is wrapped with `fully_shard`,
then the root, so each layer's parameters are all-gathered just in time for its forward and
freed after. Parameter names (FQNs) are unchanged by FSDP2, which is what lets the learner and
the rollout engines agree on the weight layout.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PreTrainedConfig,
)

from asyncrl.config import LearnerConfig
from asyncrl.weights.layout import ParamSpec
from asyncrl.wire.binds import bind_collectives_to, setup_store
from learner.flex_attention import register_flex_attention
from learner.lora import adapter_sync_specs, adapter_tensors, add_adapters, is_adapted
from learner.packing import (
    FLEX_ATTENTION,
    PACKED_ATTENTION,
    choose_packed_attention,
    register_packed_attention,
)

log = logging.getLogger("asyncrl.learner")


def setup_distributed(device_kind: str, timeout_s: float = 3600.0) -> tuple[int, int, torch.device]:
    """Join the learner's default process group from torchrun-style env vars: NCCL on CUDA,
    gloo on CPU. Returns (rank, world_size, device).

    Its store (hosted by rank 0) and its gloo/NCCL sockets listen on MASTER_ADDR only (the
    run's `launch.host`, loopback by default; `asyncrl.wire.binds`), not on every interface."""
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
    model_path: str,
    device: torch.device,
    lc: LearnerConfig,
    head: str = "lm",
    trainable: bool = True,
) -> torch.nn.Module:
    """Load the model in float32 and shard it with FSDP2 over the default process group, as
    `lc` asks: packed attention (`learner.packing`), bf16 compute with fp32 master weights and
    fp32 gradient reduction (`MixedPrecisionPolicy`), activation checkpointing of every
    decoder layer, CPU offload of parameters, gradients and optimizer state. A single fp32
    rank without offload gets the plain module: there is nothing to shard, cast or offload.

    head="lm": the causal LM (policy, reference). head="value": the same backbone with a
    one-output token-classification head (the critic; the head starts from scratch)."""
    kwargs = {"dtype": torch.float32, "attn_implementation": attention_implementation(lc, device)}
    if head == "value":
        # no dropout before the value head (transformers defaults it to 0.1): values are
        # targets and baselines, and a noisy critic would make them random
        config = AutoConfig.from_pretrained(model_path, num_labels=1)
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(model_path, config=config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    model.to(device)
    if head == "lm" and trainable and lc.lora.rank:
        model = add_adapters(model, lc.lora)  # the base frozen, adapters trainable
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    else:
        model.train()  # (transformers checkpoints activations only in training mode)
        if lc.activation_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    if dist.get_world_size() == 1 and lc.dtype == "float32" and not lc.offload:
        return model  # nothing to shard or cast: FSDP's hooks would be pure cost (~13% here)
    mp_policy = MixedPrecisionPolicy()  # fully_shard's defaults: no cast, no offload
    if lc.dtype == "bfloat16":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload_policy = OffloadPolicy()
    if lc.offload:
        offload_policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            fully_shard(module, mp_policy=mp_policy, offload_policy=offload_policy)
    # the root keeps its parameters (output head, tied embeddings) unsharded after forward,
    # FSDP2's default for the root: learner.forward's chunked log-probs use the head's weight
    # after the model returns, until the backward (do not pass reshard_after_forward=True)
    fully_shard(model, mp_policy=mp_policy, offload_policy=offload_policy)
    return model


def hf_config(model: torch.nn.Module) -> PreTrainedConfig:
    """The Hugging Face config of a model from `setup_model` (or `learner.lora.add_adapters`:
    peft forwards `config` to the model it wraps)."""
    config = model.config
    assert isinstance(config, PreTrainedConfig), f"{type(model).__name__} has no HF config"
    return config


def attention_implementation(lc: LearnerConfig, device: torch.device) -> str:
    """sdpa on padded rows; on packed rows the implementation that
    `learner.packing.choose_packed_attention` picks for `device` (or `learner.packed_attention`
    forces), registered with transformers and named once in the learner's log."""
    if not lc.packing:
        return "sdpa"
    name, why = choose_packed_attention(
        device.type,
        lc.dtype,
        lc.share_prompts,
        flash_installed=importlib.util.find_spec("flash_attn") is not None,
        forced=None if lc.packed_attention == "auto" else lc.packed_attention,
    )
    if name == PACKED_ATTENTION:
        register_packed_attention()
    elif name == FLEX_ATTENTION:
        register_flex_attention()
    _log_choice(name, device.type, why)
    return name


@functools.cache
def _log_choice(name: str, device_type: str, why: str) -> None:
    """Log the packed attention once per process and choice (it is asked for per model and per
    layout question)."""
    log.info("packed attention on %s: %s, %s", device_type, name, why)


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """FSDP: reduce gradients after this backward or not (accumulate); a plain module always
    accumulates locally."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)


def param_specs(model: torch.nn.Module, dtype: torch.dtype | None = None) -> list[ParamSpec]:
    """Full (unsharded) layout of the state dict, in state-dict order; floating-point tensors
    in `dtype` when given (the engine's: `WeightBroadcaster` casts to it while packing)."""
    return [
        ParamSpec(n, tuple(t.shape), dtype if dtype and t.is_floating_point() else t.dtype)
        for n, t in model.state_dict().items()
    ]


def iter_full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) in state-dict order. A collective: every rank must consume
    the whole iterator, in step."""
    for name, t in model.state_dict().items():
        yield name, (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def sync_specs(model: torch.nn.Module, dtype: torch.dtype) -> list[ParamSpec]:
    """What a weight sync carries: the adapters of a LoRA model, else every weight."""
    return adapter_sync_specs(model, dtype) if is_adapted(model) else param_specs(model, dtype)


def sync_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) in `sync_specs` order; a collective, as `iter_full_tensors`."""
    return adapter_tensors(model) if is_adapted(model) else iter_full_tensors(model)
