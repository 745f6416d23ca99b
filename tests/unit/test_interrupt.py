"""An interrupted launch (`asyncrl.launch.interrupt`): the launcher asks the learner ranks alone
for their checkpoint and waits for it within its bound, not at all once the replay is dead;
then it says how to go on (the exact `--resume` command) or why there is nothing to resume.
The whole path, through the CLI: tests/integration/test_interrupt_resume.py."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fake_fleets import FakeMember

from asyncrl.checkpoints import PARTS, TRAINER_FILE, checkpoint_dir
from asyncrl.config import Config, load_config
from asyncrl.launch.failures import Ending
from asyncrl.launch.interrupt import interrupt_report, save_on_interrupt


@dataclass
class _Fleet:
    """A running fleet: after `learner_done_after` waits its learner has ended by itself (its
    checkpoint written); after `replay_dies_after`, the replay is dead (None: never)."""

    learner_done_after: int | None = None
    replay_dies_after: int | None = None
    waits: int = 0
    stopped: list[str] = field(default_factory=list)

    def stop_learners(self) -> None:
        self.stopped.append("learners")

    def learners_finished(self) -> bool:
        done = self.learner_done_after
        return done is not None and self.waits >= done

    def failures(self) -> list[FakeMember]:
        dies = self.replay_dies_after
        if dies is None or self.waits < dies:
            return []
        return [FakeMember("replay", Ending("was killed by signal SIGKILL", 0.0, 1, None))]

    def wait(self, timeout_s: float) -> bool:
        self.waits += 1
        time.sleep(min(timeout_s, 0.01))
        return True


def _cfg(*overrides: str) -> Config:
    return load_config(overrides=["trainer.total_steps=40", *overrides])


def test_the_learner_alone_is_asked_and_its_checkpoint_waited_for():
    fleet = _Fleet(learner_done_after=3)
    said: list[str] = []
    assert save_on_interrupt(fleet, _cfg(), said.append) == ""
    assert fleet.stopped == ["learners"] and fleet.waits == 3
    assert "the learner ends its step and writes a checkpoint (at most 300s" in said[0]


def test_a_dead_replay_ends_the_wait_at_once_naming_it():
    """The replay's state is a part of the checkpoint: once it is dead there is nothing to wait
    for (the learner's own request would take its reply timeout to fail)."""
    fleet = _Fleet(replay_dies_after=1)
    started = time.monotonic()
    why = save_on_interrupt(fleet, _cfg(), lambda _: None)
    assert why == (
        "process replay was killed by signal SIGKILL before the learner's checkpoint was written"
    )
    assert fleet.waits == 1 and time.monotonic() - started < 5


def test_the_wait_is_bounded_by_interrupt_timeout_s():
    fleet = _Fleet()  # a learner that never ends its step
    started = time.monotonic()
    why = save_on_interrupt(fleet, _cfg("trainer.interrupt_timeout_s=0.2"), lambda _: None)
    assert time.monotonic() - started < 5
    assert why == (
        "the learner did not end its step and write its checkpoint within "
        "trainer.interrupt_timeout_s=0.2"
    )


def test_a_second_interrupt_ends_the_wait_at_once():
    class Impatient(_Fleet):
        def wait(self, timeout_s: float) -> bool:
            raise KeyboardInterrupt  # Ctrl-C again, while the launcher waits

    fleet = Impatient()
    why = save_on_interrupt(fleet, _cfg(), lambda _: None)
    assert why == "a second interrupt stopped every process at once"
    assert fleet.stopped == ["learners"]


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("trainer.checkpoint_on_interrupt=false", "trainer.checkpoint_on_interrupt=false"),
        ("trainer.val_only=true", "trainer.val_only=true takes no step"),
    ],
)
def test_a_run_with_nothing_to_checkpoint_stops_without_asking(override, why):
    fleet = _Fleet(learner_done_after=0)
    assert save_on_interrupt(fleet, _cfg(override), print) == why
    assert fleet.stopped == []


def _run_dir(tmp_path: Path, last_step: int, checkpoints: tuple[int, ...]) -> Path:
    """runs/x (relative, from `tmp_path`) with metrics.jsonl to `last_step` and a complete
    checkpoint at each of `checkpoints`."""
    run_dir = Path("runs/x")
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, last_step + 1):
            f.write(json.dumps({"step": step, "reward_mean": 0.5}) + "\n")
    for step in checkpoints:
        ckpt = checkpoint_dir(run_dir, step)
        for part in PARTS:
            (ckpt / part).parent.mkdir(parents=True, exist_ok=True)
            (ckpt / part).write_text("{}")
        (ckpt / TRAINER_FILE).write_text(json.dumps({"version": step}))
    return run_dir


def test_the_report_names_the_checkpoint_and_the_exact_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = _run_dir(tmp_path, 25, (10, 20, 25))
    assert interrupt_report(_cfg("trainer.save_every=10"), run_dir) == (
        "asyncrl: interrupted at step 25 of 40; every process was stopped. It goes on from its "
        "checkpoint at step 25:\n  asyncrl launch --resume runs/x"
    )


def test_the_report_says_which_steps_a_cut_checkpoint_costs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = _run_dir(tmp_path, 25, (20,))
    why = "trainer.interrupt_timeout_s=300"
    assert interrupt_report(_cfg(), run_dir, why) == (
        "asyncrl: interrupted at step 25 of 40; every process was stopped. It goes on from its "
        f"checkpoint at step 20 ({why}); steps 21-25 will be taken again:\n"
        "  asyncrl launch --resume runs/x"
    )


@pytest.mark.parametrize(
    ("last_step", "overrides", "why", "said"),
    [
        (0, (), "", "Nothing to resume from: the learner had taken no step"),
        (
            7,
            ("trainer.checkpoint_on_interrupt=false",),
            "trainer.checkpoint_on_interrupt=false",
            "Nothing to resume from: trainer.checkpoint_on_interrupt=false and "
            "trainer.save_every=0 wrote none",
        ),
        (
            7,
            (),
            "process replay was killed by signal SIGKILL before the learner's checkpoint was "
            "written",
            "Nothing to resume from: process replay was killed by signal SIGKILL before the "
            "learner's checkpoint was written",
        ),
        (40, (), "", "The run had taken all its steps: nothing to resume"),
    ],
)
def test_the_report_says_why_there_is_nothing_to_resume(
    tmp_path, monkeypatch, last_step, overrides, why, said
):
    monkeypatch.chdir(tmp_path)
    run_dir = _run_dir(tmp_path, last_step, ())
    report = interrupt_report(_cfg(*overrides), run_dir, why)
    assert report == (
        f"asyncrl: interrupted at step {last_step} of 40; every process was stopped. {said}"
    )
