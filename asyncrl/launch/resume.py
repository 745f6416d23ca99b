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

The restart point, the rewind, the checkpoints set aside and the resumed config are
`asyncrl.launch.rewind`'s.

A resume by hand goes through the same rewind. `asyncrl launch --resume RUN_DIR` (or
`trainer.resume_from=RUN_DIR`) builds its config with `resume_config`: the run's own
config.yaml, the overrides typed alongside on top, and the restart point above. Whenever a
launch resumes from a checkpoint of its own run directory (that one, or
`trainer.resume_from=RUN_DIR/checkpoints/step_N trainer.run_dir=RUN_DIR` typed out),
`resume_in_place` rewinds the records past the checkpoint's step, sets aside the run's newer
checkpoints (a future the resume abandons), records the resume with the keys that differ from
the run's config.yaml, and prints them. Without it a resumed learner appended its steps to
those of the attempt it replaces (steps 1-40, then 21-60 again).
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from asyncrl.checkpoints import TRAINER_FILE
from asyncrl.config import Config, ConfigError, load_config, parse_override
from asyncrl.config.migrate import migrate_algorithm
from asyncrl.launch.fleet import MAX_BACKOFF_S, LaunchError, prepare_run_dir
from asyncrl.launch.rewind import (
    RESUMES_FILE,
    RestartPoint,
    checkpoint_step,
    restart_point,
    resumed_config,
    rewind_records,
    set_aside_newer,
)
from asyncrl.metrics import JsonlWriter, read_jsonl


def resumable(err: LaunchError) -> bool:
    """A failure that a restart from the checkpoint can mend: the first member to die is the
    replay or a learner rank (not a server, nor a start that timed out with no death)."""
    return bool(err.failed) and (err.failed[0] == "replay" or err.failed[0].startswith("learner_"))


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
            "by": "auto_resume",
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


# ---- resume by hand, in place ------------------------------------------------------------
RESUME_KEYS = ("trainer.run_dir", "trainer.resume_from", "trainer.val_before_train")
"""What a resume sets itself; left out of the keys it reports as changed."""


def is_run_dir(path: str | Path) -> bool:
    """A run directory (the `trainer.run_dir` of a launch) holds its config.yaml; a checkpoint
    directory does not."""
    return (Path(path) / "config.yaml").is_file()


def resume_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The config that continues the run in `run_dir` in place: its own config.yaml with
    `overrides` on top (`trainer.total_steps=...` to train on past its end), from its restart
    point (`restart_point`: its newest complete checkpoint), in the same directory, without
    validating again first. ConfigError when `run_dir` is not a run directory, when it has no
    complete checkpoint (naming what `trainer.save_every` gave), when an override names another
    run directory, or when the checkpoint is already the run's last step."""
    run_dir = Path(run_dir)
    saved = run_dir / "config.yaml"
    if (run_dir / TRAINER_FILE).is_file():
        raise ConfigError(
            f"cannot resume {run_dir}: it is a checkpoint, not a run directory: "
            f"--resume {run_dir.parent.parent} continues its run from its newest checkpoint "
            f"(with trainer.resume_from={run_dir}: from this one)"
        )
    if not is_run_dir(run_dir):
        what = "does not exist" if not run_dir.exists() else "has no config.yaml"
        raise ConfigError(
            f"cannot resume {run_dir}: it {what}, so it is not a run directory (the "
            "trainer.run_dir of an `asyncrl launch`, holding config.yaml and checkpoints/)"
        )
    for text in overrides:
        key, value = parse_override(text)
        if key == ["trainer", "run_dir"] and Path(str(value)).resolve() != run_dir.resolve():
            raise ConfigError(
                f"{text} with a resume of {run_dir}: a resume continues in its own directory"
            )
    cfg = load_config(
        saved,
        ["trainer.resume_from=null", *overrides, f"trainer.run_dir={run_dir}"],
        run_dir_config=True,
    )
    started_from = _saved_trainer(saved).get("resume_from")  # another run's checkpoint
    if cfg.trainer.resume_from is not None:  # an explicit checkpoint: go back to it
        chosen = Path(cfg.trainer.resume_from).resolve()
        started = started_from is not None and chosen == Path(started_from).resolve()
        if chosen.parent != (run_dir / "checkpoints").resolve() and not started:
            raise ConfigError(
                f"trainer.resume_from={cfg.trainer.resume_from} with a resume of {run_dir}: "
                f"a resume in place continues from one of {run_dir / 'checkpoints'} (or the "
                "checkpoint the run started from)"
            )
        point = RestartPoint(chosen, checkpoint_step(chosen))
    else:
        tc = cfg.trainer.model_copy(update={"resume_from": started_from})
        point = restart_point(cfg.model_copy(update={"trainer": tc}), run_dir)
    if point.checkpoint is None:
        raise ConfigError(no_checkpoint_message(run_dir, _saved_trainer(saved)))
    if point.step >= cfg.trainer.total_steps:
        raise ConfigError(
            f"{run_dir} is complete: its checkpoint {point.checkpoint.name} is step "
            f"{point.step} of trainer.total_steps={cfg.trainer.total_steps}; to train on, "
            f"resume with trainer.total_steps=N (N > {point.step})"
        )
    return resumed_config(cfg, run_dir, point)


def _saved_trainer(saved: Path) -> dict[str, Any]:
    """The trainer section of a run's config.yaml as written (before any override)."""
    tree = yaml.safe_load(saved.read_text()) or {}
    section = tree.get("trainer") if isinstance(tree, dict) else None
    return section if isinstance(section, dict) else {}


def no_checkpoint_message(run_dir: Path, trainer: dict[str, Any]) -> str:
    """Why `run_dir` cannot be resumed: it wrote no complete checkpoint, and what its
    `trainer.save_every` had it write."""
    every = trainer.get("save_every", 0)
    head = f"cannot resume {run_dir}: it has no complete checkpoint under {run_dir / 'checkpoints'}"
    if not every:
        return (
            f"{head}; its config.yaml has trainer.save_every=0 and no interrupt wrote one (Ctrl-C "
            "and SIGTERM do once a step is taken, unless trainer.checkpoint_on_interrupt=false; "
            "a crash or a kill does not): run it again with trainer.save_every=N to checkpoint "
            "every N steps"
        )
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "reward_mean" in r]
    partial = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.partial"))
    return (
        f"{head}; with trainer.save_every={every} the first is written after step {every}, "
        f"and the run recorded {max(steps, default=0)} step(s)"
        + (f"; {', '.join(partial)} never finished (never resumed from)" if partial else "")
    )


def in_place_point(cfg: Config) -> RestartPoint | None:
    """The checkpoint `cfg` resumes from when it continues a run directory that exists
    already (a resume in place: from one of that run's checkpoints, or from the other run's
    checkpoint it started from); None otherwise (a fresh run, or a new directory)."""
    tc = cfg.trainer
    if tc.resume_from is None or "{time}" in tc.run_dir:
        return None
    ckpt = Path(tc.resume_from).resolve()
    own = ckpt.parent == (Path(tc.run_dir) / "checkpoints").resolve()
    if not own and not is_run_dir(tc.run_dir):
        return None
    if not own:  # only the checkpoint this run started from continues it
        started = _saved_trainer(Path(tc.run_dir) / "config.yaml").get("resume_from")
        if started is None or Path(started).resolve() != ckpt:
            raise ConfigError(
                f"trainer.run_dir={tc.run_dir} holds another run (it did not start from "
                f"{tc.resume_from}): a fresh start from that checkpoint needs a new "
                f"trainer.run_dir; to continue that run, `asyncrl launch --resume {tc.run_dir}`"
            )
    return RestartPoint(ckpt, checkpoint_step(ckpt))


def resume_in_place(cfg: Config, command: str, log: Callable[[str], None] = print) -> Config:
    """Before a launch that resumes from a checkpoint of its own run directory: rewind the
    per-step records past it (`rewind_records`), set the run's newer checkpoints aside
    (`set_aside_newer`), append a line to resumes.jsonl (the command, the keys that differ
    from the run's config.yaml, what was rewound and set aside) and print the same. Returns the
    config to run: `cfg`, without validating before the first step (the step-0 record is
    there already). Any other launch: `cfg` unchanged, nothing touched."""
    point = in_place_point(cfg)
    if point is None or point.checkpoint is None:
        return cfg
    run_dir = Path(cfg.trainer.run_dir)
    changed = changed_keys(run_dir / "config.yaml", cfg)
    aside = set_aside_newer(run_dir, point)
    dropped = rewind_records(run_dir, point)
    writer = JsonlWriter(run_dir / RESUMES_FILE)
    writer.write(
        {
            "time": time.time(),
            "by": "command",
            "command": command,
            "checkpoint": str(point.checkpoint),
            "step": point.step,
            "changed": changed,
            "rewound": dropped,
            "set_aside": [str(p) for p in aside],
        }
    )
    writer.close()
    log(
        f"asyncrl: resuming {run_dir} in place from {point.checkpoint.name} (step {point.step} "
        f"of {cfg.trainer.total_steps}); records past step {point.step} rewound "
        f"({', '.join(f'{n}: {k} lines' for n, k in dropped.items() if k) or 'none'})"
    )
    if changed:
        log(
            "asyncrl: on top of its config.yaml: "
            + ", ".join(f"{k}={c['now']} (was {c['was']})" for k, c in changed.items())
        )
    if aside:
        log(f"asyncrl: newer checkpoints set aside (never resumed from): {aside[0].parent}")
    return resumed_config(cfg, run_dir, point)


def changed_keys(saved: Path, cfg: Config) -> dict[str, dict[str, Any]]:
    """The keys whose value in `cfg` differs from the run's config.yaml (`saved`), as
    {"section.key": {"was": old, "now": new}}, less those a resume sets itself. A key that only
    one side has counts (a variant switch removes its old variant's fields: `now` is None); an
    old run's flat algorithm keys are compared as migrated (`asyncrl.config.migrate`)."""
    tree = (yaml.safe_load(saved.read_text()) or {}) if saved.is_file() else {}
    migrate_algorithm(tree)
    was = _flat(tree)
    now = _flat(cfg.model_dump(mode="json"))
    return {
        key: {"was": was.get(key), "now": now.get(key)}
        for key in [*now, *(k for k in was if k not in now)]
        if key not in RESUME_KEYS and was.get(key) != now.get(key)
    }


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out
