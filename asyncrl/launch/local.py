"""The local backend (`launch.backend=local`): the fleets as child processes of the launcher.

Each process is `python -m asyncrl.launch.worker ROLE run_dir/launch.json`, logging to
`run_dir/logs/<name>.log`. Children run in their own sessions (so a terminal's Ctrl-C reaches
only the launcher, which then stops them in order) and die with the launcher even if it is
killed outright (Linux parent-death signal), so no process outlives a run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.config import Config
from asyncrl.launch.fleet import (
    client_key,
    learner_env,
    log_tail,
    process_env,
    replay_answers,
    threads_per_process,
    wait_for_replay,
)
from asyncrl.run_spec import RunSpec
from asyncrl.transport import free_port, tcp_address


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):  # not Linux: no parent-death signal, stop_all still runs
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    essential_until_end: bool = True  # its exit before the learner finishes is a failure

    def describe_exit(self) -> str:
        rc = self.popen.returncode
        how = (
            f"was killed by signal {signal.Signals(-rc).name}"
            if rc < 0
            else f"exited with code {rc}"
        )
        return (
            f"process {self.name} {how}; last lines of {self.log_path}:\n{log_tail(self.log_path)}"
        )


@dataclass
class LocalFleet:
    spec: RunSpec
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> Proc:
        log_path = Path(self.spec.run_dir) / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
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
        return proc

    def first_dead(self) -> Proc | None:
        for p in self.procs:
            if p.popen.poll() is not None and (p.popen.returncode != 0 or p.essential_until_end):
                return p
        return None

    def learners_finished(self) -> bool:
        learners = [p for p in self.procs if p.name.startswith("learner_")]
        return all(p.popen.poll() == 0 for p in learners)

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group, then SIGKILL whatever is left after the grace period."""
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                _signal_group(p.popen, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            _signal_group(p.popen, signal.SIGKILL)  # also reaps stray grandchildren
            p.popen.wait()


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def start_local_fleets(
    cfg: Config, run_dir: Path, model_path: str, with_learner: bool = True
) -> LocalFleet:
    host = cfg.launch.host
    spec = RunSpec(
        run_dir=str(run_dir),
        model_path=model_path,
        replay_address=tcp_address(host, cfg.launch.replay_port or free_port(host)),
        sync_host=host,
        sync_port=(cfg.launch.weight_sync_port or free_port(host)) if with_learner else 0,
        learner_master_port=free_port(host),
        threads=threads_per_process(cfg),
    )
    spec_path = run_dir / "launch.json"
    spec.save(spec_path)
    fleet = LocalFleet(spec)
    worker = [sys.executable, "-m", "asyncrl.launch.worker"]
    try:
        fleet.start("replay", [*worker, "replay", str(spec_path)], process_env(spec, "replay"))
        wait_for_replay(
            fleet,
            lambda: replay_answers(spec.replay_address, client_key(spec)),
            cfg.launch.startup_timeout_s,
        )
        for i in range(cfg.rollout.num_servers):
            name = f"server_{i}"
            argv = [*worker, "server", str(spec_path), "--index", str(i)]
            fleet.start(name, argv, process_env(spec, name))
        world = cfg.learner.world_size
        for rank in range(world if with_learner else 0):
            name = f"learner_{rank}"
            env = process_env(spec, name) | learner_env(
                rank, world, host, spec.learner_master_port, local_rank=rank
            )
            proc = fleet.start(name, [*worker, "learner", str(spec_path)], env)
            proc.essential_until_end = False  # learner ranks finishing (code 0) ends the run
    except BaseException:
        fleet.stop_all()
        raise
    return fleet
