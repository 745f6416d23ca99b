"""LoRA versions in the vLLM engine: merged into full weights of the adapted layers and loaded
through the same layerwise reload as a full version (`vllm_worker.asyncrl_apply`).

vLLM fuses some checkpoint layers into one (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`),
and its layerwise reload processes a fused layer only once all of its checkpoint tensors have
arrived: a version that loaded `q_proj` alone would leave k and v unset. So a version loads, for
every fused layer that an adapted layer belongs to, all of that layer's checkpoint tensors: the
merged weights W0 + alpha/r x B @ A of the adapted ones (`asyncrl.lora.AdapterMerger`), the base
of the others (biases included), all kept from the checkpoint when the engine starts.

Runs in vLLM's worker process; needs only torch and safetensors (tests use it without vLLM).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from asyncrl.lora import AdapterMerger

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Checkpoint layers vLLM loads into one fused layer (Llama, Qwen2, Mistral and kin)."""


def fused_modules(targets: Iterable[str]) -> list[str]:
    """The adapted layers plus the siblings they share a fused vLLM layer with, in order."""
    out: dict[str, None] = {}
    for name in targets:
        prefix, _, leaf = name.rpartition(".")
        group = next((g for g in FUSED if leaf in g), (leaf,))
        for sibling in group:
            out[f"{prefix}.{sibling}" if prefix else sibling] = None
    return list(out)


def checkpoint_tensors(
    model_path: str | Path, modules: list[str], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every tensor of `modules` (weights and biases) from the model directory's safetensors
    files, as `dtype`; ValueError naming a module whose weight none of the files holds (a tied
    lm_head, for one, is not in the checkpoint)."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {model_path}: cannot keep LoRA base weights")
    wanted, out = set(modules), {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key.rpartition(".")[0] in wanted:
                    out[key] = f.get_tensor(key).to(dtype)
    missing = [m for m in modules if f"{m}.weight" not in out]
    if missing:
        raise ValueError(
            f"LoRA with vLLM: {missing[:3]} have no weight in the checkpoint at {model_path} "
            "(tied or renamed layers cannot be adapted with the vLLM engine)"
        )
    return out


class MergedVersions:
    """The worker's LoRA state: base tensors of the fused layers touched, and a version's load."""

    def __init__(self, model_path: str, targets: list[str], scale: float, dtype: torch.dtype):
        self._tensors = checkpoint_tensors(model_path, fused_modules(targets), dtype)
        base = {f"{t}.weight": self._tensors[f"{t}.weight"] for t in targets}
        self._merger = AdapterMerger(targets, base, scale)

    def weights(
        self, adapters: Iterable[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        """Checkpoint-named tensors to load for one version's adapters: merged where adapted,
        the base elsewhere; ValueError (nothing to load) when the adapters do not match."""
        merged = dict(self._merger.merged(adapters))
        return [(name, merged.get(name, base)) for name, base in self._tensors.items()]
