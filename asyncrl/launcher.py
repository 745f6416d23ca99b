"""The launchers: replay, M rollout servers and an N-rank learner, started as processes here
(`launch.backend=local`, this module) or as Ray actors (`launch.backend=ray`,
`asyncrl.ray_launcher`).

`launch` prepares the run directory and the model, starts the fleets with the configured
backend, shows live progress, and stops everything at the end, on Ctrl-C, or as soon as any
process dies, naming it and why. Both backends hand the same small `Fleet` to the one watch
loop here, and both run the same role functions (`asyncrl.worker.run_process`), so the data
plane (ZeroMQ, torch.distributed) does not depend on the backend.

Local children run in their own sessions (so a terminal's Ctrl-C reaches only the launcher,
which then stops them in order) and die with the launcher even if it is killed outright (Linux
parent-death signal), so no process outlives a run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from asyncrl.config import Config, config_to_yaml
from asyncrl.metrics import read_jsonl
from asyncrl.progress import Progress
from asyncrl.replay_client import ReplayClient, ReplayUnavailable
from asyncrl.run_spec import RunSpec
from asyncrl.transport import free_port, tcp_address


class LaunchError(RuntimeError):
    """A fleet failed; the message names the process and why."""


class FleetMember(Protocol):
    @property
    def name(self) -> str:
        """replay, server_<i>, learner_<rank>"""
        ...

    def describe_exit(self) -> str:
        """How it ended and the last lines of its log."""
        ...


class Fleet(Protocol):
    """A started run, whatever started it: what `launch`, `serve` and `eval` need."""

    spec: RunSpec

    def first_dead(self) -> FleetMember | None:
        """The first member that failed, or ended while the run still needed it."""
        ...

    def learners_finished(self) -> bool:
        """Every learner rank has ended successfully (the end of a training run)."""
        ...

    def stop_all(self) -> None:
        """Stop every member (gracefully, then by force) and release what the run holds."""
        ...


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):  # not Linux: no parent-death signal, stop_all still runs
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of a process's log ('' when there is none)."""
    if not path.is_file():
        return ""
    return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])


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


def prepare_run_dir(cfg: Config, command: str) -> Path:
    """Create the run directory and write the resolved config (with the command on top)."""
    run_dir = Path(cfg.trainer.run_dir.replace("{time}", time.strftime("%Y%m%d-%H%M%S")))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(f"# {command}\n" + config_to_yaml(cfg))
    return run_dir


def prepare_model(cfg: Config, log=print) -> str:
    """The model directory every fleet loads: the configured one, or the embedded tiny model
    (built and warm-started here, cached across runs)."""
    if cfg.trainer.model_path is not None:
        if not (Path(cfg.trainer.model_path) / "config.json").is_file():
            raise LaunchError(f"trainer.model_path={cfg.trainer.model_path!r} has no config.json")
        return cfg.trainer.model_path
    from asyncrl.tasks import setup_embedded_task
    from asyncrl.tiny_model import prepare_embedded_model

    task = setup_embedded_task(cfg.data.task, cfg.data.task_max_operand, cfg.data.seed)
    return str(
        prepare_embedded_model(
            cfg.trainer.cache_dir, task, cfg.trainer.warmstart_steps, cfg.trainer.seed, log=log
        )
    )


def threads_per_process(cfg: Config) -> int:
    if cfg.launch.threads_per_process:
        return cfg.launch.threads_per_process
    compute = cfg.rollout.num_servers + cfg.learner.world_size
    return max(1, (os.cpu_count() or 1) // compute)


def process_env(spec: RunSpec, name: str) -> dict[str, str]:
    """What every fleet process has in its environment, whichever backend starts it: its
    thread counts, and its name and run (so `ps e` or a test can tell whose process it is)."""
    return {
        "OMP_NUM_THREADS": str(spec.threads),
        "MKL_NUM_THREADS": str(spec.threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "ASYNCRL_PROCESS": name,
        "ASYNCRL_RUN_DIR": spec.run_dir,
    }


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


def start_fleets(cfg: Config, run_dir: Path, model_path: str, with_learner: bool = True) -> Fleet:
    """Start the replay (and wait until it answers), the servers and, when training, the
    learner ranks, with the configured backend. Without a learner the servers keep the weights
    they loaded."""
    if cfg.launch.backend == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise LaunchError(
                'launch.backend=ray needs Ray: pip install -e ".[ray]" (or pip install ray)'
            ) from None
        from asyncrl.ray_launcher import start_ray_fleets

        return start_ray_fleets(cfg, run_dir, model_path, with_learner)
    return start_local_fleets(cfg, run_dir, model_path, with_learner)


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
    worker = [sys.executable, "-m", "asyncrl.worker"]
    try:
        fleet.start("replay", [*worker, "replay", str(spec_path)], process_env(spec, "replay"))
        wait_for_replay(
            fleet, lambda: replay_answers(spec.replay_address), cfg.launch.startup_timeout_s
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


def replay_answers(address: str) -> bool:
    """Whether the replay at `address` answers a stats request within half a second."""
    client = ReplayClient(address, reply_timeout_s=0.5)
    try:
        client.stats()
        return True
    except ReplayUnavailable:
        return False
    finally:
        client.close()


def wait_for_replay(fleet: Fleet, answers: Callable[[], bool], timeout_s: float) -> None:
    """Until `answers()` (the replay is up); LaunchError if a member dies or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (dead := fleet.first_dead()) is not None:
            raise LaunchError(dead.describe_exit())
        if answers():
            return
    raise LaunchError(f"replay did not start within {timeout_s:.0f}s")


def watch(fleet: Fleet, progress: Progress) -> None:
    """Until every learner rank has finished; raise LaunchError if any member dies first."""
    metrics = Path(fleet.spec.run_dir) / "metrics.jsonl"
    while True:
        progress.update(read_jsonl(metrics))
        if (dead := fleet.first_dead()) is not None:
            raise LaunchError(dead.describe_exit())
        if fleet.learners_finished():
            progress.update(read_jsonl(metrics), final=True)
            return
        time.sleep(0.25)


def serve(cfg: Config, command: str = "asyncrl serve") -> tuple[Fleet, Path]:
    """Start the replay and the rollout servers only, on trainer.model_path (any checkpoint
    directory) or the embedded model; the caller stops the fleet."""
    run_dir = prepare_run_dir(cfg, command)
    model_path = prepare_model(cfg)
    fleet = start_fleets(cfg, run_dir, model_path, with_learner=False)
    return fleet, run_dir


def launch(cfg: Config, command: str = "asyncrl launch") -> Path:
    """Run one training job end to end; returns the run directory."""
    started = time.monotonic()
    run_dir = prepare_run_dir(cfg, command)
    print(f"asyncrl: run directory {run_dir}", flush=True)
    model_path = prepare_model(cfg)
    fleet = start_fleets(cfg, run_dir, model_path)
    print(
        f"asyncrl: started replay, {cfg.rollout.num_servers} rollout server(s), "
        f"{cfg.learner.world_size} learner rank(s); logs in {run_dir / 'logs'}",
        flush=True,
    )
    progress = Progress(
        cfg.trainer.total_steps, cfg.replay.max_staleness, cfg.launch.progress, started
    )
    try:
        watch(fleet, progress)
    finally:
        fleet.stop_all()
    summary = progress.summary(read_jsonl(run_dir / "metrics.jsonl"))
    print(f"asyncrl: done in {time.monotonic() - started:.0f}s. {summary}", flush=True)
    if cfg.trainer.save_final:
        print(f"asyncrl: final weights in {run_dir / 'final'}", flush=True)
    return run_dir
