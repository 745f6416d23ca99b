"""The first process to die in time is named, not the first started, and the deaths after it
are listed as following (`asyncrl.launch.failures`, `asyncrl.launch.fleet.raise_on_failure`)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import pytest

from asyncrl.launch.failures import Ending, death_order, failure_report
from asyncrl.launch.fleet import LaunchError, raise_on_failure


@dataclass
class FakeMember:
    name: str
    ending: Ending | None = None

    @property
    def who(self) -> str:
        return f"process {self.name}"

    def last_log_lines(self) -> str:
        return f"last lines of {self.name}.log:\n<{self.name}'s traceback>"


def _ended(name: str, check: int, seen_at: float = 0.0, log: float | None = 0.0) -> FakeMember:
    return FakeMember(name, Ending("exited with code 1", seen_at, check, log))


def test_exits_seen_by_earlier_checks_come_first_whatever_the_start_order():
    started = [_ended("server_0", 3), _ended("server_1", 1), _ended("learner_0", 2)]
    assert [m.name for m in death_order(started)] == ["server_1", "learner_0", "server_0"]


def test_exits_seen_by_one_check_are_ordered_by_their_logs_last_write():
    """server_1 was killed silently (its log is old), the others wrote tracebacks after it."""
    started = [
        _ended("server_0", 5, log=1002.0),
        _ended("server_1", 5, log=990.0),
        _ended("learner_0", 5, log=1001.0),
    ]
    assert [m.name for m in death_order(started)] == ["server_1", "learner_0", "server_0"]


def test_without_a_log_here_a_tie_goes_last_and_a_full_tie_keeps_start_order():
    started = [
        _ended("replay", 2, log=None),
        _ended("server_0", 2, log=7.0),
        _ended("server_1", 2, log=7.0),
    ]
    assert [m.name for m in death_order(started)] == ["server_0", "server_1", "replay"]


def test_the_report_names_the_cause_then_the_followers_with_how_much_later():
    cause = FakeMember("server_1", Ending("was killed by signal SIGKILL", 10.0, 4, 1.0))
    same_check = FakeMember("learner_0", Ending("exited with code 1", 10.0, 4, 2.0))
    lost = "died: the actor's node was lost\n(Ray's details)"
    later = FakeMember("server_0", Ending(lost, 11.25, 9, 3.0))
    lines = failure_report([cause, same_check, later]).splitlines()
    assert lines[0] == "process server_1 was killed by signal SIGKILL"
    assert lines[1] == (
        "then: learner_0 exited with code 1 (seen together with it; ordered by their logs' last "
        "writes), server_0 died: the actor's node was lost (1.2 s later)"
    )
    assert lines[2:] == ["last lines of server_1.log:", "<server_1's traceback>"]


def test_a_lone_failure_has_no_then_line():
    report = failure_report([_ended("replay", 1)])
    assert report.splitlines() == [
        "process replay exited with code 1",
        "last lines of replay.log:",
        "<replay's traceback>",
    ]


@dataclass
class ScriptedFleet:
    """Members that end at scripted times (seconds after creation; None: never); checks and
    waits behave as a backend's do."""

    script: dict[str, float | None]
    members: list[FakeMember] = field(default_factory=list)
    checks: int = 0
    waits: int = 0

    def __post_init__(self) -> None:
        self.t0 = time.monotonic()
        self.members = [FakeMember(name) for name in self.script]

    def _due(self, m: FakeMember) -> bool:
        t = self.script[m.name]
        return t is not None and time.monotonic() - self.t0 >= t

    def failures(self) -> list[FakeMember]:
        self.checks += 1
        for m in self.members:
            if m.ending is None and self._due(m):
                m.ending = Ending("exited with code 1", time.monotonic(), self.checks, None)
        ended = [m for m in self.members if m.ending is not None]
        return death_order(ended)

    def wait(self, timeout_s: float) -> bool:
        self.waits += 1
        running = [self.script[m.name] for m in self.members if m.ending is None]
        if not running:
            return False
        ends = [self.t0 + t for t in running if t is not None]
        wake = min([*ends, time.monotonic() + timeout_s])
        time.sleep(max(0.0, wake - time.monotonic()))
        return True


def test_the_window_collects_the_deaths_that_follow_then_stops_waiting():
    """server_1 dies first although started after server_0; the learner and server_0 follow
    within the window and are listed; the replay never dies, so the whole window is waited."""
    fleet = ScriptedFleet({"replay": None, "server_0": 0.3, "server_1": 0.1, "learner_0": 0.2})
    while not fleet.failures():
        fleet.wait(0.05)
    started = time.monotonic()
    with pytest.raises(LaunchError) as e:
        raise_on_failure(fleet, window_s=0.6)
    assert 0.45 <= time.monotonic() - started < 1.0
    lines = str(e.value).splitlines()
    assert lines[0] == "process server_1 exited with code 1"
    assert re.match(r"then: learner_0 exited with code 1 \(0\.\d s later\), server_0 ", lines[1])
    assert "replay" not in lines[1]


def test_a_death_after_the_window_is_not_listed_and_a_fleet_all_dead_is_not_waited_for():
    fleet = ScriptedFleet({"server_0": 0.05, "learner_0": 5.0})
    while not fleet.failures():
        fleet.wait(0.05)
    with pytest.raises(LaunchError) as e:
        raise_on_failure(fleet, window_s=0.2)
    assert "then:" not in str(e.value)

    fleet = ScriptedFleet({"server_0": 0.05, "learner_0": 0.1})
    while not fleet.failures():
        fleet.wait(0.05)
    started = time.monotonic()
    with pytest.raises(LaunchError) as e:
        raise_on_failure(fleet, window_s=30.0)
    assert time.monotonic() - started < 1.0  # every member ended: nothing left to wait for
    assert "then: learner_0" in str(e.value)


def test_no_failure_returns_at_once():
    fleet = ScriptedFleet({"replay": None, "server_0": None})
    raise_on_failure(fleet, window_s=30.0)
    assert fleet.waits == 0
