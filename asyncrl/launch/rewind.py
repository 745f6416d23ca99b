"""What a restart from a checkpoint does to its run directory, shared by the automatic resume
(`asyncrl.launch.resume.run_with_resumes`) and the resume by hand
(`asyncrl.launch.resume.resume_in_place`).

1. The restart point (`restart_point`): the newest complete checkpoint of the run directory,
   or the run's own `trainer.resume_from` when that one is newer; none: from the start.
2. The rewind (`rewind_records`): the per-step records (`STEP_LOGS`) lose what was written
   past that step, so that the run's records read like one run: each step once, written by the
   attempt that got past it. The lines that go are kept in `rewound/` beside them.
3. The newer checkpoints are set aside (`set_aside_newer`), never resumed from.
4. The resumed config (`resumed_config`): the same run directory, from the restart point, no
   second validation before training.

Records that are timelines, not steps, keep the dead attempt's events, as they happened:
`logs/` (appended to), `trace/`, `rollout_metrics.jsonl`, `weights_server_*.jsonl` and
`sync_members.jsonl`.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.checkpoints import (
    TRAINER_FILE,
    complete_checkpoints,
    latest_checkpoint,
    missing_parts,
)
from asyncrl.config import Config

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
    returns how many lines went. The lines that go are kept, not deleted, in
    `rewound/<time>-<name>` beside it (with the checkpoints set aside, a rewound future stays
    whole for whoever wants it back)."""
    lines = path.read_text().splitlines(keepends=True)
    left, gone = [], []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if line.endswith("\n") and isinstance(record, dict) and keep(record):
            left.append(line)
        else:
            gone.append(line)
    if gone:
        rewound = path.parent / "rewound"
        rewound.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        with open(rewound / f"{stamp}-{path.name}", "a") as f:
            f.write("".join(gone))
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


def set_aside_newer(run_dir: Path, point: RestartPoint) -> list[Path]:
    """Move the complete checkpoints newer than `point` into
    `checkpoints/set_aside-<time>/`: they belong to the steps the resume takes back, so nothing
    may resume from them, but they are the user's to delete. Returns their new paths."""
    newer = [p for p in complete_checkpoints(run_dir) if checkpoint_step(p) > point.step]
    if not newer:
        return []
    aside = run_dir / "checkpoints" / f"set_aside-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(exist_ok=True)
    for path in newer:
        path.rename(aside / path.name)
    return [aside / p.name for p in newer]
