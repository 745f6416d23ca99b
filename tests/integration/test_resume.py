"""A run checkpointed at step 3 and resumed continues at version 4, with the optimizer state,
the learning-rate schedule and the replay's state: the groups ready at the checkpoint are trained
after the resume (not generated again), and across the two runs no prompt is repeated or
skipped."""

import json
from collections import Counter
from pathlib import Path

import pytest

from asyncrl.checkpoints import REPLAY_FILE
from asyncrl.config import load_config
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl
from replay.checkpoint import read_state

pytestmark = pytest.mark.integration


def _row(group_id: str) -> int:
    return int(group_id.split("-")[0])


def _rows(samples):
    return [_row(g) for s in samples for g in s["group_ids"]]


def _common(cache: Path) -> list[str]:
    """A short run on a small warm-start, without final weights."""
    return [
        f"trainer.cache_dir={cache}",
        "trainer.warmstart_steps=50",
        "data.train_batch_size=4",
        "rollout.n=4",
        "launch.progress=none",
        "trainer.save_final=false",
    ]


def test_checkpoint_and_resume(tmp_path, model_cache):
    common = [
        *_common(model_cache),
        "trainer.log_samples=true",
        "trainer.total_steps=6",
        "trainer.save_every=3",
        "learner.warmup_steps=4",
        "learner.lr=5e-4",
    ]
    first = launch(load_config(overrides=[*common, f"trainer.run_dir={tmp_path / 'a'}"]))
    ckpt = first / "checkpoints" / "step_3"
    assert json.loads((ckpt / "trainer.json").read_text())["version"] == 3
    at_3 = read_state(ckpt / REPLAY_FILE)
    assert at_3.version == 3 and at_3.counters["batches_served"] == 3
    assert at_3.ready, "no group was ready at the checkpoint: the test would prove nothing"

    second = launch(
        load_config(
            overrides=[
                *common,
                f"trainer.run_dir={tmp_path / 'b'}",
                f"trainer.resume_from={ckpt}",
                "trainer.save_every=1",  # steps 4, 5, 6, of which only the newest is kept
                "trainer.keep_checkpoints=1",
            ]
        )
    )
    assert [p.name for p in (second / "checkpoints").iterdir()] == ["step_6"]
    rows = read_jsonl(second / "metrics.jsonl")
    assert [r["version"] for r in rows] == [4, 5, 6]
    # the schedule continues where it stopped: learner steps 3, 4, 5 of a 4-step warmup
    assert [r["lr"] for r in rows] == pytest.approx([4e-4, 5e-4, 5e-4])
    # the replay's counters go on from the checkpoint's
    stats = json.loads((second / "stats" / "replay.json").read_text())
    assert stats["batches_served"] == 6

    before = read_jsonl(first / "samples.jsonl")[:3]
    after = read_jsonl(second / "samples.jsonl")
    stale_after = sum(r["stale_dropped"] for r in rows)
    # the groups ready at the checkpoint are trained after the resume, their very samples
    # (only a group that became too stale meanwhile may be dropped, and is counted)
    trained_after = {t for s in after for t in s["traj_ids"]}
    kept = [g for g in at_3.ready if {t.traj_id for t in g.samples} <= trained_after]
    assert kept and len(kept) >= len(at_3.ready) - stale_after

    # no prompt repeated or skipped: the rows trained before the checkpoint and after the
    # resume, and those the replay still held at the end (its step-6 state), are every row
    # drawn, each once (less the groups dropped as stale, which are never trained)
    at_6 = read_state(second / "checkpoints" / "step_6" / REPLAY_FILE)
    held = [_row(g.item.group_id) for g in at_6.ready] + [_row(p.group_id) for p in at_6.reissue]
    seen = Counter(_rows(before) + _rows(after) + held)
    assert [r for r, k in seen.items() if k > 1] == [], "a prompt was repeated"
    stale = sum(r["stale_dropped"] for r in read_jsonl(first / "metrics.jsonl")[:3]) + stale_after
    assert set(seen) <= set(range(at_6.rows_drawn))
    assert len(set(range(at_6.rows_drawn)) - set(seen)) == stale, "a prompt was skipped"


@pytest.mark.long  # half a minute or more: its own CI step
def test_a_single_rank_checkpoint_resumes_on_two_ranks(tmp_path, model_cache):
    """One fp32 rank trains a plain (unsharded) module; its checkpoint loads into a 2-rank FSDP
    learner with exactly the weights it saved (the checksum of version 3 matches)."""
    common = [*_common(model_cache), "learner.weight_checksum=true"]
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


@pytest.mark.long  # half a minute or more: its own CI step
def test_a_lora_checkpoint_resumes_with_its_adapters(tmp_path, model_cache):
    """The resumed learner sends the adapters it had at the checkpoint (the same checksum as
    the first run's at that version), and the server's delivery check accepts them."""
    common = [*_common(model_cache), "learner.lora.rank=4", "learner.lr=5e-3"]
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
