"""The vLLM worker's join (`rollout_servers.engines.vllm_join`): one typed message, built by the
engine from its sync target and weight layout, packed as the one bytes argument of vLLM's
`collective_rpc`, and unpacked by the worker into what the 10-argument join gave it (no vLLM
needed: the worker extension's join runs on a fake worker)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.config.learner import LoraConfig
from asyncrl.demo.model_cache import TinyModelSpec
from asyncrl.demo.tiny_model import build_tiny_model, build_tokenizer
from asyncrl.weights.layout import ParamSpec, specs_of
from asyncrl.weights.lora import adapter_specs, adapter_targets
from asyncrl.wire.codec import encode
from asyncrl.wire.validation import ProtocolError
from rollout_servers.engines.base import SyncTarget
from rollout_servers.engines.vllm_join import (
    JoinWeightSync,
    LoraMerge,
    join_message,
    pack_join,
    param_specs,
    unpack_join,
)
from rollout_servers.engines.vllm_lora import MergedVersions
from rollout_servers.engines.vllm_notices import WeightReceiverClosed
from rollout_servers.engines.vllm_worker import WeightSyncExtension

KEY = bytes(range(32))
TARGET = SyncTarget(
    "127.0.0.1", 29512, 1, 2, torch.device("cpu"), 90.0, server_id=3, epoch=2, key=KEY
)
ADDRESS = "ipc:///tmp/asyncrl-vllm-x/notices-0123"
LLAMA_FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer, TinyModelSpec(), seed=0).save_pretrained(path)
    return path


def _specs_as_before(specs: list[ParamSpec]) -> list[ParamSpec]:
    """What the 10-argument join gave the worker: (name, shape, "torch.<dtype>") tuples from the
    engine, each dtype turned back with getattr on the worker."""
    sent = [(s.name, list(s.shape), str(s.dtype)) for s in specs]
    return [
        ParamSpec(name, tuple(shape), getattr(torch, dtype.removeprefix("torch.")))
        for name, shape, dtype in sent
    ]


class _FakeWorker(WeightSyncExtension):
    """vLLM's worker as the extension sees it at join time; the receive loop only records."""

    def __init__(self) -> None:
        model = SimpleNamespace(packed_modules_mapping=LLAMA_FUSED)
        self.model_runner = SimpleNamespace(model=model)
        self.joined: list[JoinWeightSync] = []

    def _asyncrl_receive_loop(self, join: JoinWeightSync) -> None:
        self.joined.append(join)


def test_the_join_carries_the_target_and_the_layout_the_worker_had_before(model_path):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    specs = specs_of(model.state_dict().items())
    join = join_message(TARGET, specs, ADDRESS, None)
    payload = pack_join(join)
    assert isinstance(payload, bytes)
    got = unpack_join(payload)
    assert got == join
    assert (got.host, got.port, got.rank, got.world_size) == ("127.0.0.1", 29512, 1, 2)
    assert (got.timeout_s, got.server_id, got.epoch) == (90.0, 3, 2)
    assert got.sync_key == KEY and KEY.hex() not in repr(got) and str(KEY) not in repr(got)
    assert got.notify_address == ADDRESS and got.lora is None
    assert {s.dtype for s in got.specs} == {"float32"}  # names, not "torch.float32"
    assert param_specs(got) == _specs_as_before(specs) == specs

    worker = _FakeWorker()
    worker.asyncrl_join_sync_group(payload)
    worker._asyncrl_thread.join(timeout=10)
    assert worker._asyncrl_specs == _specs_as_before(specs)
    assert worker._asyncrl_lora is None
    assert worker.joined == [join]


def test_a_lora_join_names_what_the_worker_merges_the_adapters_into(model_path):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "down_proj"])
    specs = adapter_specs(model, lora, torch.bfloat16)  # as the engine, in its dtype
    merge = LoraMerge(str(model_path), adapter_targets(model, lora), lora.scale, "bfloat16")
    payload = pack_join(join_message(TARGET, specs, ADDRESS, merge))
    got = unpack_join(payload)
    assert got.lora == merge and got.lora.scale == 2.0
    assert param_specs(got) == _specs_as_before(specs)
    assert {s.dtype for s in param_specs(got)} == {torch.bfloat16}

    worker = _FakeWorker()
    worker.asyncrl_join_sync_group(payload)
    worker._asyncrl_thread.join(timeout=10)
    assert isinstance(worker._asyncrl_lora, MergedVersions)
    assert worker._asyncrl_lora._dtype == torch.bfloat16
    assert worker._asyncrl_lora._targets == set(merge.targets)
    assert worker._asyncrl_specs == _specs_as_before(specs)


def test_a_malformed_or_foreign_payload_is_refused_by_the_worker(model_path):
    join = join_message(TARGET, [ParamSpec("w", (2, 3), torch.float32)], ADDRESS, None)
    with pytest.raises(
        ProtocolError, match="expected the worker's join, got a WeightReceiverClosed"
    ):
        unpack_join(encode(WeightReceiverClosed(-1))[0])
    with pytest.raises(ProtocolError, match="port"):
        unpack_join(pack_join(dataclasses.replace(join, port=0)))
    with pytest.raises(ProtocolError, match="ipc://"):
        unpack_join(pack_join(dataclasses.replace(join, notify_address="tcp://1.2.3.4:5")))
    wrong_type = pack_join(join).replace(b"notify_address", b"notify_addresz")
    with pytest.raises(ProtocolError, match="missing fields"):
        unpack_join(wrong_type)
