"""Each transport end to end, across processes, as a run uses it: learner rank 0's `SyncFleet`
here, a transformers engine in a process of its own (`engine_peer.py`) joining as a rollout
server does, so the learner chooses the transport from where the two are. After each of three
versions (full weights, and LoRA adapters merged by the engine) the engine's log-probs equal the
learner's, and no /dev/shm segment outlives the sync.

On CPU both ends share the host: `shm`. The `gpu` variants: both on one GPU (`cuda_ipc`: NCCL
would refuse them) and a CPU server beside a GPU learner (`shm`, host staging)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_peer import IDS
from sync_peers import LEARNER_KEY
from transformers import AutoModelForCausalLM

from asyncrl.config.learner import LearnerConfig, LoraConfig
from asyncrl.metrics import JsonlWriter, read_jsonl
from asyncrl.weights.layout import specs_of
from asyncrl.weights.shm import SHM_DIR
from asyncrl.wire.sockets import free_port
from learner.delivery import delivery_probe
from learner.lora import adapter_sync_specs, adapter_tensors, add_adapters
from learner.sync_fleet import SyncFleet, SyncFleetSpec

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU = [pytest.mark.gpu, CUDA]
PADDED = LearnerConfig(packing=False)  # the learner's forward on a plain model
LORA_RANK = 4


def policy(model_path: Path, version: int, lora: bool, device: str) -> torch.nn.Module:
    """The learner's policy at `version`: every weight (or every adapter) moved by a seeded
    step."""
    model = AutoModelForCausalLM.from_pretrained(model_path)
    if lora:
        model = add_adapters(model, LoraConfig(rank=LORA_RANK, alpha=2.0 * LORA_RANK))
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora and "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif not lora:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.to(device).eval()


def logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0, :-1].float()
    gathered = torch.log_softmax(logits, -1).gather(
        -1, torch.tensor(ids[1:], device=device)[:, None]
    )
    return gathered.squeeze(-1).cpu()


@pytest.mark.parametrize(
    "learner_device, server_device, transport",
    [
        ("cpu", "cpu", "shm"),
        pytest.param("cuda", "cuda", "cuda_ipc", marks=GPU),
        pytest.param("cuda", "cpu", "shm", marks=GPU),
    ],
)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_version_reaches_the_engine_exactly(
    model_path, tmp_path, learner_device, server_device, transport, lora
):
    port, out = free_port("127.0.0.1"), tmp_path / "engine.jsonl"
    spec = SyncFleetSpec(
        host="127.0.0.1",
        port=port,
        num_servers=1,
        device=torch.device(learner_device),
        bucket_bytes=4096,  # several buckets
        timeout_s=60.0,
        first_join_s=120.0,
    )
    fleet = SyncFleet(
        spec=spec,
        server_epochs=lambda: {0: 0},
        learner_key=LEARNER_KEY,
        events=JsonlWriter(tmp_path / "sync_members.jsonl"),
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'integration'}"}
    script = ROOT / "tests" / "integration" / "engine_peer.py"
    rank = str(LORA_RANK if lora else 0)
    args = [sys.executable, str(script), str(port), str(model_path), server_device, rank, str(out)]
    peer = subprocess.Popen(args, env=env | {"OMP_NUM_THREADS": "1"})
    try:
        for version in (1, 2, 3):
            learner = policy(model_path, version, lora, learner_device)
            if lora:
                specs = adapter_sync_specs(learner, torch.float32)
                tensors = (t for _, t in adapter_tensors(learner))
            else:
                named = list(learner.state_dict().items())
                specs, tensors = specs_of(named), (t for _, t in named)
            probe = delivery_probe(learner, PADDED, "float32", torch.device(learner_device))
            assert fleet.broadcast(specs, tensors, version, probe) == {0: 0}
            got = wait_for_version(out, version)
            want = logprobs(learner, IDS)
            assert (torch.tensor(got["logprobs"]) - want).abs().max() < 1e-4, version
        fleet.shutdown()
        assert peer.wait(timeout=60) == 0, read_jsonl(out)
    finally:
        if peer.poll() is None:
            peer.kill()
    joined = [r for r in read_jsonl(tmp_path / "sync_members.jsonl") if r["event"] == "joined"]
    assert [r["transport"] for r in joined] == [transport]
    assert not list(SHM_DIR.glob(f"asyncrl-ws-{os.getpid()}-*"))


def wait_for_version(out: Path, version: int, timeout_s: float = 120.0) -> dict:
    """The engine's record of `version` (it writes it once applied and checked)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = read_jsonl(out) if out.exists() else []
        errors = [r for r in rows if r.get("event") == "error"]
        assert not errors, errors
        for r in rows:
            if r.get("version") == version:
                return r
        time.sleep(0.05)
    raise AssertionError(f"the engine did not apply version {version} in {timeout_s} s")
