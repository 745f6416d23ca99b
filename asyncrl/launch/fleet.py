"""What the local and the Ray launcher share: the `Fleet` they hand back, the run directory,
the model every fleet loads, each process's environment, and the one watch loop.

A backend (`local.py`, `ray_cluster.py`) starts the processes and returns a `Fleet`; everything
after that (waiting for the replay, showing progress, restarting dead rollout servers
(`ServerRestarts`), naming the first process to die and the deaths that followed it, see
`failures.py`) is here, so both backends behave the same.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from asyncrl.auth import RoleKey, auth_env, new_secret, read_secret, role_key, write_secret
from asyncrl.config import Config, config_to_yaml, load_config
from asyncrl.data import setup_task
from asyncrl.launch.failures import EndedMember, failure_report
from asyncrl.launch.progress import Progress
from asyncrl.metrics import read_jsonl
from asyncrl.protocol import ServerHealth
from asyncrl.replay_client import ReplayClient, ReplayUnavailable
from asyncrl.run_spec import RunSpec

FOLLOWERS_WINDOW_S = 2.0
"""After the first failure is seen, how long the launcher waits for the deaths it causes
(they are listed in the report) before it stops the rest."""


MAX_BACKOFF_S = 300.0
"""The longest wait before a restart or a resume, however many came before (the doubling would
otherwise reach hours after a dozen)."""


class LaunchError(RuntimeError):
    """A fleet failed; the message names the process and why, `failed` the members that
    failed (first death first; empty when no member died, e.g. a start that timed out)."""

    def __init__(self, message: str, failed: Sequence[str] = ()):
        super().__init__(message)
        self.failed = tuple(failed)


class Fleet(Protocol):
    """A started run, whatever started it: what `launch`, `serve` and `eval` need."""

    spec: RunSpec
    death_notice_lag_s: float
    """How late this backend may see a member's end (0 where it polls the process itself): a
    server the replay declares dead is acted on this long after, so one whose process ended
    is reported by how it ended (`ServerRestarts`)."""

    def failures(self) -> Sequence[EndedMember]:
        """Checks every member now; those that failed, or ended while the run still needed
        them, first death first (`failures.death_order`)."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to `timeout_s`, waking early when a member ends; False (at once) when no
        member is running."""
        ...

    def learners_finished(self) -> bool:
        """Every learner rank has ended successfully (the end of a training run)."""
        ...

    def stop_all(self) -> None:
        """Stop every member (gracefully, then by force) and release what the run holds."""
        ...

    def retire(self, name: str) -> None:
        """Kill what is left of member `name` at once (SIGKILL: a hung or stopped process
        too) and stop watching it: its end is no failure of the run."""
        ...

    def start_server(self, index: int, epoch: int) -> None:
        """Start rollout server `index` again as `epoch` (its restart count), in the place
        of the one retired."""
        ...

    def start_reward_model(self, index: int, epoch: int) -> None:
        """Start reward-model server `index` again (its `epoch`-th start), in the place of the
        one retired."""
        ...

    def server_health(self) -> list[ServerHealth] | None:
        """The replay's view of the rollout servers (`replay_health`), asked from where the
        replay can be reached; None when it does not answer in time."""
        ...


def log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of a process's log ('' when there is none)."""
    if not path.is_file():
        return ""
    return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])


def prepare_run_dir(cfg: Config, command: str) -> Path:
    """Create the run directory and write the resolved config (with the command on top) and a
    new run secret (`asyncrl.auth`: every process of the run derives its key from it)."""
    run_dir = Path(cfg.trainer.run_dir.replace("{time}", time.strftime("%Y%m%d-%H%M%S")))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(f"# {command}\n" + config_to_yaml(cfg))
    write_secret(run_dir, new_secret())
    return run_dir


def client_key(spec: RunSpec) -> RoleKey:
    """The launcher's own key (progress, readiness, `asyncrl eval` on a fleet it started)."""
    return role_key(read_secret(spec.run_dir), "client")


def prepare_model(cfg: Config, log=print) -> str:
    """The model directory every fleet loads: the configured one, or the embedded tiny model
    (built and warm-started here, cached across runs)."""
    if cfg.trainer.model_path is not None:
        if not (Path(cfg.trainer.model_path) / "config.json").is_file():
            raise LaunchError(f"trainer.model_path={cfg.trainer.model_path!r} has no config.json")
        return cfg.trainer.model_path
    from asyncrl.demo.model_cache import EmbeddedTask, cache_key, embedded_model_dir

    tc, task = cfg.trainer, setup_task(cfg.data)
    if not isinstance(task, EmbeddedTask):
        raise LaunchError(
            f"the embedded model is warm-started on the embedded tasks, not on "
            f"data.task={cfg.data.task!r}: set trainer.model_path"
        )
    cached = embedded_model_dir(tc.cache_dir, cache_key(task, tc.warmstart_steps, tc.seed))
    if cached.is_dir():  # every run after the first: torch and transformers stay unimported
        return str(cached)
    from asyncrl.demo.tiny_model import prepare_embedded_model

    return str(prepare_embedded_model(tc.cache_dir, task, tc.warmstart_steps, tc.seed, log=log))


def threads_per_process(cfg: Config) -> int:
    """Torch threads of each compute process: `launch.threads_per_process` when set, else the
    CPUs split evenly between the servers and learner ranks (at least one each).

    Measured against giving every process all the CPUs (issue 14, the embedded default on 2
    cores, 3 interleaved pairs): oversubscribed, the learner's update took 0.69-0.92 s a step
    instead of 0.09-0.17 s (OpenMP threads spin on cores the other process holds), so the
    split stays the default even though the server idles half the time."""
    if cfg.launch.threads_per_process:
        return cfg.launch.threads_per_process
    compute = cfg.rollout.num_servers + cfg.learner.world_size
    return max(1, (os.cpu_count() or 1) // compute)


def process_env(spec: RunSpec, name: str) -> dict[str, str]:
    """What every fleet process has in its environment, whichever backend starts it: its
    thread counts, its name and run (so `ps e` or a test can tell whose process it is), and
    its key (`asyncrl.auth.auth_env`: the run secret for the replay, a role key for others)."""
    return (
        auth_env(read_secret(spec.run_dir), name)
        | {
            "OMP_NUM_THREADS": str(spec.threads),
            "MKL_NUM_THREADS": str(spec.threads),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "ASYNCRL_PROCESS": name,
            "ASYNCRL_RUN_DIR": spec.run_dir,
        }
        | nccl_env()
    )


def nccl_env() -> dict[str, str]:
    """NCCL's error handling, unless the user set it: 2 (CleanUpOnly) aborts a failed or
    timed-out communicator and raises in the waiting thread, so the learner can drop one
    server's weight-sync group (`learner/sync_fleet.py`); torch's default (3) ends the whole
    process from NCCL's watchdog. Untested here: no GPU on the reference machine."""
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" in os.environ:
        return {}
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def server_env(cfg: Config, epoch: int) -> dict[str, str]:
    """What a rollout server's replay client reads (`rollout_servers.replay_client`): its
    epoch (restart count) and how often it sends heartbeats."""
    return {"ASYNCRL_SERVER_EPOCH": str(epoch), "ASYNCRL_HEARTBEAT_S": str(cfg.launch.heartbeat_s)}


def learner_env(
    rank: int, world_size: int, master_addr: str, master_port: int, local_rank: int
) -> dict[str, str]:
    """The torchrun-style variables `learner.fsdp.setup_distributed` reads."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def replay_answers(address: str, auth: RoleKey) -> bool:
    """Whether the replay at `address` answers a stats request within half a second."""
    client = ReplayClient(address, auth, reply_timeout_s=0.5)
    try:
        client.stats()
        return True
    except ReplayUnavailable:
        return False
    finally:
        client.close()


def replay_health(address: str, auth: RoleKey, timeout_s: float = 1.0) -> list[ServerHealth] | None:
    """Every rollout server the replay at `address` has heard from, with its epoch and whether
    it is alive; None when the replay does not answer within `timeout_s` (busy: if it died, its
    process's end is what the launcher sees), which is no news of any server ([] is: none
    heard from yet)."""
    client = ReplayClient(address, auth, reply_timeout_s=timeout_s)
    try:
        return client.server_health()
    except ReplayUnavailable:
        return None
    finally:
        client.close()


def raise_on_failure(
    fleet: Fleet,
    window_s: float = FOLLOWERS_WINDOW_S,
    restarts: ServerRestarts | None = None,
) -> None:
    """LaunchError naming the first member to fail and the failures that follow it within
    `window_s` (waited for here; at once when every member has ended); nothing if none has.
    With `restarts`, a server's death is its to handle (unless the run ends anyway: then a
    server that dies within the window is listed), and the server deaths before the failure
    are named in its report."""
    if not (fleet.failures() if restarts is None else restarts.failures(fleet)):
        return
    deadline = time.monotonic() + window_s
    while (left := deadline - time.monotonic()) > 0 and fleet.wait(left):
        fleet.failures()  # stamps what ended, as it ends
    failed = fleet.failures()
    earlier = [] if restarts is None else restarts.earlier()
    raise LaunchError(failure_report(failed, earlier), [m.name for m in failed])


def wait_for_replay(fleet: Fleet, answers: Callable[[], bool], timeout_s: float) -> None:
    """Until `answers()` (the replay is up); LaunchError if a member dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raise_on_failure(fleet)
        if answers():
            return
    raise LaunchError(f"replay did not start within {timeout_s:.0f}s")


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


def print_line(line: str) -> None:
    print(line, flush=True)


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
    per request, scored 0 and counted). Restart k+1 starts `restart_backoff_s * 2**k` after the
    death it follows, as the next epoch (`ASYNCRL_SERVER_EPOCH`, which only goes up). A server
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
