"""LoRA adapters on the wire: their layout, and how an engine merges them into its weights.

With `learner.lora.rank > 0` the learner trains low-rank adapters (A: [rank, in], B: [out,
rank]) on the linear layers named in `learner.lora.target_modules`, and each version's weight
sync carries only the adapters. Both sides derive the same layout from a plain Hugging Face
model (`adapter_specs`: per targeted layer, in module order, `<layer>.lora_A` then
`<layer>.lora_B`), so the layout hash of `asyncrl.weights.sync` checks them against each other.

An engine keeps a copy of the base weights of the targeted layers and, for every version,
writes W = W0 + alpha / rank x (B @ A) into its live weights (`AdapterMerger`): a version
replaces the previous one, it never accumulates.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from asyncrl.config.learner import LoraConfig
from asyncrl.weights.layout import ParamSpec


def adapter_targets(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """Names of the linear layers that carry adapters, in module order."""
    wanted = set(lora.target_modules)
    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in wanted
    ]
    if not names:
        raise ValueError(
            f"learner.lora.target_modules={lora.target_modules} names no linear layer of the model"
        )
    return names


def adapter_specs(model: torch.nn.Module, lora: LoraConfig, dtype: torch.dtype) -> list[ParamSpec]:
    """The sync layout of the adapters of `model` (a plain Hugging Face model)."""
    specs = []
    for name in adapter_targets(model, lora):
        layer = _linear(model, name)
        specs.append(ParamSpec(f"{name}.lora_A", (lora.rank, layer.in_features), dtype))
        specs.append(ParamSpec(f"{name}.lora_B", (layer.out_features, lora.rank), dtype))
    return specs


def _linear(model: torch.nn.Module, name: str) -> torch.nn.Linear:
    layer = model.get_submodule(name)
    assert isinstance(layer, torch.nn.Linear), name  # adapter_targets names linear layers only
    return layer


def merged_weight(
    base: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """W0 + scale x (B @ A), computed in float32 on W0's device, rounded once to `dtype`
    (default W0's)."""
    delta = (b.to(base.device).float() @ a.to(base.device).float()) * scale
    return (base.float() + delta).to(dtype or base.dtype)


class AdapterMerger:
    """An engine's side: the base weights of the targeted layers, and the merge of a version."""

    def __init__(
        self,
        targets: list[str],
        base: dict[str, torch.Tensor],
        scale: float,
        dtype: torch.dtype | None = None,
    ):
        """`targets`: `adapter_targets` of the model; `base`: `<target>.weight` -> W0; `dtype`:
        of the merged weights (default W0's; a base kept in higher precision rounds once)."""
        missing = [name for name in targets if f"{name}.weight" not in base]
        if missing:
            raise ValueError(f"no base weight for the adapted layers {missing[:3]}")
        self.scale = scale
        self.targets = targets
        self._base = base
        self._dtype = dtype

    @classmethod
    def of_model(cls, model: torch.nn.Module, lora: LoraConfig) -> AdapterMerger:
        """Keeps a copy of the targeted layers' current weights of `model` as the base."""
        targets = adapter_targets(model, lora)
        base = {f"{name}.weight": _linear(model, name).weight.detach().clone() for name in targets}
        return cls(targets, base, lora.scale)

    def check(self, adapters: dict[str, torch.Tensor]) -> None:
        """ValueError unless `adapters` are exactly lora_A and lora_B of every target."""
        want = {f"{name}.lora_{x}" for name in self.targets for x in "AB"}
        missing = sorted(want - adapters.keys())
        if missing:
            raise ValueError(f"adapters missing from the version: {missing[:3]}")
        unknown = sorted(adapters.keys() - want)
        if unknown:
            raise ValueError(f"adapters for unknown layers: {unknown[:3]}")

    def merge(self, name: str, adapters: dict[str, torch.Tensor]) -> torch.Tensor:
        """The merged weight of the target `name` (after `check`)."""
        a, b = adapters[f"{name}.lora_A"], adapters[f"{name}.lora_B"]
        return merged_weight(self._base[f"{name}.weight"], a, b, self.scale, self._dtype)

    def merged(
        self, adapters: Iterable[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        """(weight name, merged weight) of every targeted layer, from one version's adapters
        in `adapter_specs` order; ValueError when they do not cover the targets pairwise."""
        got = dict(adapters)
        self.check(got)
        return [(f"{name}.weight", self.merge(name, got)) for name in self.targets]
