"""What runs inside the Ray cluster for the Ray launcher (`ray_cluster.py`): one `FleetProcess`
actor per fleet process, which runs the same role function as a local process, and the small
zero-CPU tasks the launcher pins next to an actor (signals, a replay probe, the replay's view
of the servers' health).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from asyncrl.config import Config
from asyncrl.launch.fleet import log_tail, replay_answers, replay_health
from asyncrl.launch.worker import ProcessRole, run_process
from asyncrl.run_spec import RunSpec
from asyncrl.wire.auth import RoleKey
from asyncrl.wire.protocol import ServerHealth
from asyncrl.wire.sockets import free_ports


@dataclass(frozen=True)
class Location:
    node_ip: str  # the node's address as Ray knows it
    node_id: str  # Ray's node id (to pin a task next to the actor)
    pid: int  # the actor's process on that node


def redirect_output(log_path: Path) -> None:
    """Send this process's stdout and stderr (file descriptors, so C++ output too) to its log
    file, as the local launcher does, instead of Ray's worker logs."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (1, 2):
        os.dup2(fd, stream)
    os.close(fd)


@ray.remote(max_restarts=0)
class FleetProcess:
    """One fleet process. A plain (one-call-at-a-time) actor runs its calls on the process's
    main thread, which the roles need for their SIGTERM handlers."""

    def __init__(self, log_path: str, cwd: str):
        self.log_path = Path(log_path)
        redirect_output(self.log_path)
        with contextlib.suppress(OSError):  # relative config paths mean the launcher's cwd
            os.chdir(cwd)

    def locate(self) -> Location:
        context = ray.get_runtime_context()
        return Location(ray.util.get_node_ip_address(), context.get_node_id(), os.getpid())

    def free_ports(self, host: str, count: int) -> list[int]:
        """`count` distinct ports free on this node now (`asyncrl.wire.sockets.free_ports`)."""
        return free_ports(host, count)

    def run(self, who: ProcessRole, spec: RunSpec, cfg: Config, env: dict[str, str]) -> int:
        """Run `who`'s role here; `env` is what a local process would get in its environment
        at its start and an actor cannot (set once it exists): a learner rank's torchrun
        variables, a restarted server's key (`asyncrl.wire.auth.auth_env`)."""
        os.environ.update(env)
        return run_process(who, spec, cfg)

    def log_tail(self) -> str:
        return log_tail(self.log_path)


@ray.remote(num_cpus=0)
def signal_processes(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@ray.remote(num_cpus=0)
def replay_answers_on_node(address: str, auth: RoleKey) -> bool:
    return replay_answers(address, auth)


@ray.remote(num_cpus=0)
def replay_health_on_node(address: str, auth: RoleKey) -> list[ServerHealth] | None:
    return replay_health(address, auth)


def on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)
