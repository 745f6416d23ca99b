"""The models of tools/bench_learner.py and what its FLOPs formula needs of them.

- `SHAPES`: random Llamas (tied embeddings) by `--shape`: SmolLM2-135M's, Llama-3.2-1B's and
  Llama-3.2-3B's (128k vocabulary), and a tiny one for tests;
- `matmul_params`: N of FLOPs = 6 x N x tokens + 6 x layers x hidden x sum(len^2), counted on
  the meta device (no weights are made);
- `add_mfu`: each configuration's FLOPs per update, TFLOP/s and MFU against a device's peak.
"""

from __future__ import annotations

from typing import Any

import torch

SMOLLM2_SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 2048,
    "rope_theta": 100000.0,
}
TINY_SHAPE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
}
LLAMA_1B_SHAPE = {  # Llama-3.2-1B (its rope scaling left out: it does not change the cost)
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
LLAMA_3B_SHAPE = {  # Llama-3.2-3B
    **LLAMA_1B_SHAPE,
    "hidden_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
}
SHAPES = {
    "smollm2": SMOLLM2_SHAPE,
    "llama1b": LLAMA_1B_SHAPE,
    "llama3b": LLAMA_3B_SHAPE,
    "tiny": TINY_SHAPE,
}
"""Random Llamas (tied embeddings) by `--shape`."""
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
"""Dense bf16 tensor-core peaks (TFLOP/s) by a part of `torch.cuda.get_device_name`."""


def shape_config(name: str, layers: int = 0):
    """The LlamaConfig of `SHAPES[name]` (tied embeddings), `layers` deep when given."""
    from transformers import LlamaConfig

    shape: dict[str, Any] = dict(SHAPES[name])
    if layers:
        shape["num_hidden_layers"] = layers
    return LlamaConfig(**shape, tie_word_embeddings=True, pad_token_id=0)


def flops_shape(model: str) -> dict:
    """What the FLOPs formula needs of the model in directory `model`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    return {
        "params": matmul_params(config),
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
    }


def matmul_params(config) -> int:
    """N of the FLOPs formula: the weights of the model's linear layers (the LM head's included,
    once, tied or not; the input embedding is a lookup), counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def peak_tflops(given: float | None, results: dict) -> float | None:
    """`given` (`--peak-tflops`), else the bf16 dense peak of the device a worker ran on (CUDA
    only: a CPU worker names no device)."""
    if given:
        return given
    names = [r["device_name"] for r in results.values() if "device_name" in r]
    for part, tflops in PEAK_TFLOPS.items():
        if names and part in names[0]:
            return tflops
    return None


def add_mfu(results: dict, stats: dict, flops: dict, peak: float | None) -> None:
    """Each result's FLOPs per update (the module docstring's formula) and, with a peak, MFU."""
    for r in results.values():
        if "error" in r:
            continue
        attention = r.get("attention_sq", stats["attention_sq"])
        r["flops_per_update"] = (
            6 * flops["params"] * r["real_tokens"]
            + 6 * flops["layers"] * flops["hidden"] * attention
        )
        r["tflops_per_s"] = r["flops_per_update"] / r["seconds_per_update"] / 1e12
        if peak:
            r["mfu"] = r["tflops_per_s"] / peak
