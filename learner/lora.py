"""The learner's side of LoRA RL (`learner.lora`, `asyncrl.weights.lora` for the wire): adapters added
with `peft` before FSDP2 wraps the model, the adapters' full tensors for a weight sync, and the
final output: the merged model and the adapter in peft's format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from asyncrl.config.learner import LoraConfig
from asyncrl.weights.layout import ParamSpec
from asyncrl.weights.lora import adapter_targets, merged_weight

PREFIX = "base_model.model."  # where peft puts the Hugging Face model


def add_adapters(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """`model` with trainable adapters on the targeted layers, everything else frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = adapter_targets(model, lora)  # fails early, naming the option, when none match
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft says int; it only divides by it
        lora_dropout=lora.dropout,
        target_modules=sorted({t.rsplit(".", 1)[-1] for t in targets}),
        bias="none",
    )
    return get_peft_model(model, config)


def is_adapted(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name in the Hugging Face model, peft layer) of every adapted layer, in module order."""
    return [
        (name.removeprefix(PREFIX), module)
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {})
    ]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def adapter_sync_specs(model: torch.nn.Module, dtype: torch.dtype) -> list[ParamSpec]:
    """The sync layout of an adapted model: `asyncrl.weights.lora.adapter_specs` of its base."""
    specs = []
    for name, layer in lora_layers(model):
        for part in ("lora_A", "lora_B"):
            shape = tuple(getattr(layer, part)["default"].weight.shape)  # a DTensor's is global
            specs.append(ParamSpec(f"{name}.{part}", shape, dtype))
    return specs


def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(sync name, full tensor) of every adapter, in `adapter_sync_specs` order. A collective
    under FSDP: every rank must consume the whole iterator, in step."""
    for name, layer in lora_layers(model):
        for part in ("lora_A", "lora_B"):
            yield f"{name}.{part}", _full(getattr(layer, part)["default"].weight)


def merged_state(
    full: dict[str, torch.Tensor], lora: LoraConfig
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An adapted model's full state dict -> (the merged model's state dict under the
    Hugging Face names, the adapter's tensors under peft's file names)."""
    base, adapters = {}, {}
    for key, t in full.items():
        name = key.removeprefix(PREFIX)
        if ".lora_" in name:  # "<layer>.lora_A.default.weight"
            layer, part = name.split(".lora_")
            adapters[f"{layer}.lora_{part.split('.')[0]}"] = t
        else:
            base[name.replace(".base_layer.", ".")] = t
    saved = {}
    for key in [k for k in adapters if k.endswith(".lora_A")]:
        layer = key.removesuffix(".lora_A")
        a, b = adapters[key], adapters[f"{layer}.lora_B"]
        base[f"{layer}.weight"] = merged_weight(base[f"{layer}.weight"], a, b, lora.scale)
        saved[f"{PREFIX}{layer}.lora_A.weight"] = a.contiguous()
        saved[f"{PREFIX}{layer}.lora_B.weight"] = b.contiguous()
    return base, saved


def save_adapter(out: Path, tensors: dict[str, torch.Tensor], lora: LoraConfig, base: str) -> None:
    """The adapter as peft writes one (`PeftModel.from_pretrained(base_model, out)` loads it)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
