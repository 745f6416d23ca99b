"""Fakes for the launcher's restart rules (`asyncrl.launch.restarts.ServerRestarts`): a fleet
whose members end when a test says so, a clock a test moves, and the records it writes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.launch.failures import Ending


@dataclass
class FakeMember:
    name: str
    ending: Ending | None = None

    @property
    def who(self) -> str:
        return f"process {self.name}"

    def last_log_lines(self) -> str:
        return f"last lines of {self.name}.log:\nboom"


@dataclass
class FakeFleet:
    """Members end when a test says so; retire and start_server are recorded."""

    members: list[FakeMember] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    started: list[tuple[int, int]] = field(default_factory=list)
    checks: int = 0

    def end(self, name: str, how: str = "was killed by signal SIGKILL") -> None:
        member = next(m for m in self.members if m.name == name)
        member.ending = Ending(how, 0.0, self.checks + 1, None)

    def failures(self) -> list[FakeMember]:
        self.checks += 1
        return [m for m in self.members if m.ending is not None]

    def wait(self, timeout_s: float) -> bool:
        return any(m.ending is None for m in self.members)

    def retire(self, name: str) -> None:
        self.retired.append(name)
        self.members = [m for m in self.members if m.name != name]

    def start_server(self, index: int, epoch: int) -> None:
        self.started.append((index, epoch))
        self.members.append(FakeMember(f"server_{index}"))

    def start_reward_model(self, index: int, epoch: int) -> None:
        self.started.append((100 + index, epoch))  # 100 + i: reward_model_<i>
        self.members.append(FakeMember(f"reward_model_{index}"))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def restart_records(run_dir: Path) -> list[dict]:
    """The launcher's restart records (run_dir/restarts.jsonl), in order."""
    return [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
