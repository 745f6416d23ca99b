"""The local backend (`launch.backend=local`): the fleets as child processes of the launcher.

Each process is `python -m asyncrl.launch.worker ROLE run_dir/launch.json`, logging to
`run_dir/logs/<name>.log`. All of them start at once, the replay first, and the launcher then
waits until the replay answers: their imports (seconds of torch and transformers) overlap, and
a server or learner that is ready before the replay waits on its socket, as it would for a
replay that restarts. Children run in their own sessions (so a terminal's Ctrl-C reaches
only the launcher, which then stops them in order) and die with the launcher even if it is
killed outright (Linux parent-death signal), so no process outlives a run.

A rollout server that dies is restarted in place (`restarts.ServerRestarts` decides when):
`LocalFleet.retire` SIGKILLs its process group and forgets it, `start_server` starts it again
with the same command but its next epoch (`--epoch`, `asyncrl.launch.worker`) and that epoch's
key in its environment, appending to the same log.

Every check (`LocalFleet.failures`) polls every child and stamps the ones it sees ended for the
first time (`failures.Ending`); between checks `LocalFleet.wait` sleeps on a pidfd per running
child, so the launcher wakes, and stamps an exit, within milliseconds of it while it is idle
(exits that pile up while it is busy are ordered by their logs, see `failures.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.config import Config
from asyncrl.launch.failures import Ending, death_order, log_written_at
from asyncrl.launch.fleet import (
    LaunchError,
    client_key,
    learner_env,
    log_tail,
    print_line,
    process_env,
    replay_answers,
    replay_health,
    threads_per_process,
    wait_for_replay,
)
from asyncrl.launch.worker import ProcessRole
from asyncrl.placement import PlacementPlan, launch_placement, placement_env
from asyncrl.run_spec import RunSpec
from asyncrl.weights.shm import sweep_dead_segments
from asyncrl.wire.auth import auth_env, read_secret
from asyncrl.wire.protocol import ServerHealth
from asyncrl.wire.sockets import free_ports, tcp_address


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):  # not Linux: no parent-death signal, stop_all still runs
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    essential_until_end: bool = True  # its exit before the learner finishes is a failure
    ending: Ending | None = None  # stamped by the first check that sees it ended

    @property
    def who(self) -> str:
        return f"process {self.name}"

    @property
    def failed(self) -> bool:
        """Ended with an error, or ended while the run still needed it."""
        return self.ending is not None and (self.popen.returncode != 0 or self.essential_until_end)

    def maybe_stamp_ending(self, check: int, now: float) -> bool:
        """Record how and when it ended, if it has ended and no check has seen it yet; whether
        it did."""
        if self.ending is not None or self.popen.poll() is None:
            return False
        rc = self.popen.returncode
        how = (
            f"was killed by signal {signal.Signals(-rc).name}"
            if rc < 0
            else f"exited with code {rc}"
        )
        self.ending = Ending(how, now, check, log_written_at(self.log_path))
        return True

    def last_log_lines(self) -> str:
        return f"last lines of {self.log_path}:\n{log_tail(self.log_path)}"


@dataclass
class LocalFleet:
    spec: RunSpec
    procs: list[Proc] = field(default_factory=list)
    checks: int = 0  # how many times every process has been polled
    commands: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict)
    started_pids: list[int] = field(default_factory=list)  # every child ever started
    death_notice_lag_s: float = 0.0  # each check polls the processes: an end is seen at once

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Proc:
        log_path = Path(self.spec.run_dir) / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.commands[name] = (argv, env)
        with log_path.open("ab") as out:
            popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        self.started_pids.append(popen.pid)
        return proc

    def failures(self) -> list[Proc]:
        """One check: poll every child not yet seen ended, again while a pass finds a new exit
        (so exits that happen while the check runs are tied, not ordered by poll order)."""
        self.checks += 1
        now = time.monotonic()
        found_one = True
        while found_one:
            found_one = False
            for p in self.procs:
                found_one |= p.maybe_stamp_ending(self.checks, now)
        return death_order([p for p in self.procs if p.failed])

    def wait(self, timeout_s: float) -> bool:
        """Sleep on the pidfds of the children no check has seen ended (a pidfd is readable
        once its child has ended)."""
        unseen = [p for p in self.procs if p.ending is None]
        if not unseen:
            return False
        if all(p.popen.returncode is None for p in unseen):  # none reaped: their pids are theirs
            _wait_any([p.popen.pid for p in unseen], timeout_s)
        return True

    def retire(self, name: str) -> None:
        """SIGKILL the process group of `name` (stopped or hung included), reap it, and stop
        watching it."""
        proc = next(p for p in self.procs if p.name == name)
        _signal_group(proc.popen, signal.SIGKILL)
        reap(proc.popen, name)
        self.procs.remove(proc)

    def start_server(self, index: int, epoch: int) -> None:
        """Server `index` again, as `epoch`, with the command it was first started with."""
        name = f"server_{index}"
        # that epoch's key: only the launcher can start a later epoch (`asyncrl.wire.auth`)
        key = auth_env(read_secret(self.spec.run_dir), name, epoch)
        argv = with_epoch(self.commands[name][0], epoch)
        self._start_again(name, f"restarted as epoch {epoch}", argv, key)

    def start_reward_model(self, index: int, epoch: int) -> None:
        """Reward-model server `index` again, with the command it was first started with."""
        name = f"reward_model_{index}"
        self._start_again(name, f"restarted ({epoch})", self.commands[name][0], {})

    def _start_again(self, name: str, note: str, argv: list[str], env: dict[str, str]) -> None:
        """`name` again with `argv` and its first environment updated by `env`, appending to
        its log after a line that says so."""
        first_env = self.commands[name][1]
        log_path = Path(self.spec.run_dir) / "logs" / f"{name}.log"
        with log_path.open("a") as log:
            log.write(f"---- asyncrl: {name} {note} ----\n")
        self.start(name, argv, first_env | env)

    def server_health(self) -> list[ServerHealth] | None:
        return replay_health(self.spec.replay_address, client_key(self.spec))

    def learners_finished(self) -> bool:
        learners = [p for p in self.procs if p.name.startswith("learner_")]
        return all(p.popen.poll() == 0 for p in learners)

    def stop_learners(self) -> None:
        """SIGTERM the process group of every learner rank still running."""
        for p in self.procs:
            if p.name.startswith("learner_") and p.popen.poll() is None:
                _signal_group(p.popen, signal.SIGTERM)

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group, then SIGKILL whatever is left after the grace period;
        then remove what the run's dead processes left in /dev/shm (docs/gpus.md)."""
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                _signal_group(p.popen, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            _signal_group(p.popen, signal.SIGKILL)  # also reaps stray grandchildren
            reap(p.popen, p.name)
        sweep_dead_segments(started=self.started_pids)


def with_epoch(argv: list[str], epoch: int) -> list[str]:
    """A server's command `argv` with its epoch (the value after `--epoch`) set to `epoch`."""
    at = argv.index("--epoch") + 1
    return [*argv[:at], str(epoch), *argv[at + 1 :]]


REAP_TIMEOUT_S = 30.0
"""How long the launcher waits for a SIGKILLed child to end before it goes on without it."""


def reap(popen: subprocess.Popen, name: str, timeout_s: float = REAP_TIMEOUT_S) -> bool:
    """Wait for a SIGKILLed child to end; whether it did. A process stuck in the kernel
    (uninterruptible I/O: a hung network filesystem, a wedged driver) cannot die until that
    call returns, so the wait is bounded and the launcher goes on, saying which process it
    left behind, instead of hanging the whole run's stop or restart."""
    try:
        popen.wait(timeout=timeout_s)
        return True
    except subprocess.TimeoutExpired:
        print_line(
            f"asyncrl: {name} (pid {popen.pid}) has not ended {timeout_s:g} s after SIGKILL "
            "(stuck in the kernel?); going on without it"
        )
        return False


def _wait_any(pids: list[int], timeout_s: float) -> None:
    """Until one of these children ends or `timeout_s` passes (a plain sleep where pidfds are
    not available: Linux before 5.3, other systems)."""
    fds: list[int] = []
    try:
        poller = select.poll()
        for pid in pids:
            fds.append(os.pidfd_open(pid))
            poller.register(fds[-1], select.POLLIN)
    except (AttributeError, OSError):
        time.sleep(timeout_s)
        return
    else:
        poller.poll(max(0, round(timeout_s * 1000)))
    finally:
        for fd in fds:
            os.close(fd)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def start_local_fleets(
    cfg: Config, run_dir: Path, model_path: str, with_learner: bool = True
) -> LocalFleet:
    host = cfg.launch.host
    rm_path = cfg.reward.model.path
    if rm_path is not None and not (Path(rm_path) / "config.json").is_file():
        raise LaunchError(f"reward.model.path={rm_path!r} has no config.json")
    plan = launch_placement(cfg, with_learner)  # refused here, before any process starts
    print_line(plan.table())
    reward_models = cfg.reward.num_servers if cfg.reward.model.path else 0
    replay_port, sync_port, master_port, *reward_ports = free_ports(host, 3 + reward_models)
    spec = RunSpec(
        run_dir=str(run_dir),
        model_path=model_path,
        replay_address=tcp_address(host, cfg.launch.replay_port or replay_port),
        sync_host=host,
        sync_port=(cfg.launch.weight_sync_port or sync_port) if with_learner else 0,
        learner_master_port=master_port,
        threads=threads_per_process(cfg),
        placement=plan,
        reward_model_addresses=tuple(tcp_address(host, port) for port in reward_ports),
    )
    spec_path = run_dir / "launch.json"
    spec.save(spec_path)
    fleet = LocalFleet(spec)
    worker = [sys.executable, "-m", "asyncrl.launch.worker"]
    try:
        for name, argv, env in local_commands(cfg, spec, plan, worker, str(spec_path)):
            proc = fleet.start(name, argv, env)
            # learner ranks finishing (code 0) ends the run
            proc.essential_until_end = not name.startswith("learner_")
        wait_for_replay(
            fleet,
            lambda: replay_answers(spec.replay_address, client_key(spec)),
            cfg.launch.startup_timeout_s,
        )
    except BaseException:
        fleet.stop_all()
        raise
    return fleet


def local_commands(
    cfg: Config, spec: RunSpec, plan: PlacementPlan, worker: list[str], spec_path: str
) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, argv, environment) of every process, in start order: the replay, the
    reward-model servers (with `reward.model.path`), the rollout servers, the learner ranks
    (when the plan has them). Each gets the CUDA_VISIBLE_DEVICES of its placement; a learner
    rank on GPUs of its own numbering has LOCAL_RANK=0 (its first GPU is its cuda:0), as under
    Ray."""
    roles = [
        ProcessRole("replay"),
        *(ProcessRole("reward_model", i) for i in range(len(spec.reward_model_addresses))),
        *(ProcessRole("server", i, epoch=0) for i in range(cfg.rollout.num_servers)),
    ]
    commands = [(r.name, [*worker, *r.argv(spec_path)], process_env(spec, r.name)) for r in roles]
    world = cfg.learner.world_size
    for place in plan.places:
        if place.role == "learner":
            rank, local_rank = place.index, 0 if place.gpus else place.index
            env = process_env(spec, place.name) | learner_env(
                rank, world, cfg.launch.host, spec.learner_master_port, local_rank
            )
            argv = [*worker, *ProcessRole("learner").argv(spec_path)]
            commands.append((place.name, argv, env))
    return [(n, argv, env | placement_env(plan.place(n))) for n, argv, env in commands]
