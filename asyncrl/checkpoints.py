"""The layout of a checkpoint directory, shared by its writers (the learner's ranks and the
replay) and its readers (config validation, the learner and the replay on resume, and a
launcher looking for the newest checkpoint).

`run_dir/checkpoints/step_<v>/` (written every `trainer.save_every` steps, and when the launcher
is interrupted: `asyncrl.launch.interrupt`) holds, all taken at learner version v:
- `dcp/`: every learner rank's shards (`learner.checkpoint`); `dcp/.metadata` is written last;
- `replay.msgpack`: the replay's whole state (`replay.checkpoint`), which the learner asks
  for by its path relative to the run directory (`replay.access.AccessRules.checkpoint_path`);
- `trainer.json`: the version and the trainer's own state.

Atomicity: the parts are written into `step_<v>.partial/`, and learner rank 0 renames it to
`step_<v>` once all three are in (one `rename`, atomic on a POSIX filesystem). So a directory
named `step_<v>` is complete by construction, and a crash at any point before the rename leaves
the previous checkpoint the newest one (`latest_checkpoint`); a `.partial` directory is never
resumed from. `check_complete` still checks every part, so a directory someone assembled or
damaged by hand is refused with the name of what is missing.

Pruning (`trainer.keep_checkpoints=K`): once a checkpoint is published, `prune` deletes all but
the newest K complete ones and the one the run resumed from (its `trainer.resume_from`). Each
is first renamed out of the `step_<v>` pattern, then removed, so one half-deleted by a crash is
never taken for a checkpoint.

The final weights, `run_dir/final/` (`learner.checkpoint.save_final_weights`), are a Hugging
Face directory that also holds `FINAL_STEP_FILE`, the learner version they were taken at: a
finished run resumed to go further leaves its old final/ in place until it finishes again, so a
reader choosing between final/ and the newest checkpoint needs final/'s version
(`asyncrl.launch.eval_weights.run_weights`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

SHARDS_DIR = "dcp"
SHARDS_DONE = "dcp/.metadata"  # written by torch.distributed.checkpoint after every shard
REPLAY_FILE = "replay.msgpack"
TRAINER_FILE = "trainer.json"
PARTS = (SHARDS_DONE, REPLAY_FILE, TRAINER_FILE)
"""What a complete checkpoint directory holds (files, relative to it)."""

FINAL_STEP_FILE = "asyncrl_step.json"
"""In run_dir/final/: {"step": v}, the learner version of the final weights."""

_STEP = re.compile(r"step_(\d+)")


class IncompleteCheckpoint(ValueError):
    """A checkpoint directory that cannot be resumed from; the text names the file."""


def checkpoint_dir(run_dir: str | Path, version: int) -> Path:
    """Where the checkpoint of `version` lives once complete."""
    return Path(run_dir) / "checkpoints" / f"step_{version}"


def partial_dir(run_dir: str | Path, version: int) -> Path:
    """Where the parts of `version`'s checkpoint are written before `publish`."""
    return Path(run_dir) / "checkpoints" / f"step_{version}.partial"


def missing_parts(path: str | Path) -> list[str]:
    """The parts (`PARTS`) that `path` lacks, as full paths; [] for a complete checkpoint."""
    return [str(Path(path) / part) for part in PARTS if not (Path(path) / part).is_file()]


def check_complete(path: str | Path) -> None:
    """Raise IncompleteCheckpoint naming the first missing file, unless `path` is complete."""
    missing = missing_parts(path)
    if missing:
        raise IncompleteCheckpoint(
            f"{path} is not a complete checkpoint: {missing[0]} is missing (a checkpoint is "
            f"complete when it holds {', '.join(PARTS)})"
        )


def publish(partial: Path) -> Path:
    """Rename a finished `step_<v>.partial` to `step_<v>` (replacing an older one of the same
    version, left by an earlier attempt); returns the final path."""
    check_complete(partial)
    final = partial.with_name(partial.name.removesuffix(".partial"))
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    return final


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints under `run_dir/checkpoints`, oldest version first. `.partial`
    directories and incomplete ones are passed over."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP.fullmatch(p.name)) and p.is_dir() and not missing_parts(p)
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint of the highest version under `run_dir/checkpoints`, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def prune(run_dir: str | Path, keep: int, spare: str | Path | None = None) -> list[Path]:
    """Delete all but the newest `keep` (>= 1) complete checkpoints, and never `spare` (the
    checkpoint the run resumed from: its config.yaml names it as trainer.resume_from, and every
    process that loads that config, a restarted server's included, checks it is complete);
    returns those deleted."""
    if keep < 1:
        raise ValueError(f"prune keeps at least one checkpoint, got keep={keep}")
    kept = None if spare is None else Path(spare).resolve()
    old = [p for p in complete_checkpoints(run_dir)[:-keep] if p.resolve() != kept]
    for path in old:
        doomed = path.with_name(path.name + ".deleting")  # no longer a checkpoint's name
        path.rename(doomed)
        shutil.rmtree(doomed)
    return old


def write_final_step(final: str | Path, step: int) -> None:
    """Record in the final weights' directory the learner version they were taken at."""
    (Path(final) / FINAL_STEP_FILE).write_text(json.dumps({"step": step}) + "\n")


def final_step(final: str | Path) -> int | None:
    """The learner version recorded in the final weights' directory; None when it records none
    (final weights written before the version was recorded there)."""
    path = Path(final) / FINAL_STEP_FILE
    if not path.is_file():
        return None
    return int(json.loads(path.read_text())["step"])
