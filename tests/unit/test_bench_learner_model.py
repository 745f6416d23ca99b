"""tools/bench_learner.py's `--shape`s are the models they are named after: built on the meta
device (no weights), their parameter counts are the published ones, and N of the FLOPs formula
(the linear layers' weights) is worked out by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench_model():
    """tools/bench_learner_model.py, imported from its path (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "bench_learner_model", ROOT / "tools" / "bench_learner_model.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _linear_weights(vocab, hidden, layers, heads, kv_heads, inter) -> int:
    """q and o (hidden x hidden), k and v (kv_heads x head_dim rows), the MLP's three, per
    layer; and the LM head (tied to the embedding, counted once)."""
    kv = hidden // heads * kv_heads
    return layers * (2 * hidden * hidden + 2 * kv * hidden + 3 * hidden * inter) + vocab * hidden


@pytest.mark.parametrize(
    ("shape", "published", "dims"),
    [
        # Llama-3.2-1B: 1,235,814,400 parameters; Llama-3.2-3B: 3,212,749,824 (their configs)
        ("llama1b", 1_235_814_400, (128256, 2048, 16, 32, 8, 8192)),
        ("llama3b", 3_212_749_824, (128256, 3072, 28, 24, 8, 8192)),
    ],
)
def test_a_shape_has_its_models_parameters(bench_model, shape, published, dims):
    config = bench_model.shape_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert config.tie_word_embeddings and config.rope_parameters["rope_theta"] == 500000.0
    assert sum(p.numel() for p in model.parameters()) == published
    vocab, hidden, layers = dims[:3]
    norms = (2 * layers + 1) * hidden
    assert bench_model.matmul_params(config) == _linear_weights(*dims) == published - norms


def test_add_mfu_by_hand(bench_model):
    results = {
        "a": {"real_tokens": 100, "seconds_per_update": 2.0},
        "b": {"real_tokens": 100, "seconds_per_update": 1.0, "attention_sq": 10},
        "c": {"error": "out of memory"},
    }
    flops = {"params": 1000, "layers": 2, "hidden": 8}
    bench_model.add_mfu(results, {"attention_sq": 50}, flops, peak=1e-6)
    # 6 x 1000 x 100 + 6 x 2 x 8 x sum(len^2)
    assert results["a"]["flops_per_update"] == 600_000 + 96 * 50
    assert results["b"]["flops_per_update"] == 600_000 + 96 * 10
    assert results["a"]["mfu"] == pytest.approx(604_800 / 2.0 / 1e12 / 1e-6)
    assert results["c"] == {"error": "out of memory"}
    assert bench_model.peak_tflops(None, {"x": {"device_name": "NVIDIA H100 80GB HBM3"}}) == 989.0
    assert bench_model.peak_tflops(5.0, {"x": {"device_name": "NVIDIA H100"}}) == 5.0
    assert bench_model.peak_tflops(None, {"x": {"peak_rss_mb": 1.0}}) is None  # a CPU run
