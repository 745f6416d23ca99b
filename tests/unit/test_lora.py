"""LoRA RL: only adapters train, a sync carries only the adapters, and the engine then samples
the learner's merged policy (the delivery probe checks it, and fails an engine that ignores an
update); the final output is the merged model and a peft adapter."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config.learner import LearnerConfig, LoraConfig
from asyncrl.weights.group import SyncGroup
from asyncrl.weights.layout import specs_of
from asyncrl.weights.lora import adapter_specs
from asyncrl.weights.sync import WeightBroadcaster
from asyncrl.wire.sockets import free_port
from learner.delivery import delivery_probe, wants_probe
from learner.lora import (
    adapter_sync_specs,
    adapter_tensors,
    add_adapters,
    merged_state,
    save_adapter,
)
from learner.optim import setup_optimizer
from rollout_servers.engines.base import DeliveryError, SamplingParams, SyncTarget
from rollout_servers.engines.hf import HFEngine

LORA = LoraConfig(rank=4, alpha=8.0)
PADDED = LearnerConfig(packing=False)  # the learner's forward on a plain (unregistered) model


def adapted(model_path: Path, seed: int) -> torch.nn.Module:
    """The learner's policy with adapters that moved (B is zero at the start: no change)."""
    model = add_adapters(AutoModelForCausalLM.from_pretrained(model_path), LORA)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def test_only_the_adapters_train_and_a_sync_carries_only_them(model_path):
    model = adapted(model_path, seed=1)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    optimizer = setup_optimizer(model, 1e-3, LearnerConfig())  # it holds the adapters only
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trainable)
    specs = adapter_sync_specs(model, torch.float32)
    # the engine derives the same layout from the plain model: the layout hash will agree
    plain = AutoModelForCausalLM.from_pretrained(model_path)
    assert specs == adapter_specs(plain, LORA, torch.float32)
    assert [n for n, _ in adapter_tensors(model)] == [s.name for s in specs]
    adapter_bytes = sum(s.numel * 4 for s in specs)
    full_bytes = sum(t.numel() * 4 for t in plain.state_dict().values())
    assert adapter_bytes < 0.2 * full_bytes  # a tiny model; SmolLM2's ratio is in the docs


def full_learner(model_path: Path, seed: int) -> torch.nn.Module:
    """The plain model, every weight moved by a seeded step (a full-weights version)."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.mark.parametrize("transport", ["gloo", "shm"])
@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
async def test_the_engine_samples_the_learners_policy_after_each_sync(model_path, lora, transport):
    """Three versions, each replacing the last (nothing accumulates): after each, the engine's
    log-probs of what it samples equal the learner's, over either transport on one host."""
    engine = HFEngine(model_path, seed=0, lora=lora)
    port = free_port("127.0.0.1")
    applied = []
    cpu = torch.device("cpu")

    def server_side():  # what the rollout server's weight-receiver thread does
        target = SyncTarget("127.0.0.1", port, 1, 2, cpu, timeout_s=60, transport=transport)
        applied.extend(engine.follow_learner(target))

    receiver = threading.Thread(target=server_side, daemon=True)
    receiver.start()
    group = await asyncio.to_thread(
        SyncGroup, "127.0.0.1", port, 0, 2, cpu, 60.0, transport=transport
    )
    broadcaster = WeightBroadcaster(group, bucket_bytes=4096)  # several buckets
    prompt = [5, 6, 7]
    try:
        for version in (1, 2, 3):
            if lora is not None:
                learner = adapted(model_path, seed=version)
                specs = adapter_sync_specs(learner, torch.float32)
                tensors = (t for _, t in adapter_tensors(learner))
            else:
                learner = full_learner(model_path, seed=version)
                named = list(learner.state_dict().items())
                specs, tensors = specs_of(named), (t for _, t in named)
            probe = delivery_probe(learner, PADDED, "float32", cpu)
            await asyncio.to_thread(broadcaster.broadcast, specs, tensors, version, probe)
            while engine.version != version:
                await asyncio.sleep(0.02)
            out = await engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=8))
            expected = logprobs(learner, prompt + out.token_ids)[len(prompt) - 1 :]
            assert (torch.tensor(out.logprobs) - expected).abs().max() < 1e-4
        await asyncio.to_thread(broadcaster.shutdown)
        await asyncio.to_thread(receiver.join, 30)
    finally:
        await engine.close()
    assert [a.version for a in applied] == [1, 2, 3]


def test_the_final_output_is_the_merged_model_and_a_peft_adapter(model_path, tmp_path):
    from peft import PeftModel

    learner = adapted(model_path, seed=3)
    state = {k: v.detach().clone() for k, v in learner.state_dict().items()}
    merged, adapter = merged_state(state, LORA)
    plain = AutoModelForCausalLM.from_pretrained(model_path)
    plain.load_state_dict(merged)  # every weight under its Hugging Face name
    save_adapter(tmp_path / "adapter", adapter, LORA, str(model_path))
    reloaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_path), tmp_path / "adapter"
    ).eval()
    ids = [3, 9, 4, 11, 2, 8]
    want = logprobs(learner, ids)
    assert (logprobs(plain.eval(), ids) - want).abs().max() < 1e-4
    assert (logprobs(reloaded, ids) - want).abs().max() < 1e-5


class IgnoringEngine(HFEngine):
    """An engine whose update never reaches the weights it samples with."""

    def update_weights(self, weights, version, subset=False) -> None:
        list(weights)
        self._version = version


@pytest.mark.parametrize("transport", ["gloo", "shm"])
@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
async def test_the_delivery_probe_fails_an_engine_that_keeps_the_old_policy(
    model_path, lora, transport
):
    engine = IgnoringEngine(model_path, seed=0, lora=lora)
    port = free_port("127.0.0.1")
    errors: list[BaseException] = []

    def server_side():
        target = SyncTarget(
            "127.0.0.1", port, 1, 2, torch.device("cpu"), timeout_s=60, transport=transport
        )
        try:
            list(engine.follow_learner(target))
        except BaseException as e:  # the server's receiver thread hands it to its main loop
            errors.append(e)

    receiver = threading.Thread(target=server_side, daemon=True)
    receiver.start()
    group = await asyncio.to_thread(
        SyncGroup, "127.0.0.1", port, 0, 2, torch.device("cpu"), 60.0, transport=transport
    )
    broadcaster = WeightBroadcaster(group, bucket_bytes=1 << 20)
    if lora is not None:
        learner = adapted(model_path, seed=5)
        specs, named = adapter_sync_specs(learner, torch.float32), list(adapter_tensors(learner))
    else:
        learner = full_learner(model_path, seed=5)
        named = list(learner.state_dict().items())
        specs = specs_of(named)
    probe = delivery_probe(learner, PADDED, "float32", torch.device("cpu"))
    await asyncio.to_thread(broadcaster.broadcast, specs, iter(t for _, t in named), 1, probe)
    await asyncio.to_thread(receiver.join, 30)
    assert len(errors) == 1 and isinstance(errors[0], DeliveryError), errors
    # nothing is sampled from weights that failed the check, even before the server stops
    with pytest.raises(DeliveryError):
        await engine.generate([5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=4))
    await engine.close()
    assert "version 1" in str(errors[0])


def test_versions_carry_the_probe_unless_the_check_is_off():
    from asyncrl.config import load_config

    assert wants_probe(load_config())
    assert not wants_probe(load_config(None, ["learner.delivery_check=false"]))
    assert wants_probe(load_config(None, ["rollout.engine=vllm"]))  # both engines check it


LLAMA_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # vLLM's Llama mapping


def test_vllm_versions_reload_whole_fused_layers_merged_where_adapted(model_path):
    """vLLM loads q/k/v (and gate/up) as one layer, processed once all its tensors arrived:
    a LoRA version on q alone must also carry k and v, at their base values."""
    from safetensors.torch import load_file

    from asyncrl.weights.lora import merged_weight
    from rollout_servers.engines.vllm_lora import MergedVersions, fused_modules

    layer = "model.layers.0"
    present = {f"{layer}.self_attn.{x}_proj" for x in "qkv"} | {f"{layer}.mlp.down_proj"}
    targets = [f"{layer}.self_attn.q_proj", f"{layer}.mlp.down_proj", f"{layer}.mlp.up_proj"]
    # siblings the checkpoint lacks (a model with up_proj and no gate_proj) are not asked for
    assert fused_modules(targets, LLAMA_FUSED, present) == [
        f"{layer}.self_attn.q_proj",
        f"{layer}.self_attn.k_proj",
        f"{layer}.self_attn.v_proj",
        f"{layer}.mlp.down_proj",
        f"{layer}.mlp.up_proj",
    ]
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj"])
    learner = add_adapters(AutoModelForCausalLM.from_pretrained(model_path), lora)
    with torch.no_grad():
        for name, p in learner.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.3)
    targets = [s.name.removesuffix(".lora_A") for s in adapter_sync_specs(learner, torch.float32)]
    targets = targets[::2]
    versions = MergedVersions(str(model_path), targets, lora.scale, torch.float32, LLAMA_FUSED)
    adapters = dict(adapter_tensors(learner))
    loaded = dict(versions.weights(adapters.items()))
    base = load_file(str(model_path / "model.safetensors"))
    for target in targets:
        prefix = target.removesuffix(".q_proj")
        assert {f"{prefix}.{p}_proj.weight" for p in "qkv"} <= set(loaded)
        a, b = adapters[f"{target}.lora_A"], adapters[f"{target}.lora_B"]
        assert torch.equal(
            loaded[f"{target}.weight"], merged_weight(base[f"{target}.weight"], a, b, 2.0)
        )
        assert torch.equal(loaded[f"{prefix}.k_proj.weight"], base[f"{prefix}.k_proj.weight"])
    assert not any("mlp" in name for name in loaded)
    # a version whose adapters do not match is refused before anything is loaded
    with pytest.raises(ValueError, match="missing from the version"):
        versions.weights(list(adapters.items())[2:])
    with pytest.raises(ValueError, match="unknown layers"):
        versions.weights([*adapters.items(), ("lm_head.lora_A", torch.zeros(4, 8))])
    with pytest.raises(ValueError, match="no weight in the checkpoint"):
        MergedVersions(str(model_path), ["model.layers.99.mlp.down_proj"], 1.0, torch.float32, ())


def test_vllm_lora_reads_the_files_a_safetensors_index_names(tmp_path):
    """A sharded checkpoint: only the shards its index names count (a stray file is ignored)."""
    import json

    from safetensors.torch import save_file

    from rollout_servers.engines.vllm_lora import checkpoint_files, checkpoint_names

    save_file({"a.weight": torch.zeros(2)}, str(tmp_path / "model-00001.safetensors"))
    save_file({"b.weight": torch.zeros(2)}, str(tmp_path / "model-00002.safetensors"))
    save_file({"a.weight": torch.ones(2)}, str(tmp_path / "stale-copy.safetensors"))
    index = {
        "weight_map": {"a.weight": "model-00001.safetensors", "b.weight": "model-00002.safetensors"}
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [f.name for f in checkpoint_files(tmp_path)] == [
        "model-00001.safetensors",
        "model-00002.safetensors",
    ]
    assert checkpoint_names(tmp_path) == {"a.weight", "b.weight"}
    with pytest.raises(ValueError, match="no .*safetensors"):
        checkpoint_files(tmp_path / "missing")
