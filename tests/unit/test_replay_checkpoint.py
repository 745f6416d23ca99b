"""The replay's state in a checkpoint (replay.checkpoint) and the checkpoint's atomicity
(asyncrl.checkpoints, learner.checkpoint): every field survives the file, a resumed replay trains
the ready groups instead of generating them again, leases again what was in flight, continues
the data stream without repeating or skipping a row, and answers a resend `duplicate`; a
checkpoint without every part is never resumed from."""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.checkpoints import (
    REPLAY_FILE,
    TRAINER_FILE,
    IncompleteCheckpoint,
    check_complete,
    checkpoint_dir,
    latest_checkpoint,
    partial_dir,
)
from asyncrl.config import Config, load_config
from asyncrl.wire.protocol import LeaseRequest, PromptItem
from asyncrl.wire.samples import Trajectory
from learner.checkpoint import load_checkpoint, save_checkpoint
from replay.access import AccessRules
from replay.admission import AdmissionController
from replay.buffer import GroupBuffer
from replay.checkpoint import decode_state, encode_state, read_state, write_state
from replay.eval_jobs import EvalJobs
from replay.leases import LeaseDesk, LeaseRules
from replay.prompts import setup_prompt_source

B, N = 2, 2  # groups per batch, samples per group


def _desk() -> LeaseDesk:
    cfg = Config.model_validate(
        {
            "rollout": {"n": N, "max_concurrent_groups": 16},
            "data": {"train_batch_size": B},
            "replay": {"max_staleness": 2, "lease_timeout_s": 60.0},
        }
    )
    rules, admission = LeaseRules.from_config(cfg), AdmissionController.from_config(cfg)
    return LeaseDesk(
        rules, admission, setup_prompt_source(cfg), GroupBuffer(), EvalJobs(60.0), Counter()
    )


def _traj(item: PromptItem, index: int, versions: tuple[int, ...]) -> Trajectory:
    r = len(versions)
    return Trajectory(
        traj_id=f"{item.group_id}/{index}",
        attempt=0,
        group_id=item.group_id,
        sample_index=index,
        server_id=0,
        prompt_ids=np.array([1, 2, 3], np.int32),
        response_ids=np.arange(r, dtype=np.int32) + 10 * index,
        loss_mask=np.ones(r, np.uint8),
        behaviour_logprobs=np.linspace(-1, -0.1, r).astype(np.float32),
        versions=np.asarray(versions, np.int32),
        reward=float(index),
        baseline_reward=float("nan"),
        finish_reason="stop",
        metrics={"turns": 1.0 + index},
    )


def _row(item: PromptItem) -> int:
    return int(item.group_id.split("-")[0])


@pytest.fixture
def desk_at_checkpoint() -> tuple[LeaseDesk, dict]:
    """A desk at learner version 3 holding two ready groups (the second leased at 3, its samples
    spanning versions 4..6), one group in flight with one sample of two, and one expired lease."""
    desk = _desk()
    desk.counters["batches_served"] = 3
    items = desk.grant(LeaseRequest(1, 0, 3, 4))  # rows 0..3 (issued counts from 0 here)
    assert [_row(p) for p in items] == [0, 1, 2, 3]
    a, b, partial, expiring = items
    for i in range(N):
        assert desk.buffer.add(_traj(a, i, (3, 3))) == "accepted"
        assert desk.buffer.add(_traj(b, i, (5, 6) if i else (4, 5, 5))) == "accepted"
    assert desk.buffer.add(_traj(partial, 0, (4,))) == "accepted"
    desk.buffer._groups[expiring.group_id].opened_at -= 3600  # its server went silent
    assert desk.expire(time.monotonic()) == 1
    return desk, {"ready": [a, b], "partial": partial, "expired": expiring}


def test_every_field_survives_the_file(desk_at_checkpoint, tmp_path):
    desk, groups = desk_at_checkpoint
    state = desk.data_state(version=3)
    write_state(tmp_path / REPLAY_FILE, state)
    back = read_state(tmp_path / REPLAY_FILE)

    assert (back.version, back.rows_drawn) == (3, 4)
    assert back.prompt_source == state.prompt_source == desk.prompts.state()
    assert back.reissue == state.reissue == [groups["partial"], groups["expired"]]
    assert back.seen_ids == state.seen_ids and len(back.seen_ids) == 2 * N + 1
    assert back.counters == state.counters and back.counters["batches_served"] == 3
    assert back.counters["expired"] == 1
    assert [g.item for g in back.ready] == groups["ready"]
    for saved, original in zip(back.ready, state.ready, strict=True):
        assert (saved.lease_version, saved.server_id) == (original.lease_version, 0)
        assert saved.latencies == pytest.approx(original.latencies)
        assert len(saved.samples) == N
        for got, want in zip(saved.samples, original.samples, strict=True):
            assert got.traj_id == want.traj_id and got.metrics == want.metrics
            assert got.reward == want.reward and np.isnan(got.baseline_reward)
            for name in ("prompt_ids", "response_ids", "loss_mask", "versions"):
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
            np.testing.assert_array_equal(got.behaviour_logprobs, want.behaviour_logprobs)


def test_a_resumed_replay_trains_the_ready_groups_and_leases_the_rest_again(desk_at_checkpoint):
    desk, groups = desk_at_checkpoint
    state = decode_state(encode_state(desk.data_state(version=3)))
    resumed = _desk()
    assert resumed.restore(state) == 3
    buf = resumed.buffer
    assert (buf.num_ready, buf.num_in_flight) == (2, 0)
    # issued = trained before (3 batches of B) + ready: admission goes on where it stopped
    assert resumed.admission.issued == 3 * B + 2
    assert resumed.counters["batches_served"] == 3

    taken, stale = buf.pop_batch(learner_version=5, num_groups=2, max_staleness=2)
    assert stale == 0
    assert [g.item.group_id for g in taken] == [p.group_id for p in groups["ready"]]
    # a group's version is its oldest sampled token's, recomputed (not its lease version, 3)
    assert [g.version for g in taken] == [3, 4]
    assert [t.traj_id for t in taken[1].samples] == [
        f"{groups['ready'][1].group_id}/{i}" for i in range(N)
    ]

    # what was in flight or expired is leased again first (same rows, new group ids), then the
    # stream continues at row 4: nothing repeated, nothing skipped
    again = resumed.grant(LeaseRequest(2, 0, 3, 3))
    assert [_row(p) for p in again] == [2, 3, 4]
    assert again[0].messages == groups["partial"].messages
    assert again[0].group_id != groups["partial"].group_id
    assert resumed.counters["leases_reissued"] == 2


def test_a_resend_after_the_resume_is_a_duplicate_or_late(desk_at_checkpoint):
    desk, groups = desk_at_checkpoint
    resumed = _desk()
    resumed.restore(decode_state(encode_state(desk.data_state(version=3))))
    a, partial = groups["ready"][0], groups["partial"]
    assert resumed.buffer.add(_traj(a, 0, (3, 3))) == "duplicate"  # ready: kept once
    assert resumed.buffer.add(_traj(partial, 0, (4,))) == "duplicate"  # seen before
    assert resumed.buffer.add(_traj(partial, 1, (4,))) == "late"  # its lease is gone
    resumed.buffer.pop_batch(3, 2, 2)  # trained after the resume: a resend is still kept out
    assert resumed.buffer.add(_traj(a, 1, (3, 3))) == "duplicate"


def test_a_damaged_state_file_is_refused_naming_it(desk_at_checkpoint, tmp_path):
    desk, _ = desk_at_checkpoint
    path = tmp_path / REPLAY_FILE
    data = encode_state(desk.data_state(version=3))
    path.write_bytes(data[: len(data) // 2])  # a partial write
    with pytest.raises(IncompleteCheckpoint, match=str(path)):
        read_state(path)
    with pytest.raises(IncompleteCheckpoint, match="missing.msgpack"):
        read_state(tmp_path / "missing.msgpack")
    # a sample whose arrays were altered fails the codec's checks, as from a peer
    tampered = data.replace(b"<i4", b"<i8", 1)
    path.write_bytes(tampered)
    with pytest.raises(IncompleteCheckpoint, match="dtype"):
        read_state(path)


# ---- atomicity ------------------------------------------------------------------------------


class _FakeReplay:
    """The replay's side of a checkpoint: writes a state file where the replay of `run_dir`
    would (the path it is sent, resolved against its run directory by the replay's own rule,
    `AccessRules.checkpoint_path`), or dies before it can."""

    def __init__(self, run_dir: Path, alive: bool = True) -> None:
        self.rules, self.alive = AccessRules(b"s" * 32, 1, run_dir), alive

    def checkpoint(self, path: str, version: int) -> None:
        if not self.alive:
            raise TimeoutError("the replay did not answer")
        write_state(self.rules.checkpoint_path(path), _desk().data_state(version))


def _modules():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), None, None


def _save(run_dir, version, replay, modules=None) -> None:
    modules = modules or _modules()
    save_checkpoint(run_dir, version, 0, 1, modules, replay, {"kl_coef": 0.1})


def test_a_checkpoint_exists_only_once_every_part_is_in(tmp_path):
    _save(tmp_path, 3, _FakeReplay(tmp_path))
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 3)
    check_complete(checkpoint_dir(tmp_path, 3))
    with pytest.raises(TimeoutError):  # the learner dies between its shards and the replay's
        _save(tmp_path, 6, _FakeReplay(tmp_path, alive=False))
    assert not checkpoint_dir(tmp_path, 6).exists() and partial_dir(tmp_path, 6).is_dir()
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 3)
    _save(tmp_path, 6, _FakeReplay(tmp_path))  # a later attempt clears what the dead one left
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 6)
    assert not partial_dir(tmp_path, 6).exists()


def test_the_replays_part_lands_in_a_checkpoint_of_a_relative_run_directory(tmp_path, monkeypatch):
    """The default trainer.run_dir is relative (`runs/{time}`). The learner names the replay's
    file relative to the run directory, as the replay reads it: before issue 40 it sent
    `runs/x/checkpoints/...`, the replay joined that onto `runs/x` again, and the checkpoint
    failed, its replay.msgpack missing (written to runs/x/runs/x/...)."""
    monkeypatch.chdir(tmp_path)
    run_dir = Path("runs/x")
    save_checkpoint(run_dir, 2, 0, 1, _modules(), _FakeReplay(run_dir), {})
    check_complete(checkpoint_dir(run_dir, 2))
    assert latest_checkpoint(run_dir) == checkpoint_dir(run_dir, 2)
    assert not (run_dir / "runs").exists()


def test_a_checkpoint_missing_a_part_is_refused_naming_the_file(tmp_path):
    modules = _modules()
    with torch.no_grad():
        modules[0].weight.fill_(0.5)
    _save(tmp_path, 3, _FakeReplay(tmp_path), modules)
    _save(tmp_path, 6, _FakeReplay(tmp_path))
    ckpt = checkpoint_dir(tmp_path, 6)
    (ckpt / REPLAY_FILE).unlink()
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 3)
    with pytest.raises(IncompleteCheckpoint, match=str(ckpt / REPLAY_FILE)):
        load_checkpoint(ckpt, _modules())
    with pytest.raises(ValueError, match=str(ckpt / REPLAY_FILE)):
        load_config(overrides=[f"trainer.resume_from={ckpt}"])
    (checkpoint_dir(tmp_path, 3) / TRAINER_FILE).rename(tmp_path / "elsewhere.json")
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "elsewhere.json").rename(checkpoint_dir(tmp_path, 3) / TRAINER_FILE)
    restored = _modules()
    trainer = load_checkpoint(checkpoint_dir(tmp_path, 3), restored)
    assert trainer == {"version": 3, "kl_coef": 0.1}
    assert torch.equal(restored[0].weight, torch.full((2, 3), 0.5))


def test_keep_checkpoints_deletes_all_but_the_newest_complete_ones(tmp_path):
    """`trainer.keep_checkpoints=2`: after each save only the two newest complete checkpoints
    stay; a `.partial` one (being written) and an incomplete one are not counted or touched, the
    newest stays resumable, and the one the run resumed from is never deleted."""
    from asyncrl.checkpoints import complete_checkpoints, prune

    for version in (2, 4):
        save_checkpoint(tmp_path, version, 0, 1, _modules(), _FakeReplay(tmp_path), {}, keep=2)
    partial_dir(tmp_path, 9).mkdir()  # another attempt's, still being written
    damaged = checkpoint_dir(tmp_path, 1)
    damaged.mkdir()  # lacks every part: not a checkpoint
    save_checkpoint(tmp_path, 6, 0, 1, _modules(), _FakeReplay(tmp_path), {}, keep=2)
    assert complete_checkpoints(tmp_path) == [checkpoint_dir(tmp_path, v) for v in (4, 6)]
    assert partial_dir(tmp_path, 9).is_dir() and damaged.is_dir()
    assert not list((tmp_path / "checkpoints").glob("*.deleting"))
    # a prune that died mid-delete leaves `step_<v>.deleting`, every part possibly still in:
    # never taken for a checkpoint
    half_deleted = checkpoint_dir(tmp_path, 8).with_name("step_8.deleting")
    shutil.copytree(checkpoint_dir(tmp_path, 6), half_deleted)
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 6)
    assert load_checkpoint(latest_checkpoint(tmp_path), _modules())["version"] == 6
    # the checkpoint the run resumed from stays, whatever keep says: its config.yaml names it
    # (trainer.resume_from), and loading that config checks it is complete
    assert prune(tmp_path, 1, spare=checkpoint_dir(tmp_path, 4)) == []
    assert prune(tmp_path, 1) == [checkpoint_dir(tmp_path, 4)]
    with pytest.raises(ValueError, match="keep=0"):
        prune(tmp_path, 0)
