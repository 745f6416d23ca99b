"""The launcher's watch loop (`watch`, `watch_serving`) and the rules by which it restarts
rollout and reward-model servers that die (`ServerRestarts`), whichever backend started them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import Config, load_config
from asyncrl.launch.failures import EndedMember
from asyncrl.launch.fleet import (
    FOLLOWERS_WINDOW_S,
    MAX_BACKOFF_S,
    Fleet,
    LaunchError,
    print_line,
    raise_on_failure,
)
from asyncrl.launch.progress import Progress
from asyncrl.metrics import read_jsonl
from asyncrl.wire.protocol import ServerHealth


def watch(
    fleet: Fleet,
    progress: Progress,
    window_s: float = FOLLOWERS_WINDOW_S,
    cfg: Config | None = None,
) -> None:
    """Until every learner rank has finished, restarting rollout servers that die
    (`ServerRestarts`); raise LaunchError if any other member dies first, or no server is
    left. `cfg`: the run's (default: its run directory's config.yaml)."""
    metrics = Path(fleet.spec.run_dir) / "metrics.jsonl"
    restarts = setup_restarts(fleet, cfg, progress.note)
    while True:
        raise_on_failure(fleet, window_s, restarts)  # first after a wake: exits stamped early
        restarts.check(fleet)
        progress.update(read_jsonl(metrics))
        if fleet.learners_finished():
            progress.update(read_jsonl(metrics), final=True)
            return
        fleet.wait(0.25)


def watch_serving(
    fleet: Fleet, window_s: float = FOLLOWERS_WINDOW_S, cfg: Config | None = None
) -> None:
    """Until a member other than a restartable server dies, or no server is left (then
    LaunchError): a fleet without learners runs until stopped."""
    restarts = setup_restarts(fleet, cfg, print_line)
    while True:
        raise_on_failure(fleet, window_s, restarts)
        restarts.check(fleet)
        fleet.wait(0.5)


def setup_restarts(fleet: Fleet, cfg: Config | None, say: Callable[[str], None]) -> ServerRestarts:
    """The fleet's `ServerRestarts` (`cfg`: default, the run directory's config.yaml)."""
    cfg = load_config(fleet.spec.config_path) if cfg is None else cfg
    return ServerRestarts(
        cfg,
        fleet.spec.run_dir,
        fleet.server_health,
        say=say,
        declared_grace_s=fleet.death_notice_lag_s,
    )


RESTARTS_FILE = "restarts.jsonl"
HEALTH_POLL_S = 1.0
"""How often the launcher asks the replay which servers it has heard from and declared dead."""

HEALTHY_RESET_TIMEOUTS = 10
"""A server whose current epoch the replay has reported alive for this many
`launch.server_timeout_s` in a row (5 minutes by default) has its restart budget
(`launch.max_restarts`) and backoff reset: rare deaths spread over a long run never drop it."""


@dataclass
class _Server:
    started_at: float  # clock time its current epoch was started (epoch 0: the watch began)
    epoch: int = 0  # its starts after the first: the epoch it runs as (or will once restarted)
    restarts: int = 0  # restarts counted against max_restarts (since the budget was last reset)
    restart_at: float | None = None  # clock time of its pending restart
    heard: bool = False  # the replay has reported its current epoch (it sent a heartbeat)
    healthy_since: float | None = None  # first of the polls in a row that found it alive
    declared_at: float | None = None  # first poll that found its epoch declared dead
    why: str = ""  # how its latest epoch ended
    dropped: bool = False


class ServerRestarts:
    """Restarts rollout servers (and reward-model servers) that die, up to
    `launch.max_restarts` each.

    A rollout server is dead when its process ends (however: the run needs it to the end), when
    the replay declares it dead (no message for `launch.server_timeout_s`: hung, stopped; acted
    on `declared_grace_s` after the first report, the backend's `death_notice_lag_s`, so that a
    process that ended is reported by how it ended), or when the replay has not heard from its
    current epoch within `launch.startup_timeout_s` of that epoch's start (hung before its
    first heartbeat, e.g. while loading its model; judged only on the replay's answers: a
    replay that does not answer is no news). The launcher kills the last two. A reward-model
    server is dead when its process ends (a hung one costs its callers `reward.model.timeout_s`
    per request, scored 0 and counted; its budget comes back once its process has run for
    the healthy stretch below). Restart k+1 starts `restart_backoff_s * 2**k` after the
    death it follows, as the next epoch (`worker.ProcessRole`, which only goes up). A server
    reported alive for `HEALTHY_RESET_TIMEOUTS * launch.server_timeout_s` in a row gets its
    budget back (k from 0 again). A server whose restarts are used up is dropped and the run
    goes on with the others of its kind; only when none is left does it fail (LaunchError
    naming the dropped servers). With `max_restarts=0` a server's end fails the run as any
    member's does (`raise_on_failure`), and a declared or startup death fails it naming that.
    Each restart and drop is a printed line and a record in run_dir/restarts.jsonl; a budget
    reset is a printed line."""

    def __init__(
        self,
        cfg: Config,
        run_dir: str | Path,
        health: Callable[[], list[ServerHealth] | None],
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = print_line,
        declared_grace_s: float = 0.0,
    ) -> None:
        lc = cfg.launch
        self.declared_grace_s = declared_grace_s
        self.max_restarts, self.backoff_s = lc.max_restarts, lc.restart_backoff_s
        self.startup_timeout_s = lc.startup_timeout_s
        self.healthy_reset_s = HEALTHY_RESET_TIMEOUTS * lc.server_timeout_s
        self.health, self.clock, self.say = health, clock, say
        now = clock()
        self.servers = {f"server_{i}": _Server(now) for i in range(cfg.rollout.num_servers)}
        for i in range(cfg.reward.num_servers if cfg.reward.model.path else 0):
            self.servers[f"reward_model_{i}"] = _Server(now)  # restarted when its process ends
        self.path = Path(run_dir) / RESTARTS_FILE
        self.deaths: list[tuple[float, str]] = []  # (clock time, "server_1 <how>")
        self.dropped: list[str] = []
        self._next_poll = 0.0

    def failures(self, fleet: Fleet) -> list[EndedMember]:
        """`fleet.failures()` less the servers that ended, which are taken here: retired, to
        be restarted or dropped (unless max_restarts=0)."""
        failed = fleet.failures()
        if self.max_restarts == 0:
            return list(failed)
        for m in failed:
            if m.name in self.servers and m.ending is not None:
                self._died(fleet, m.name, m.ending.how, m.last_log_lines())
        return [m for m in failed if m.name not in self.servers]

    def check(self, fleet: Fleet) -> None:
        """Judge the servers by the replay's report (declared dead, not heard from in time,
        healthy long enough for a budget reset), and start the restarts that are due."""
        now = self.clock()
        if now >= self._next_poll:
            self._next_poll = now + HEALTH_POLL_S
            reports = self.health()
            if reports is not None:
                self._judge(fleet, {r.server_id: r for r in reports}, now)
        for name, server in self.servers.items():
            if server.restart_at is not None and self.clock() >= server.restart_at:
                server.restart_at, server.epoch = None, server.epoch + 1
                server.restarts += 1
                server.started_at, server.heard, server.healthy_since = self.clock(), False, None
                server.declared_at = None
                index = int(name.rpartition("_")[2])
                if name.startswith("reward_model_"):
                    fleet.start_reward_model(index, server.epoch)
                else:
                    fleet.start_server(index, server.epoch)
                self._record(name, server.epoch, "restart", server.why)
            elif name.startswith("reward_model_") and server.restart_at is None:
                self._maybe_reset_reward_model(name, server, now)

    def _maybe_reset_reward_model(self, name: str, server: _Server, now: float) -> None:
        """The replay does not hear from reward-model servers: one whose process has run for
        healthy_reset_s since its last restart gets its budget back."""
        if (
            server.restarts
            and not server.dropped
            and now - server.started_at >= self.healthy_reset_s
        ):
            self.say(
                f"asyncrl: {name} running for {now - server.started_at:.0f} s since its restart: "
                f"its restart budget is reset ({self.max_restarts} left)"
            )
            server.restarts = 0

    def earlier(self) -> list[str]:
        """The server deaths so far, for the report of a failure that ends the run."""
        now = self.clock()
        return [f"{what} ({now - at:.1f} s before)" for at, what in self.deaths]

    def _judge(self, fleet: Fleet, reports: dict[int, ServerHealth], now: float) -> None:
        """Each running server against the replay's report of it (one that answered)."""
        for name, server in self.servers.items():
            if server.dropped or server.restart_at is not None or not name.startswith("server_"):
                continue
            report = reports.get(int(name.rpartition("_")[2]))
            if report is not None and report.epoch == server.epoch:
                server.heard = True
                if report.alive:
                    server.declared_at = None
                    self._maybe_reset(name, server, now)
                    continue
                if server.declared_at is None:
                    server.declared_at = now
                if now - server.declared_at < self.declared_grace_s:
                    continue  # its process may have ended: let the fleet report how
                how = f"was declared dead by the replay (silent for {report.silent_s:.1f} s)"
                self._kill(fleet, name, how)
            elif not server.heard and now - server.started_at > self.startup_timeout_s:
                limit = f"startup_timeout_s={self.startup_timeout_s:g}"
                self._kill(fleet, name, f"sent no heartbeat within {limit} s of its start")

    def _maybe_reset(self, name: str, server: _Server, now: float) -> None:
        """Alive at this poll: once alive for healthy_reset_s in a row, the budget is back."""
        if server.healthy_since is None:
            server.healthy_since = now
        elif server.restarts and now - server.healthy_since >= self.healthy_reset_s:
            self.say(
                f"asyncrl: {name} healthy for {now - server.healthy_since:.0f} s: its restart "
                f"budget is reset ({self.max_restarts} left)"
            )
            server.restarts = 0

    def _kill(self, fleet: Fleet, name: str, how: str) -> None:
        """A server that is dead though its process may run: kill it and take it."""
        if self.max_restarts == 0:
            log = Path(self.path.parent, "logs", f"{name}.log")
            raise LaunchError(f"process {name} {how}; its log: {log}", [name])
        self._died(fleet, name, how, "")

    def _died(self, fleet: Fleet, name: str, how: str, log_lines: str) -> None:
        fleet.retire(name)
        how = how.partition("\n")[0]  # a reason Ray gives can run over several lines
        server = self.servers[name]
        server.why, server.healthy_since, server.declared_at = how, None, None
        self.deaths.append((self.clock(), f"{name} {how}"))
        if server.restarts < self.max_restarts:
            delay = min(MAX_BACKOFF_S, self.backoff_s * 2**server.restarts)
            server.restart_at = self.clock() + delay
            restart = f"restart {server.restarts + 1}/{self.max_restarts}"
            self.say(f"asyncrl: {name} {how}; {restart} in {delay:.1f}s")
            return
        server.dropped = True
        self.dropped.append(name)
        self.say(f"asyncrl: {name} dropped after {server.restarts} restarts: {how}")
        self._record(name, server.epoch, "dropped", how)
        kind = "reward_model_" if name.startswith("reward_model_") else "server_"
        if all(s.dropped for n, s in self.servers.items() if n.startswith(kind)):
            what = "reward-model server" if kind == "reward_model_" else "rollout server"
            raise LaunchError(
                f"no {what} is left: each used up its {self.max_restarts} restarts; the "
                f"last, {name}, {how}\n{log_lines}".rstrip(),
                self.dropped,
            )

    def _record(self, name: str, epoch: int, event: str, why: str) -> None:
        record = {"time": time.time(), "server": name, "epoch": epoch, "event": event, "why": why}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
