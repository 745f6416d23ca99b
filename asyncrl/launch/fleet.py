"""What the local and the Ray launcher share: the `Fleet` they hand back, the run directory,
the model every fleet loads, each process's environment, and how a failure is raised.

A backend (`local.py`, `ray_cluster.py`) starts the processes and returns a `Fleet`; everything
after that (waiting for the replay, naming the first process to die and the deaths that
followed it, see `failures.py`; the watch loop that shows progress and restarts dead servers,
`restarts.py`) is shared, so both backends behave the same.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from asyncrl.config import Config, config_to_yaml
from asyncrl.data.prompts import setup_task
from asyncrl.launch.failures import EndedMember, failure_report
from asyncrl.run_spec import RunSpec
from asyncrl.wire.auth import RoleKey, auth_env, new_secret, read_secret, role_key, write_secret
from asyncrl.wire.protocol import ServerHealth
from asyncrl.wire.replay_client import ReplayClient, ReplayUnavailable

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

    def stop_learners(self) -> None:
        """SIGTERM the running learner ranks only (an interrupt: they end their step and
        checkpoint it, `asyncrl.launch.interrupt`); every other member keeps running."""
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
    new run secret (`asyncrl.wire.auth`: every process of the run derives its key from it)."""
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
    thread counts, its name and run (so `ps e` or a test can tell whose process it is; no
    process reads them), and its key (`asyncrl.wire.auth.auth_env`: the run secret for the
    replay, a role key for others). Nothing else of ours: what a process is told travels in
    its `RunSpec` and `asyncrl.launch.worker.ProcessRole` (docs/architecture.md)."""
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


class ServerDeaths(Protocol):
    """What `raise_on_failure` asks of the restart rules (`restarts.ServerRestarts`)."""

    def failures(self, fleet: Fleet) -> list[EndedMember]:
        """`fleet.failures()` less the server deaths they take on."""
        ...

    def earlier(self) -> list[str]:
        """The server deaths so far, for the report of a failure that ends the run."""
        ...


def raise_on_failure(
    fleet: Fleet,
    window_s: float = FOLLOWERS_WINDOW_S,
    restarts: ServerDeaths | None = None,
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


def print_line(line: str) -> None:
    print(line, flush=True)
