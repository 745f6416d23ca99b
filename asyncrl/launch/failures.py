"""Which process of a run failed first, and which deaths followed it.

When one process dies the others often die within milliseconds because of it (a SIGKILLed
rollout server breaks the learner's weight broadcast, whose death breaks the other servers'),
so the process to name is the first to die in time, not the first in start order. The
launcher cannot see when a child died, only when it first saw it dead, so each backend records
an `Ending` per member: the time and the sequence number of the check that first saw it ended.

Ordering (`death_order`), and its resolution:
1. Exits seen by different checks are in the order of those checks. Between checks the
   launcher sleeps in `Fleet.wait`, which wakes as soon as any member ends (a pidfd per child
   locally, `ray.wait` under Ray), so a check follows an exit within milliseconds while the
   launcher is idle; while it is busy (its own work, a loaded machine) exits pile up.
2. Exits seen by the same check are ordered by the last write to each one's log (the local
   backend polls again while a pass finds a new exit, so exits during a check tie too): a
   process that dies because another one did writes its traceback after that death. This is
   evidence, not proof: a follower that dies without writing anything (killed by a signal) can
   have an older log than its cause, and a log on another node (Ray) gives no evidence.
3. What is still tied keeps start order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar


@dataclass(frozen=True)
class Ending:
    """How a member ended and when the launcher first saw it."""

    how: str  # "exited with code 1", "was killed by signal SIGKILL", "died: <Ray's reason>"
    seen_at: float  # time.monotonic() of the check that first saw it ended
    check: int  # that check's sequence number (exits seen by one check are tied)
    log_written_at: float | None  # its log's modification time (time.time()), None: no log here


class EndedMember(Protocol):
    """What ordering and reporting need of a fleet member."""

    @property
    def name(self) -> str:
        """replay, server_<i>, learner_<rank>"""
        ...

    @property
    def who(self) -> str:
        """How a report names it: 'process server_1', 'Ray actor server_1 (node IP, pid N)'."""
        ...

    @property
    def ending(self) -> Ending | None:
        """None while it runs."""
        ...

    def last_log_lines(self) -> str:
        """'last lines of <log>:' and the tail of its log (or where its log is)."""
        ...


M = TypeVar("M", bound=EndedMember)


def log_written_at(path: Path) -> float | None:
    """When `path` was last written (None when it is not on this machine)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def death_order(ended: Sequence[M]) -> list[M]:
    """`ended` (in start order, each with an `ending`) sorted first death first: by check,
    then, within one check, by the last write to the log (no log: last), then start order."""

    def key(indexed: tuple[int, M]) -> tuple[int, float, int]:
        index, member = indexed
        e = member.ending
        assert e is not None, f"{member.name} has not ended"
        written = math.inf if e.log_written_at is None else e.log_written_at
        return e.check, written, index

    return [m for _, m in sorted(enumerate(ended), key=key)]


def failure_report(failures: Sequence[EndedMember], earlier: Sequence[str] = ()) -> str:
    """`failures` as `death_order` returns them, as lines: the first (how it ended), the ones
    seen after it (`then: ...`, with how much later), the deaths before it that did not end
    the run (`earlier: ...`, restarted rollout servers: one may have caused it), and the tail
    of the first one's log."""
    cause, *followers = failures
    assert cause.ending is not None, f"{cause.name} has not ended"
    lines = [f"{cause.who} {cause.ending.how}"]
    if followers:
        lines.append("then: " + ", ".join(_followed(cause, f) for f in followers))
    if earlier:
        lines.append("earlier (not fatal): " + ", ".join(earlier))
    lines.append(cause.last_log_lines())
    return "\n".join(lines)


def _followed(cause: EndedMember, member: EndedMember) -> str:
    first, later = cause.ending, member.ending
    assert first is not None and later is not None
    if later.check == first.check:
        when = "seen together with it; ordered by their logs' last writes"
    else:
        when = f"{later.seen_at - first.seen_at:.1f} s later"
    how = later.how.partition("\n")[0]  # a reason Ray gives can run over several lines
    return f"{member.name} {how} ({when})"
