"""A fuzz campaign against a live replay process: send, count, restart after a crash, check.

    report = run_campaign(CampaignConfig(messages=4000, seed=0))
    assert report.ok, report.summary()

Stages: start the replay (`process.ReplayProcess`) and wait for its first answer; send cases
(`cases.generate_case`) from many identities within a window of unanswered messages
(`clients.Clients`), checking the process now and then; after a crash (the process ended, its
report names the message), record it, start a fresh replay and go on, until `max_crashes`; at
the end wait for every answer, do a real round trip, read the counters, check the accounting
and measure how much the replay's resident memory grew.
"""

from __future__ import annotations

import random
import re
import tempfile
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.wire import protocol as P

from .auth_hooks import setup_auth
from .cases import Case, generate_case, writes_outside
from .checks import check_accounting, round_trip
from .clients import Clients, Hook, digest, identity_hook
from .examples import Context
from .process import ROOT, ReplayProcess


def default_replay_config() -> dict[str, Any]:
    """Small groups and batches, short waits and leases (held requests answer fast, leases the
    fuzzing abandoned expire), a small message limit (oversized messages are cheap to make), a
    few servers (one kept for the round trip)."""
    return {
        "rollout": {"n": 2, "num_servers": 8},
        "data": {"train_batch_size": 2},
        "replay": {
            "max_staleness": 1,
            "wait_timeout_s": 0.2,
            "lease_timeout_s": 2.0,
            "max_message_mb": 2.0,
            "capacity_groups": 64,
        },
    }


@dataclass
class CampaignConfig:
    messages: int = 4000  # fuzz messages to send (a case sends one or a few)
    seed: int = 0
    workdir: Path | None = None  # scratch directory (default: a new temporary one)
    replay: dict[str, Any] = field(default_factory=default_replay_config)  # the replay's Config
    identities: int = 32  # DEALER sockets, each its own identity (some replaced on the way)
    window: int = 256  # most messages unanswered at once
    answer_timeout_s: float = 10.0  # a message unanswered this long is written off
    max_crashes: int | None = None  # stop after this many (None: restart and go on)
    survive: bool = False  # record handler exceptions and go on in the same process
    max_rss_growth_mb: float = 50.0
    # hooks (None: `auth_hooks.setup_auth`: signing when the replay authenticates, else none)
    prepare: Hook | None = None  # applied to every message of the campaign's own
    fuzz_prepare: Hook | None = None  # applied to every fuzz message (default: `prepare`)
    unwrap: Hook | None = None  # applied to every answer before it is decoded
    env: dict[str, str] | None = None  # extra environment of the replay process
    progress: Callable[[Report], None] | None = None
    progress_every: int = 5000  # messages between two progress calls


@dataclass
class Crash:
    """One kind of crash (same exception, same place), with the first message that caused it."""

    kind: str
    count: int
    case: int  # index of the case that caused the first one (-1: unknown)
    description: str  # that case's mutation
    error: str
    traceback: str
    message: list[bytes]  # the frames that caused it, as the replay received them


@dataclass
class Report:
    fuzzed: int = 0  # messages of cases sent
    sent: int = 0  # every message sent (the campaign's own stats and round trip included)
    answered: int = 0
    unanswered: list[Any] = field(default_factory=list)  # (case, description) written off
    lost_in_crashes: int = 0  # unanswered when the process died
    skipped_unsafe: int = 0  # cases that would have written outside the scratch directory
    restarts: int = 0
    crashes: dict[str, Crash] = field(default_factory=dict)
    families: Counter[str] = field(default_factory=Counter)
    replies: Counter[str] = field(default_factory=Counter)  # of the last replay process
    counters: dict[str, float] = field(default_factory=dict)  # of the last replay process
    accounting: list[str] = field(default_factory=list)  # problems; empty: all accounted for
    round_trip: str = "not run"
    rss_start_mb: float = 0.0  # the last process, once it answered its first message
    rss_warm_mb: float = 0.0  # ... after a tenth of the messages (allocator and caches warm)
    rss_end_mb: float = 0.0
    rss_peak_mb: float = 0.0
    seconds: float = 0.0
    max_rss_growth_mb: float = 50.0
    workdir: str = ""

    @property
    def crash_count(self) -> int:
        return sum(c.count for c in self.crashes.values())

    @property
    def rss_growth_mb(self) -> float:
        return self.rss_end_mb - self.rss_start_mb

    def summary(self) -> str:
        """A few lines: each kind of crash with the case that first caused it, then the checks."""
        lines = [
            f"{self.crash_count} crashes of {len(self.crashes)} kinds ({self.restarts} restarts)"
        ]
        for crash in self.crashes.values():
            lines.append(f"- {crash.kind} x{crash.count}: case {crash.case}: {crash.description}")
            lines.append(f"    {crash.error[:200]}")
        lines += [
            f"unanswered: {len(self.unanswered)} {self.unanswered[:3]}",
            f"accounting: {'; '.join(self.accounting) or 'ok'}",
            f"round trip: {self.round_trip}",
            f"replay RSS growth: {self.rss_growth_mb:+.1f} MB "
            f"({self.rss_start_mb:.1f} -> {self.rss_end_mb:.1f} MB)"
            if self.rss_end_mb
            else "replay RSS growth: not measured (the campaign stopped early)",
        ]
        return "\n".join(lines)

    @property
    def ok(self) -> bool:
        return (
            not self.crashes
            and not self.unanswered
            and not self.accounting
            and self.round_trip == "ok"
            and self.rss_growth_mb < self.max_rss_growth_mb
        )


def crash_kind(entry: dict[str, Any]) -> str:
    """`Type at file:line (function)`, the innermost frame in this checkout outside the fuzzer."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', entry["traceback"])
    ours = [f for f in frames if f[0].startswith(str(ROOT)) and "replay_fuzz" not in f[0]]
    where = ours[-1] if ours else (frames[-1] if frames else ("?", "?", "?"))
    path = where[0][len(str(ROOT)) + 1 :] if where[0].startswith(str(ROOT)) else where[0]
    return f"{entry['type']} at {path}:{where[1]} ({where[2]})"


def setup_scratch(workdir: Path | None) -> Path:
    """The directory the replay may write in: a run directory, a regular file to route paths
    through, a directory outside the run directory, and the replay's working directory."""
    scratch = Path(workdir or tempfile.mkdtemp(prefix="replay-fuzz-")).resolve()
    for d in ("run", "outside-run", "cwd"):
        (scratch / d).mkdir(parents=True, exist_ok=True)
    (scratch / "a-file").write_text("a regular file\n")
    return scratch


class _Campaign:
    """One campaign's state: the replay process, the sockets, what was sent (see the module
    docstring for the stages)."""

    def __init__(self, cfg: CampaignConfig) -> None:
        self.cfg = cfg
        self.scratch = setup_scratch(cfg.workdir)
        self.report = Report(max_rss_growth_mb=cfg.max_rss_growth_mb, workdir=str(self.scratch))
        replay = Config.model_validate(cfg.replay)
        self.ctx = Context(
            scratch=self.scratch,
            run_dir=self.scratch / "run",
            n=replay.rollout.n,
            batch_groups=replay.data.train_batch_size,
            capacity_groups=replay.replay.capacity_groups,
            servers=replay.rollout.num_servers,
        )
        self.wait_s = replay.replay.wait_timeout_s  # the longest a request is held
        self.ask_timeout_s = self.wait_s + 10.0
        sign, forge, unwrap, auth_env = setup_auth(cfg.seed, self.ctx.servers)
        if cfg.prepare is not None:  # the caller's own hooks
            sign, forge, unwrap, auth_env = cfg.prepare, cfg.prepare, identity_hook, {}
        self.hooks = (sign, cfg.fuzz_prepare or forge, cfg.unwrap or unwrap)
        env = {**auth_env, **(cfg.env or {})}
        self.process = ReplayProcess(cfg.replay, self.scratch, cfg.survive, env)
        self.clients: Clients | None = None
        self.rng = random.Random(f"{cfg.seed}/sockets")
        self.recent: OrderedDict[bytes, tuple[int, str]] = OrderedDict()  # digest -> case
        self.stopped = False  # max_crashes reached
        self.reported_since_start = 0  # crash reports of the current process
        self._probes = 0

    # ---- the replay process -------------------------------------------------------------------
    def start(self) -> None:
        """Start a replay and wait for its first answer."""
        address = self.process.start()
        self.clients = Clients(
            address,
            self.cfg.identities,
            self.cfg.window,
            self.cfg.answer_timeout_s,
            *self.hooks,
            self._on_reply,
        )
        self.ctx.forget_replay()
        self.reported_since_start = 0
        first = self.clients.ask(self._stats_request(), timeout_s=120)
        if not isinstance(first, P.Stats):
            raise RuntimeError(f"the replay did not answer: {self.process.log_tail()}")
        self.report.rss_start_mb = self.process.rss_mb()
        self.report.rss_warm_mb = 0.0

    @property
    def live(self) -> Clients:
        """The current replay process's sockets (from `start` until they are folded in)."""
        assert self.clients is not None, "no replay process is running"
        return self.clients

    def _stats_request(self) -> P.StatsRequest:
        self._probes += 1  # a fresh request id: a late answer to an earlier one is not taken
        return P.StatsRequest(request_id=1_000_000 + self._probes)

    def _on_reply(self, msg: Any) -> None:
        if isinstance(msg, P.LeaseGrant):
            self.ctx.remember_grant(msg.prompts)

    def healthy(self) -> bool:
        """True if the replay is alive and answering; else the crash (or hang) is recorded and a
        fresh replay started (unless max_crashes is reached), and False."""
        assert self.clients is not None
        self.clients.collect(0)
        code = self.process.exit_code()
        for entry in self.process.new_crash_reports():  # after the exit code: none is missed
            self._record(entry)
        if code is None:
            if not self.clients.write_off():
                return True
            probe = self.clients.ask(self._stats_request(), timeout_s=10)
            if isinstance(probe, P.Stats):
                return True
            self._record(_plain_crash("Hang", "no answer to a StatsRequest within 10 s"))
            self.process.kill()
        elif not self.reported_since_start:
            self._record(_plain_crash(f"Exit{code}", self.process.log_tail()))
        self._retire()
        if self.cfg.max_crashes is not None and self.report.crash_count >= self.cfg.max_crashes:
            self.stopped = True
        else:
            self.report.restarts += 1
            self.start()
        return False

    def _record(self, entry: dict[str, Any]) -> None:
        self.reported_since_start += 1
        message = entry["messages"][-1][1:] if entry["messages"] else []  # less the identity
        key = digest(message)
        if entry.get("where") == "handler" and self.clients is not None:
            self.clients.forget(key)  # its answer will never come (survive mode)
        kind = crash_kind(entry)
        if kind in self.report.crashes:
            self.report.crashes[kind].count += 1
            return
        case, description = self.recent.get(key, (-1, "unknown"))
        self.report.crashes[kind] = Crash(
            kind, 1, case, description, entry["error"], entry["traceback"], message
        )

    def _retire(self) -> None:
        """Fold the current process's sockets into the totals and close them."""
        assert self.clients is not None
        self.report.sent += self.clients.sent
        self.report.answered += self.clients.answered
        self.report.lost_in_crashes += self.clients.outstanding
        self.report.unanswered += self.clients.unanswered
        self.clients.close()
        self.clients = None

    # ---- sending ----------------------------------------------------------------------------
    def send_case(self, case: Case) -> None:
        for frames in case.messages:
            if writes_outside(frames, self.scratch / "cwd", self.scratch):
                self.report.skipped_unsafe += 1
                continue
            if not self._room():
                return  # a fresh replay (or none): the rest of this case would mean nothing
            key = self.live.send(frames, (case.index, case.description), self.rng)
            self.report.fuzzed += 1
            self.recent[key] = (case.index, case.description)
            if len(self.recent) > 4096:
                self.recent.popitem(last=False)

    def _room(self) -> bool:
        """Wait until the window has room; False if the replay died (or hung) meanwhile."""
        deadline = time.monotonic() + self.cfg.answer_timeout_s
        while True:
            if self.process.exit_code() is not None:
                return self.healthy()
            self.live.collect(0)
            if not self.live.full:
                return True
            if not self.live.collect(0.05) and time.monotonic() > deadline:
                return self.healthy()

    def total_sent(self) -> int:
        return self.report.sent + (self.clients.sent if self.clients else 0)

    def generated(self) -> Iterator[Case]:
        index = 0
        while True:
            yield generate_case(self.cfg.seed, index, self.ctx)
            index += 1

    def run(self, cases: Iterable[Case] | None = None) -> Report:
        """Send `cases` (default: generated ones) until `cfg.messages` are sent, then finish."""
        started = time.monotonic()
        self.start()
        next_progress = self.cfg.progress_every
        for index, case in enumerate(self.generated() if cases is None else cases, 1):
            if self.report.fuzzed >= self.cfg.messages:
                break
            self.report.families[case.family] += 1
            self.send_case(case)
            if self.stopped:
                break
            if index % 50 == 0 and self.healthy() and self.rng.random() < 0.2:
                self.live.recycle(self.rng)
            if not self.report.rss_warm_mb and self.report.fuzzed >= self.cfg.messages // 10:
                self.report.rss_warm_mb = self.process.rss_mb()
            if self.cfg.progress and self.report.fuzzed >= next_progress:
                next_progress += self.cfg.progress_every
                self.report.seconds = time.monotonic() - started
                self.cfg.progress(self._snapshot())
        if not self.stopped:
            self.finish()
        self.report.seconds = time.monotonic() - started
        return self.report

    def _snapshot(self) -> Report:
        """The report so far (totals of the current process folded in), for progress lines."""
        snap = Report(**{**self.report.__dict__})
        snap.sent = self.total_sent()
        if self.clients is not None:
            snap.unanswered = [*snap.unanswered, *self.clients.unanswered]
        snap.rss_end_mb = self.process.rss_mb() if self.process.exit_code() is None else 0.0
        return snap

    # ---- the end ----------------------------------------------------------------------------
    def finish(self) -> None:
        """Every answer, a round trip, the counters, the accounting, the memory; then stop."""
        self.live.drain(quiet_s=self.cfg.answer_timeout_s, timeout_s=300)
        self.healthy()
        if self.stopped:
            return
        self.live.write_off(older_than_s=0.0)

        def ask(msg: Any) -> Any:
            return self.live.ask(msg, self.ask_timeout_s)

        ctx = self.ctx
        self.report.round_trip = round_trip(
            ask, ctx.batch_groups, ctx.capacity_groups, server_id=ctx.servers - 1
        )
        stats = ask(self._stats_request())
        if isinstance(stats, P.Stats):
            self.report.counters = stats.counters
            self.report.replies = Counter(self.live.replies)
            self.report.accounting = check_accounting(stats.counters, self.live.sent)
        else:
            self.report.accounting = [f"no Stats answer at the end ({stats!r:.200})"]
        if self.process.exit_code() is None:
            self.report.rss_end_mb = self.process.rss_mb()
            self.report.rss_peak_mb = self.process.peak_rss_mb()
        for entry in self.process.new_crash_reports():
            self._record(entry)
        self._retire()
        self.process.stop()


def _plain_crash(kind: str, error: str) -> dict[str, Any]:
    return {"type": kind, "error": error, "traceback": "", "messages": []}


def run_campaign(cfg: CampaignConfig, cases: Iterable[Case] | None = None) -> Report:
    """Fuzz a live replay (see the module docstring); the report says what happened. `cases`
    replaces the generated ones (to send a crash's saved message again, say)."""
    campaign = _Campaign(cfg)
    try:
        return campaign.run(cases)
    finally:
        if campaign.clients is not None:
            campaign.clients.close()
        campaign.process.kill()
