"""A run checkpointed at step 3 and resumed continues at version 4, with the optimizer state
and the learning-rate schedule, and trains on prompts that neither repeat nor skip the ones
before the checkpoint."""

import json

import pytest

from asyncrl.config import load_config
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl

pytestmark = pytest.mark.integration


def _rows(samples):
    return [int(g.split("-")[0]) for s in samples for g in s["group_ids"]]


def _common(tmp_path) -> list[str]:
    """A short run on a small warm-start, without final weights."""
    return [
        f"trainer.cache_dir={tmp_path / 'cache'}",
        "trainer.warmstart_steps=50",
        "data.train_batch_size=4",
        "rollout.n=4",
        "launch.progress=none",
        "trainer.save_final=false",
    ]


def test_checkpoint_and_resume(tmp_path):
    common = [
        *_common(tmp_path),
        "trainer.log_samples=true",
        "trainer.total_steps=6",
        "learner.warmup_steps=4",
        "learner.lr=5e-4",
    ]
    first = launch(
        load_config(
            overrides=[*common, f"trainer.run_dir={tmp_path / 'a'}", "trainer.save_every=3"]
        )
    )
    ckpt = first / "checkpoints" / "step_3"
    assert json.loads((ckpt / "trainer.json").read_text())["version"] == 3
    data = json.loads((ckpt / "replay.json").read_text())

    second = launch(
        load_config(
            overrides=[*common, f"trainer.run_dir={tmp_path / 'b'}", f"trainer.resume_from={ckpt}"]
        )
    )
    rows = read_jsonl(second / "metrics.jsonl")
    assert [r["version"] for r in rows] == [4, 5, 6]
    # the schedule continues where it stopped: learner steps 3, 4, 5 of a 4-step warmup
    assert [r["lr"] for r in rows] == pytest.approx([4e-4, 5e-4, 5e-4])

    before = _rows(read_jsonl(first / "samples.jsonl")[:3])
    after = _rows(read_jsonl(second / "samples.jsonl"))
    assert not set(before) & set(after), "a prompt trained before the checkpoint came back"
    pending = {int(p["group_id"].split("-")[0]) for p in data["pending"]}
    drawn = data["rows_drawn"]
    # what the resumed run trains is what was leased but untrained at the checkpoint, then
    # fresh rows from where the stream stopped: nothing is skipped
    assert set(after) <= pending | set(range(drawn, drawn + len(after)))
    first_batch = set(_rows(read_jsonl(second / "samples.jsonl")[:1]))
    assert first_batch <= pending or len(pending) < 4


def test_a_single_rank_checkpoint_resumes_on_two_ranks(tmp_path):
    """One fp32 rank trains a plain (unsharded) module; its checkpoint loads into a 2-rank FSDP
    learner with exactly the weights it saved (the checksum of version 3 matches)."""
    common = [*_common(tmp_path), "learner.weight_checksum=true"]
    first = launch(
        load_config(
            overrides=[
                *common,
                f"trainer.run_dir={tmp_path / 'a'}",
                "trainer.save_every=3",
                "trainer.total_steps=3",
            ]
        )
    )
    ckpt = first / "checkpoints" / "step_3"
    second = launch(
        load_config(
            overrides=[
                *common,
                f"trainer.run_dir={tmp_path / 'b'}",
                f"trainer.resume_from={ckpt}",
                "trainer.total_steps=4",
                "learner.world_size=2",
            ]
        )
    )
    saved = {r["version"]: r["checksum"] for r in read_jsonl(first / "weights_learner.jsonl")}
    resumed = {r["version"]: r["checksum"] for r in read_jsonl(second / "weights_learner.jsonl")}
    assert resumed[3] == saved[3]
    assert [r["version"] for r in read_jsonl(second / "metrics.jsonl")] == [4]


def test_a_lora_checkpoint_resumes_with_its_adapters(tmp_path):
    """The resumed learner sends the adapters it had at the checkpoint (the same checksum as
    the first run's at that version), and the server's delivery check accepts them."""
    common = [*_common(tmp_path), "learner.lora.rank=4", "learner.lr=5e-3"]
    common.append("learner.weight_checksum=true")
    first = launch(
        load_config(
            overrides=[
                *common,
                f"trainer.run_dir={tmp_path / 'a'}",
                "trainer.total_steps=3",
                "trainer.save_every=3",
            ]
        )
    )
    second = launch(
        load_config(
            overrides=[
                *common,
                f"trainer.run_dir={tmp_path / 'b'}",
                "trainer.total_steps=4",
                f"trainer.resume_from={first / 'checkpoints' / 'step_3'}",
            ]
        )
    )
    a = {r["version"]: r["checksum"] for r in read_jsonl(first / "weights_learner.jsonl")}
    b = {r["version"]: r["checksum"] for r in read_jsonl(second / "weights_learner.jsonl")}
    assert b[3] == a[3] != a[0]
    assert [r["version"] for r in read_jsonl(second / "metrics.jsonl")] == [4]
