"""One table of refusals (`asyncrl.config.weight_transport`) serves both checks of a forced
`launch.weight_transport`: the config's at start-up and `choose_transport`'s at each join. The
same refusal reads the same from both, naming the key; and a machine without /dev/shm says so
with None on the wire, not a sentinel."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import Config
from asyncrl.config.weight_transport import NEEDS, UNMET, is_staged, refusal
from asyncrl.weights import shm
from asyncrl.weights.transports import (
    SyncPlace,
    choose_transport,
    pack_message,
    place_of,
    unpack_message,
)

GB = 2**30


def place(device="cpu", gpu="", shm_free: int | None = 64 * GB) -> SyncPlace:
    return SyncPlace(host="a", device=device, gpu=gpu, shm_free=shm_free, shm="1:2", ipc_ns="3:4")


@pytest.mark.parametrize("forced", ["cuda_ipc", "nccl"])
@pytest.mark.parametrize("cpu_end", ["rollout", "learner"])
def test_the_config_and_the_join_refuse_a_cpu_end_with_the_same_text(forced, cpu_end):
    gpu, cpu = place(device="cuda", gpu="GPU-0"), place()
    learner, server = (gpu, cpu) if cpu_end == "rollout" else (cpu, gpu)
    with pytest.raises(ValueError) as at_join:
        choose_transport(learner, server, forced, version_bytes=GB)
    text = str(at_join.value)
    assert text == f"launch.weight_transport={forced} cannot be used: {UNMET['both_gpus']}"
    with pytest.raises(ValueError) as at_start:
        Config.model_validate({"launch": {"weight_transport": forced}, cpu_end: {"device": "cpu"}})
    assert text in str(at_start.value)  # the same refusal, and which key put an end on the CPU
    assert f"{cpu_end}.device=cpu" in str(at_start.value)


@pytest.mark.parametrize("forced", ["auto", "shm", "gloo", "cuda_ipc", "nccl"])
def test_the_config_refuses_only_what_it_knows_cannot_work(forced):
    Config.model_validate({"launch": {"weight_transport": forced}})  # devices auto: not known
    cpu = {"launch": {"weight_transport": forced}, "rollout": {"device": "cpu"}}
    if forced != "auto" and "both_gpus" in NEEDS[forced]:
        with pytest.raises(ValueError, match=f"launch.weight_transport={forced}"):
            Config.model_validate(cpu)
    else:
        Config.model_validate(cpu)


def test_every_refusal_names_the_key_and_a_need_not_known_refuses_nothing():
    for transport, needs in NEEDS.items():
        assert refusal(transport, {}) is None
        for need in needs:
            assert refusal(transport, {need: False}) == (
                f"launch.weight_transport={transport} cannot be used: {UNMET[need]}"
            )
    assert refusal("auto", dict.fromkeys(UNMET, False)) is None
    assert [t for t in NEEDS if is_staged(t)] == ["cuda_ipc", "shm"]


def test_no_dev_shm_is_none_on_the_wire_and_picks_no_shared_memory(monkeypatch, tmp_path):
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path / "absent")
    assert shm.shm_free_bytes() is None
    here = place(shm_free=None)
    assert unpack_message(pack_message(here), SyncPlace).shm_free is None  # Optional field
    transport, why = choose_transport(here, place(), "auto", version_bytes=GB)
    assert transport == "gloo" and "no /dev/shm" in why
    with pytest.raises(ValueError, match="no /dev/shm, a version: 1073741824 bytes"):
        choose_transport(here, place(), "shm", version_bytes=GB)
    assert place_of(torch.device("cpu")).shm_free is None  # what a join says of this machine
