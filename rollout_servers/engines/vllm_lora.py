"""LoRA versions in the vLLM engine: merged into full weights of the adapted layers and loaded
through the same layerwise reload as a full version (`vllm_worker.asyncrl_apply`).

vLLM fuses some checkpoint layers into one (its model's `packed_modules_mapping`: for Llama,
q/k/v into `qkv_proj` and gate/up into `gate_up_proj`), and its layerwise reload processes a
fused layer only once all of its checkpoint tensors have arrived: a version that loaded `q_proj`
alone would leave k and v unset. So a version loads, for every fused layer that an adapted layer
belongs to, all of that layer's checkpoint tensors: the merged weights W0 + alpha/r x B @ A of
the adapted ones (`asyncrl.weights.lora.AdapterMerger`), the base of the others (biases included), all
kept from the checkpoint, in its precision, when the engine starts; each is rounded once to the
engine's dtype.

Runs in vLLM's worker process; needs only torch and safetensors (tests use it without vLLM).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from asyncrl.weights.lora import AdapterMerger


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The model directory's safetensors files: those its index names, else every one."""
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / name for name in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {model_path}: cannot keep LoRA base weights")
    return files


def checkpoint_names(model_path: str | Path) -> set[str]:
    """Every tensor name of the checkpoint (headers only: nothing is loaded)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in checkpoint_files(model_path):
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    return names


def check_targets(model_path: str | Path, targets: Iterable[str]) -> set[str]:
    """ValueError naming adapted layers whose weight the checkpoint does not hold (a tied
    lm_head, a renamed layer): the vLLM engine keeps their base from the checkpoint. Returns
    the checkpoint's tensor names."""
    names = checkpoint_names(model_path)
    missing = [t for t in targets if f"{t}.weight" not in names]
    if missing:
        raise ValueError(
            f"LoRA with vLLM: {missing[:3]} have no weight in the checkpoint at {model_path} "
            "(tied or renamed layers cannot be adapted with the vLLM engine)"
        )
    return names


def fused_modules(
    targets: Iterable[str], fused: Iterable[Sequence[str]], present: set[str]
) -> list[str]:
    """The adapted layers plus the siblings (in `present`, the checkpoint's modules) that they
    share a fused vLLM layer with (`fused`: groups of checkpoint leaf names), in order."""
    groups = [tuple(g) for g in fused]
    out: dict[str, None] = {}
    for name in targets:
        prefix, _, leaf = name.rpartition(".")
        group = next((g for g in groups if leaf in g), (leaf,))
        for sibling in group:
            module = f"{prefix}.{sibling}" if prefix else sibling
            if module == name or module in present:
                out[module] = None
    return list(out)


class MergedVersions:
    """The worker's LoRA state: base tensors of the fused layers touched, and a version's load."""

    def __init__(
        self,
        model_path: str,
        targets: list[str],
        scale: float,
        dtype: torch.dtype,
        fused: Iterable[Sequence[str]],
    ):
        from safetensors import safe_open

        present = {name.rpartition(".")[0] for name in check_targets(model_path, targets)}
        wanted = set(fused_modules(targets, fused, present))
        self._tensors: dict[str, torch.Tensor] = {}
        for file in checkpoint_files(model_path):
            with safe_open(str(file), "pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if key.rpartition(".")[0] in wanted:
                        self._tensors[key] = f.get_tensor(key)  # checkpoint precision, CPU
        self._targets = set(targets)
        self._dtype = dtype
        base = {f"{t}.weight": self._tensors[f"{t}.weight"] for t in targets}
        self._merger = AdapterMerger(targets, base, scale, dtype)

    def weights(
        self, adapters: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint-named tensors to load for one version's adapters: merged where adapted,
        the base elsewhere. The adapters are checked now (ValueError, nothing to load when they
        do not match); each merged weight is made when the loader reaches it."""
        got = dict(adapters)
        self._merger.check(got)
        return self._load(got)

    def _load(self, adapters: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, base in self._tensors.items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and module in self._targets:
                yield name, self._merger.merge(module, adapters)
            else:
                yield name, base.to(self._dtype)
