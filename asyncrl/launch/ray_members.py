"""One fleet process as the Ray launcher (`ray_cluster.py`) watches it: its actor, where it
runs, how its role ended, and its log; and why Ray says an actor failed, in a line.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayError

from asyncrl.launch.failures import Ending, log_written_at
from asyncrl.launch.fleet import LaunchError, log_tail
from asyncrl.launch.ray_actors import Location
from asyncrl.launch.ray_placement import Seat


@dataclass
class RayMember:
    """One fleet process as Ray runs it: its actor, where it runs, and how its role ended."""

    seat: Seat
    actor: Any  # the FleetProcess handle
    log_path: Path  # on the actor's node
    essential_until_end: bool = True  # its end before the learner finishes is a failure
    where: Location | None = None
    running: Any = None  # ObjectRef of the role's run, once started
    locating: Any = None  # ObjectRef of its `locate` while a restarted actor is not located
    exit_code: int | None = None  # the role's code once it returned
    died: str | None = None  # why the actor or its call failed, if it did
    ending: Ending | None = None  # stamped by the check that saw its run return or fail

    @property
    def name(self) -> str:
        return self.seat.name

    @property
    def at(self) -> Location:
        """Where it runs (known once `locate_actors` has returned)."""
        if self.where is None:
            raise LaunchError(f"Ray actor {self.name} has not been located")
        return self.where

    @property
    def ended(self) -> bool:
        return self.exit_code is not None or self.died is not None

    @property
    def failed(self) -> bool:
        """Ended with an error, or ended while the run still needed it."""
        return self.ended and (self.exit_code != 0 or self.essential_until_end)

    @property
    def who(self) -> str:
        node = f"node {self.where.node_ip}, pid {self.where.pid}" if self.where else "not placed"
        return f"Ray actor {self.name} ({node})"

    def settle(self, check: int, now: float) -> None:
        """Record how the role ended, once its run has returned or failed, and when (as Ray
        reported it to this check)."""
        try:
            self.exit_code = ray.get(self.running)
        except RayError as e:
            self.died = ray_reason(e)
        how = f"died: {self.died}" if self.died else f"exited with code {self.exit_code}"
        written = log_written_at(self.log_path)
        # Ray reports a killed actor's death later than the errors it causes in its peers (seen
        # under load: learner_0 before the server_0 that was killed), so where the log is on
        # this machine the deaths are ordered by it alone (all as one check), else as reported
        self.ending = Ending(how, now, 0 if written is not None else check, written)

    def last_log_lines(self) -> str:
        tail = log_tail(self.log_path)
        if not tail and self.died is None:  # a log on another node: ask the live actor
            with contextlib.suppress(RayError):
                tail = ray.get(self.actor.log_tail.remote(), timeout=10)
        if not tail:
            return f"its log is {self.log_path} on its node"
        return f"last lines of {self.log_path}:\n{tail}"


def ray_reason(e: RayError) -> str:
    """Why Ray says an actor or a call failed, without the ids and the generic advice."""
    text = str(e).strip()
    _, found, reason = text.partition("The actor is dead because ")
    if found:
        return reason.split(" Some common causes")[0].strip()
    return "\n".join(text.splitlines()[:8])
