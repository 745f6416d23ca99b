"""Automatic resume (`asyncrl.launch.resume`): which failures restart the run, how often and
after what wait, from which checkpoint, and the rewind that leaves each step recorded once.
The attempts are fakes that write what a learner would; the real processes are in
tests/integration/test_auto_resume.py."""

import json
from pathlib import Path

import pytest

from asyncrl.checkpoints import PARTS, TRAINER_FILE
from asyncrl.config import Config, load_config
from asyncrl.launch.fleet import LaunchError, prepare_run_dir
from asyncrl.launch.resume import resumable, run_with_resumes
from asyncrl.launch.rewind import RESUMES_FILE, RestartPoint, restart_point, rewind_records
from asyncrl.metrics import read_jsonl
from asyncrl.wire.auth import read_secret

KILLED = "process learner_0 was killed by signal SIGKILL\nlast lines of learner_0.log:\n..."


def _config(run_dir: Path, *overrides: str, retries: int = 2) -> Config:
    return load_config(
        overrides=[
            f"trainer.run_dir={run_dir}",
            "trainer.save_every=3",
            f"trainer.auto_resume={retries}",
            "launch.restart_backoff_s=0.5",
            *overrides,
        ]
    )


def _checkpoint(run_dir: Path, step: int, partial: bool = False) -> Path:
    """A complete checkpoint directory as the learner leaves it (the parts' contents do not
    matter here, only that they exist and trainer.json holds the version)."""
    path = run_dir / "checkpoints" / f"step_{step}{'.partial' if partial else ''}"
    for part in PARTS:
        (path / part).parent.mkdir(parents=True, exist_ok=True)
        (path / part).write_text("x")
    (path / TRAINER_FILE).write_text(json.dumps({"version": step, "kl_coef": 0.0}))
    return path


def _write_steps(run_dir: Path, last: int, torn: bool = True) -> None:
    """The learner's per-step records through step `last` (validation at step 0 first)."""
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 0, "val/mean_score": 0.1}) + "\n")
        for s in range(1, last + 1):
            f.write(json.dumps({"step": s, "reward_mean": 0.5}) + "\n")
        if torn:
            f.write('{"step": 9, "rew')  # killed in the middle of a write
    with (run_dir / "samples.jsonl").open("a") as f:
        f.writelines(
            json.dumps({"step": s, "traj_ids": [f"t{s}"]}) + "\n" for s in range(1, last + 1)
        )
    with (run_dir / "weights_learner.jsonl").open("a") as f:
        f.writelines(
            json.dumps({"version": v, "checksum": f"c{v}"}) + "\n" for v in range(last + 1)
        )


def _steps(run_dir: Path, name: str, key: str = "step") -> list[int]:
    return [r[key] for r in read_jsonl(run_dir / name)]


class _Attempts:
    """A fake `run_attempt`: each call records its config and what the run directory held
    when it started, then plays the next scripted outcome (an exception, or a finished run)."""

    def __init__(self, run_dir: Path, outcomes: list):
        self.run_dir, self.outcomes = run_dir, list(outcomes)
        self.configs: list[Config] = []
        self.metrics_at_start: list[list[int]] = []
        self.secrets: list[bytes] = []

    def __call__(self, cfg: Config) -> None:
        self.configs.append(cfg)
        self.metrics_at_start.append(_steps(self.run_dir, "metrics.jsonl"))
        self.secrets.append(read_secret(self.run_dir))
        outcome = self.outcomes.pop(0)
        if callable(outcome):
            outcome()
        elif outcome is not None:
            raise outcome


def _died(*failed: str) -> LaunchError:
    return LaunchError(f"process {failed[0]} was killed by signal SIGKILL\n...", failed)


def _run(cfg: Config, attempts: _Attempts) -> tuple[list[float], list[str]]:
    run_dir = prepare_run_dir(cfg, "asyncrl launch x=1")
    sleeps, lines = [], []
    run_with_resumes(cfg, run_dir, "asyncrl launch x=1", attempts, sleeps.append, lines.append)
    return sleeps, lines


@pytest.mark.parametrize(
    ("failed", "resumes"),
    [
        (("learner_0",), True),
        (("learner_1", "learner_0", "server_0"), True),
        (("replay", "server_0"), True),
        (("server_1", "learner_0"), False),  # servers are the fleet's own business
        ((), False),  # a start that timed out: no death to mend
    ],
)
def test_which_failures_resume(failed, resumes):
    assert resumable(LaunchError("x", failed)) is resumes


def test_a_learner_death_resumes_from_the_newest_checkpoint_with_records_rewound(tmp_path):
    run_dir = tmp_path / "run"
    cfg = _config(run_dir, "trainer.val_before_train=true")

    def dies_after_step_5():  # checkpoints at 3 (and an unfinished one at 6), records to 5
        _checkpoint(run_dir, 3)
        _checkpoint(run_dir, 6, partial=True)
        _write_steps(run_dir, 5)
        raise _died("learner_0", "server_0")

    attempts = _Attempts(run_dir, [dies_after_step_5, None])
    sleeps, lines = _run(cfg, attempts)

    ckpt = (run_dir / "checkpoints" / "step_3").resolve()
    assert lines == [
        f"asyncrl: learner_0 was killed by signal SIGKILL; resuming from {ckpt} (step 3), "
        "attempt 1/2"
    ]
    assert sleeps == [0.5]
    # the restart began with each step recorded once: the dead attempt's steps 4-5 are gone
    # (and the torn line); the learner writes the checkpoint's weights (version 3) again
    assert attempts.metrics_at_start[1] == [0, 1, 2, 3]
    assert _steps(run_dir, "samples.jsonl") == [1, 2, 3]
    assert _steps(run_dir, "weights_learner.jsonl", "version") == [0, 1, 2]
    assert not (run_dir / "checkpoints" / "step_6.partial").exists()
    # the second attempt resumes in the same directory, without validating again; its
    # processes read the same thing from config.yaml, and a fresh secret fences the dead ones
    resumed = attempts.configs[1].trainer
    assert (resumed.resume_from, resumed.run_dir, resumed.val_before_train) == (
        str(ckpt),
        str(run_dir),
        False,
    )
    on_disk = load_config(run_dir / "config.yaml").trainer
    assert (on_disk.resume_from, on_disk.val_before_train) == (str(ckpt), False)
    assert (
        (run_dir / "config.yaml")
        .read_text()
        .startswith(f"# asyncrl launch x=1 trainer.run_dir={run_dir} trainer.resume_from={ckpt}")
    )
    assert attempts.secrets[0] != attempts.secrets[1]
    [record] = read_jsonl(run_dir / RESUMES_FILE)
    assert record["failed"] == "learner_0" and record["followers"] == ["server_0"]
    assert record["why"] == "learner_0 was killed by signal SIGKILL"
    assert (record["checkpoint"], record["step"], record["attempt"]) == (str(ckpt), 3, 1)
    assert record["rewound"] == {"metrics.jsonl": 3, "samples.jsonl": 2, "weights_learner.jsonl": 3}


def test_retries_run_out_then_the_last_failure_is_raised(tmp_path):
    run_dir = tmp_path / "run"
    last = _died("replay")
    attempts = _Attempts(run_dir, [_died("learner_0"), _died("learner_0"), last, None])
    with pytest.raises(LaunchError) as raised:
        _run(_config(run_dir, retries=2), attempts)
    assert raised.value is last
    assert len(attempts.configs) == 3  # the first try and two resumes
    assert len(read_jsonl(run_dir / RESUMES_FILE)) == 2


def test_the_backoff_doubles_with_each_attempt(tmp_path):
    run_dir = tmp_path / "run"
    attempts = _Attempts(run_dir, [_died("learner_0")] * 3 + [None])
    sleeps, lines = _run(_config(run_dir, retries=3), attempts)
    assert sleeps == [0.5, 1.0, 2.0]
    assert [line.rsplit(" ", 1)[1] for line in lines] == ["1/3", "2/3", "3/3"]


@pytest.mark.parametrize(
    ("retries", "failure"),
    [
        (2, LaunchError(KILLED.replace("learner_0", "server_0"), ["server_0", "learner_0"])),
        (0, LaunchError(KILLED, ["learner_0"])),
        (2, KeyboardInterrupt()),  # Ctrl-C (and SIGTERM, which the CLI turns into it)
        (2, RuntimeError("a bug in the launcher")),
    ],
)
def test_what_is_not_resumed_ends_the_run_at_once(tmp_path, retries, failure):
    run_dir = tmp_path / "run"
    attempts = _Attempts(run_dir, [failure, None])
    with pytest.raises(type(failure)):
        _run(_config(run_dir, retries=retries), attempts)
    assert len(attempts.configs) == 1
    assert not (run_dir / RESUMES_FILE).exists()


def test_without_a_checkpoint_the_run_restarts_from_the_start(tmp_path):
    """Nothing the dead attempt recorded survives: the restart writes every step again."""
    run_dir = tmp_path / "run"

    def dies_at_step_2():
        _write_steps(run_dir, 2)
        raise _died("learner_0")

    attempts = _Attempts(run_dir, [dies_at_step_2, None])
    _, lines = _run(_config(run_dir, "trainer.val_before_train=true"), attempts)
    assert lines[0].endswith("resuming from the start, attempt 1/2")
    assert attempts.metrics_at_start[1] == []
    assert _steps(run_dir, "weights_learner.jsonl", "version") == []
    restarted = attempts.configs[1].trainer
    assert restarted.resume_from is None and restarted.val_before_train
    assert restarted.run_dir == str(run_dir)


def test_a_run_dir_with_time_is_not_expanded_again(tmp_path):
    cfg = _config(tmp_path / "runs" / "{time}")
    run_dir = prepare_run_dir(cfg, "asyncrl launch")
    attempts = _Attempts(run_dir, [_died("learner_0"), None])
    run_with_resumes(cfg, run_dir, "asyncrl launch", attempts, lambda s: None, lambda s: None)
    assert attempts.configs[1].trainer.run_dir == str(run_dir)
    assert list((tmp_path / "runs").iterdir()) == [run_dir]


def test_the_restart_point_is_the_newest_complete_checkpoint(tmp_path):
    run_dir, other = tmp_path / "run", tmp_path / "other"
    started_from = _checkpoint(other, 6)
    cfg = _config(run_dir, f"trainer.resume_from={started_from}")
    # the run started from another run's step 6 and has no checkpoint of its own yet
    assert restart_point(cfg, run_dir) == RestartPoint(started_from.resolve(), 6)
    _checkpoint(run_dir, 9)
    _checkpoint(run_dir, 12, partial=True)  # unfinished: never a restart point
    assert restart_point(cfg, run_dir) == RestartPoint(
        (run_dir / "checkpoints/step_9").resolve(), 9
    )


def test_the_rewind_keeps_records_without_a_step_and_is_idempotent(tmp_path):
    _write_steps(tmp_path, 4, torn=False)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"note": "no step"}) + "\n")
    point = RestartPoint(_checkpoint(tmp_path, 2), 2)
    assert rewind_records(tmp_path, point)["metrics.jsonl"] == 2
    assert rewind_records(tmp_path, point) == dict.fromkeys(
        ["metrics.jsonl", "samples.jsonl", "weights_learner.jsonl"], 0
    )
    assert [r.get("step") for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, None]


def test_the_backoff_is_capped():
    from asyncrl.launch.fleet import MAX_BACKOFF_S
    from asyncrl.launch.resume import backoff_s

    cfg = Config.model_validate({"launch": {"restart_backoff_s": 2.0}})
    assert [backoff_s(cfg, a) for a in (1, 2, 3)] == [2.0, 4.0, 8.0]
    assert backoff_s(cfg, 30) == MAX_BACKOFF_S  # not 2 * 2**29 s
