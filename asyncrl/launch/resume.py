"""Automatic resume (`trainer.auto_resume=R`): when the learner (any rank) or the replay dies,
the launcher restarts the whole run, in the same run directory, from its newest complete
checkpoint, at most R times; then it fails with the last failure.

Why the whole run: the learner's weights and optimizer and the replay's state agree only at a
checkpoint (both are taken at version v, `asyncrl.checkpoints`), so a learner or replay death
throws away what either did since, and every process starts again from that checkpoint. A
rollout server's death is not handled here: the fleet restarts a server by itself, and a
failure whose first member is a server (its restarts spent) ends the run.

What `run_with_resumes` does after a resumable failure (the fleet is already stopped):
1. the restart point (`restart_point`): the newest complete checkpoint of the run directory,
   or the run's own `trainer.resume_from` when that one is newer; none: from the start;
2. rewinds the per-step records (`STEP_LOGS`) past that step, so that the run's records read
   like one run: each step once, written by the attempt that got past it;
3. appends a record to `run_dir/resumes.jsonl` and prints a line naming the death;
4. waits `launch.restart_backoff_s`, doubled for each attempt after the first;
5. writes the resumed config (`trainer.resume_from` at the restart point, no second
   validation before training) with a command on top that would do the same, and a new run
   secret (`prepare_run_dir`): every process of the restarted run derives its key from it,
   and anything left of the dead attempt holds a key nobody accepts any more.
An interrupt (Ctrl-C, SIGTERM) is not a failure: it propagates at any point, never resumed.

Records that are timelines, not steps, keep the dead attempt's events, as they happened:
`logs/` (appended to), `trace/`, `rollout_metrics.jsonl`, `weights_server_*.jsonl` and
`sync_members.jsonl`.
"""

from __future__ import annotations

import functools
import json
import shlex
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.checkpoints import TRAINER_FILE, latest_checkpoint, missing_parts
from asyncrl.config import Config
from asyncrl.launch.fleet import MAX_BACKOFF_S, LaunchError, prepare_run_dir
from asyncrl.metrics import JsonlWriter

RESUMES_FILE = "resumes.jsonl"


@dataclass(frozen=True)
class StepLog:
    """A JSON-lines file in which the learner writes records keyed by step or version."""

    name: str  # its path under the run directory
    key: str  # the field holding the step (or version) of a record
    rewritten: bool  # a resumed learner writes the record of the checkpoint's step again


STEP_LOGS = (
    StepLog("metrics.jsonl", "step", rewritten=False),
    StepLog("samples.jsonl", "step", rewritten=False),
    # the resumed learner broadcasts the checkpoint's weights as its version, and logs them
    StepLog("weights_learner.jsonl", "version", rewritten=True),
)


@dataclass(frozen=True)
class RestartPoint:
    checkpoint: Path | None  # None: from the start
    step: int  # the checkpoint's version (0 from the start)


def resumable(err: LaunchError) -> bool:
    """A failure that a restart from the checkpoint can mend: the first member to die is the
    replay or a learner rank (not a server, nor a start that timed out with no death)."""
    return bool(err.failed) and (err.failed[0] == "replay" or err.failed[0].startswith("learner_"))


def checkpoint_step(path: Path) -> int:
    """The version a complete checkpoint was taken at (its trainer.json)."""
    return int(json.loads((path / TRAINER_FILE).read_text())["version"])


def restart_point(cfg: Config, run_dir: Path) -> RestartPoint:
    """The newest complete checkpoint of `run_dir`, or the run's own `trainer.resume_from`
    (a checkpoint of another run it started from) when that is newer; else from the start."""
    found = [latest_checkpoint(run_dir)]
    if cfg.trainer.resume_from is not None and not missing_parts(cfg.trainer.resume_from):
        found.append(Path(cfg.trainer.resume_from))
    points = [RestartPoint(p.resolve(), checkpoint_step(p)) for p in found if p is not None]
    return max(points, key=lambda p: p.step, default=RestartPoint(None, 0))


def kept(record: dict[str, Any], log: StepLog, point: RestartPoint) -> bool:
    """Whether a restart from `point` leaves `record` of `log` in place: not from the start,
    and not past the point's step (nor at it, when the learner writes that one again)."""
    if point.checkpoint is None:
        return False
    step = record.get(log.key)
    return (
        not isinstance(step, int) or step < point.step or (step == point.step and not log.rewritten)
    )


def rewind_records(run_dir: Path, point: RestartPoint) -> dict[str, int]:
    """Drop from every `STEP_LOGS` file the records a restart from `point` writes again
    (`kept`), and a torn last line; remove the `.partial` checkpoints of the dead attempt.
    Returns how many lines each file lost."""
    dropped = {}
    for log in STEP_LOGS:
        path = run_dir / log.name
        if path.is_file():
            dropped[log.name] = rewind_jsonl(path, functools.partial(kept, log=log, point=point))
    for partial in (run_dir / "checkpoints").glob("step_*.partial"):  # never resumed from
        shutil.rmtree(partial)
    return dropped


def rewind_jsonl(path: Path, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Rewrite `path` (atomically) with only its complete records that `keep` accepts;
    returns how many lines went."""
    lines = path.read_text().splitlines(keepends=True)
    left = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if line.endswith("\n") and isinstance(record, dict) and keep(record):
            left.append(line)
    tmp = path.with_name(f".{path.name}.rewind")
    tmp.write_text("".join(left))
    tmp.replace(path)
    return len(lines) - len(left)


def resumed_config(cfg: Config, run_dir: Path, point: RestartPoint) -> Config:
    """The config of a restart: the same run directory (its `{time}` already expanded), from
    the checkpoint if there is one, without validating again before the first step (the
    records already hold that validation)."""
    update: dict[str, Any] = {"run_dir": str(run_dir)}
    if point.checkpoint is not None:
        update |= {"resume_from": str(point.checkpoint), "val_before_train": False}
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=update)})


def resumed_command(command: str, resumed: Config) -> str:
    """The command that runs `resumed` (written on top of its config.yaml)."""
    tc = resumed.trainer
    extra = [f"trainer.run_dir={tc.run_dir}"]
    if tc.resume_from is not None:
        extra += [f"trainer.resume_from={tc.resume_from}", "trainer.val_before_train=false"]
    return f"{command} {shlex.join(extra)}"


def backoff_s(cfg: Config, attempt: int) -> float:
    """The wait before resume `attempt` (1-based): launch.restart_backoff_s, doubled each time,
    at most MAX_BACKOFF_S."""
    return min(MAX_BACKOFF_S, cfg.launch.restart_backoff_s * 2 ** (attempt - 1))


def describe(err: LaunchError) -> str:
    """The first line of a failure report without the 'process ' in front of the name."""
    return str(err).partition("\n")[0].removeprefix("process ")


def run_with_resumes(
    cfg: Config,
    run_dir: Path,
    command: str,
    run_attempt: Callable[[Config], None],
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = print,
) -> None:
    """`run_attempt(cfg)` (start the fleets, watch them to the end, stop them), and again from
    the newest checkpoint after each resumable LaunchError, at most trainer.auto_resume times;
    then the last LaunchError propagates, as does any other error or an interrupt."""
    attempt_cfg, retries = cfg, cfg.trainer.auto_resume
    for attempt in range(1, retries + 2):
        try:
            run_attempt(attempt_cfg)
            return
        except LaunchError as err:
            if attempt > retries or not resumable(err):
                raise
            point = restart_point(cfg, run_dir)
            dropped = rewind_records(run_dir, point)
            record_resume(run_dir, err, point, attempt, retries, dropped)
            where = f"{point.checkpoint} (step {point.step})" if point.checkpoint else "the start"
            log(f"asyncrl: {describe(err)}; resuming from {where}, attempt {attempt}/{retries}")
            sleep(backoff_s(cfg, attempt))
            attempt_cfg = resumed_config(cfg, run_dir, point)
            prepare_run_dir(attempt_cfg, resumed_command(command, attempt_cfg))


def record_resume(
    run_dir: Path,
    err: LaunchError,
    point: RestartPoint,
    attempt: int,
    retries: int,
    dropped: dict[str, int],
) -> None:
    """One line in run_dir/resumes.jsonl: when, who died first and how, what followed, where
    the run resumes from, which attempt, and how many records the rewind dropped."""
    writer = JsonlWriter(run_dir / RESUMES_FILE)
    writer.write(
        {
            "time": time.time(),
            "failed": err.failed[0],
            "why": describe(err),
            "followers": list(err.failed[1:]),
            "checkpoint": None if point.checkpoint is None else str(point.checkpoint),
            "step": point.step,
            "attempt": attempt,
            "of": retries,
            "rewound": dropped,
        }
    )
    writer.close()
