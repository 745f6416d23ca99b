"""Learner rank 0's validation breaks off for a restarted server that waits to join the weight
sync, and the next call waits for the same job (issue 40: with one rollout server the job's
prompts wait for the restart, and the restart for its weights, so waiting on would hold the
run until `trainer.val_timeout_s`). On fakes of the replay client and the sync fleet."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from asyncrl.config import load_config
from asyncrl.wire.protocol import EvalResults
from learner.leader import Leader


class _Replay:
    """An evaluation job of two samples, both scored by the third poll."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.polls = 0

    def submit_eval(self, job_id: str, prompts: list) -> None:
        self.submitted.append(job_id)

    def poll_eval(self, job_id: str) -> EvalResults:
        self.polls += 1
        done = 2 if self.polls >= 3 else 0
        return EvalResults(
            1,
            job_id,
            2,
            ["g0"] * done,
            ["src"] * done,
            np.ones(done, np.float32),
            np.full(done, 3, np.int32),
            np.zeros(done, np.int32),
        )


class _Fleet:
    """A restarted server waits to join at the first question only."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def joins_waiting(self, version: int) -> bool:
        self.asked.append(version)
        return len(self.asked) == 1


def test_validation_breaks_off_for_a_join_then_waits_for_the_same_job(tmp_path: Path):
    cfg = load_config(None, ["trainer.val_every=5"])
    replay, fleet = _Replay(), _Fleet()
    rows = [{"prompt": [{"role": "user", "content": "1+1"}], "data_source": "src"}]
    rows[0]["reward_model"] = {"ground_truth": "2", "style": "rule"}
    leader = Leader(cfg, tmp_path, replay, fleet, None, None, rows, None, None)  # type: ignore[arg-type]

    assert leader.validate(5) == {} and leader.joins_waiting()
    assert leader.validate(5)["val/mean_score"] == 1.0 and not leader.joins_waiting()
    assert len(replay.submitted) == 1  # one job, waited for twice
    assert fleet.asked == [5, 5, 5] and replay.polls == 3
