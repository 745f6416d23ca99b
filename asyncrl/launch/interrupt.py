"""An interrupted training run keeps its work: Ctrl-C or SIGTERM to `asyncrl launch` writes a
checkpoint before the fleets stop, and the launcher says how to go on from it.

An interrupt reaches the launcher only (its children run in sessions of their own, `local.py`;
Ray's actors are none of its children), where it is a KeyboardInterrupt (`cli`). Then, with
`trainer.checkpoint_on_interrupt` (the default; `save_on_interrupt`):
1. the launcher sends SIGTERM to the learner ranks alone (`Fleet.stop_learners`); the replay
   and the rollout servers keep running, since the step in progress needs them (its weights go
   to the servers) and the replay's state is a part of the checkpoint;
2. the learner ranks end the step in progress, write the checkpoint of the version reached
   (whatever `trainer.save_every` says, unless they have taken no step since their newest
   checkpoint, or the start) and exit: `learner.trainer.Learner.train`;
3. the launcher waits for that at most `trainer.interrupt_timeout_s`, and not at all once the
   replay or a learner rank fails (the checkpoint cannot be finished then) or a second
   interrupt comes;
then every process is stopped as after any run (`Fleet.stop_all`). A checkpoint cut short is
a `.partial` directory, never resumed from (`asyncrl.checkpoints`): the run's newest complete
checkpoint is then the one before.

`interrupt_report` is what the launcher prints last: the step reached, the checkpoint the run
can go on from and the exact command (`asyncrl launch --resume RUN_DIR`), or why there is none.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl.config import Config
from asyncrl.launch.fleet import Fleet, print_line
from asyncrl.launch.rewind import restart_point
from asyncrl.metrics import read_jsonl

WAIT_POLL_S = 0.25
"""How often the launcher looks at the fleet while it waits for the interrupt's checkpoint."""


class FleetsInterrupted(KeyboardInterrupt):
    """An interrupt, once the fleets of one attempt were stopped; its text is
    `save_on_interrupt`'s answer."""


class RunInterrupted(KeyboardInterrupt):
    """An interrupted `launch`, once every process was stopped; its text is `interrupt_report`'s."""


def save_on_interrupt(fleet: Fleet, cfg: Config, say: Callable[[str], None] = print_line) -> str:
    """Steps 1-3 of the module docstring, for a running `fleet`; returns why the learner may
    not have written its checkpoint ("" when its ranks ended by themselves, done)."""
    tc = cfg.trainer
    if not tc.checkpoint_on_interrupt:
        return "trainer.checkpoint_on_interrupt=false"
    if tc.val_only:  # it validates and stops: no step, nothing to wait for
        return "trainer.val_only=true takes no step"
    deadline = time.monotonic() + tc.interrupt_timeout_s
    try:
        say(
            "asyncrl: interrupted; the learner ends its step and writes a checkpoint (at most "
            f"{tc.interrupt_timeout_s:g}s: trainer.interrupt_timeout_s; Ctrl-C again stops at once)"
        )
        fleet.stop_learners()
        while not fleet.learners_finished():
            needed = [m for m in fleet.failures() if m.name == "replay" or "learner_" in m.name]
            if needed:
                how = needed[0].ending.how if needed[0].ending is not None else "failed"
                return f"{needed[0].who} {how} before the learner's checkpoint was written"
            if time.monotonic() >= deadline:
                return (
                    f"the learner did not end its step and write its checkpoint within "
                    f"trainer.interrupt_timeout_s={tc.interrupt_timeout_s:g}"
                )
            fleet.wait(WAIT_POLL_S)
    except KeyboardInterrupt:
        return "a second interrupt stopped every process at once"
    return ""


def interrupt_report(cfg: Config, run_dir: Path, why: str = "") -> str:
    """What the launcher prints once an interrupted run has stopped: the step it reached, and
    the checkpoint to go on from (`restart_point`: what `--resume` would take) with the command
    that does it, or why there is none (`why`: `save_on_interrupt`'s answer, "" if none)."""
    tc = cfg.trainer
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "reward_mean" in r]
    reached = max(steps, default=0)
    head = f"asyncrl: interrupted at step {reached} of {tc.total_steps}; every process was stopped"
    if reached >= tc.total_steps:
        return f"{head}. The run had taken all its steps: nothing to resume"
    point = restart_point(cfg, run_dir)
    if point.checkpoint is None:
        return f"{head}. Nothing to resume from: {_no_checkpoint(cfg, reached, why)}"
    lost = f"; steps {point.step + 1}-{reached} will be taken again" if point.step < reached else ""
    note = f" ({why})" if why and point.step < reached else ""
    return (
        f"{head}. It goes on from its checkpoint at step {point.step}{note}{lost}:\n"
        f"  asyncrl launch --resume {shlex.quote(str(run_dir))}"
    )


def _no_checkpoint(cfg: Config, reached: int, why: str) -> str:
    """Why an interrupted run left no checkpoint to resume from."""
    if reached == 0:
        return "the learner had taken no step"
    if why == "trainer.checkpoint_on_interrupt=false":
        return f"{why} and trainer.save_every={cfg.trainer.save_every} wrote none"
    return why or "no checkpoint was written"
