"""Entry point of every fleet process:
`python -m asyncrl.launch.worker ROLE SPEC [--index I] [--epoch E]`.

The local launcher starts one of these per process; the Ray launcher's actors call
`run_process` directly with the spec, config and `ProcessRole` they were handed. Either way
errors become a clear message and exit code 1 here, at the process boundary, and the launcher
names the process that died.

What a process is told comes in two typed parts, each read once, here: the run's `RunSpec`
(the same for every process, written once to run_dir/launch.json) and its own `ProcessRole`
(its role, index and epoch, on its command line or in the Ray actor's call). The epoch is
per process, not per run: it changes at every restart of a server while the run and its
launch.json stay, so it is no field of the spec. Only secrets come in the environment
(`asyncrl.wire.auth`: a command line is readable by every user); see docs/architecture.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass

from asyncrl.config import Config, load_config
from asyncrl.run_spec import RunSpec

ROLES = ("replay", "server", "learner", "reward_model")


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        force=True,  # a Ray worker may have configured the root logger already
    )


@dataclass(frozen=True)
class ProcessRole:
    """Who one fleet process is (the per-process part of what the launcher tells it)."""

    role: str  # one of ROLES
    index: int = 0  # a rollout server's or reward-model server's index (0 for the others)
    epoch: int = 0  # a rollout server's start count: 0 at the first, one more per restart

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; expected one of {ROLES}")
        if self.index < 0 or self.epoch < 0:
            raise ValueError(f"{self.role}: index {self.index} and epoch {self.epoch} are >= 0")

    @property
    def name(self) -> str:
        """replay, server_<index>, reward_model_<index>, learner (a learner rank's launcher
        calls it learner_<rank>)."""
        return f"{self.role}_{self.index}" if self.role in ("server", "reward_model") else self.role

    def argv(self, spec_path: str) -> list[str]:
        """The worker's arguments that `parse_args` reads back into this role."""
        if self.role in ("replay", "learner"):
            return [self.role, spec_path]
        epoch = ["--epoch", str(self.epoch)] if self.role == "server" else []
        return [self.role, spec_path, "--index", str(self.index), *epoch]


def run_role(who: ProcessRole, spec: RunSpec, cfg: Config) -> None:
    """Run one role to its end in this process (until stopped, for the replay and servers)."""
    if who.role == "replay":
        from replay.service import run_replay

        run_replay(cfg, spec.replay_address, spec.run_dir, spec.model_path)
    elif who.role == "server":
        from rollout_servers.factories import run_server

        run_server(spec, cfg, who.index, who.epoch)
    elif who.role == "reward_model":
        from reward_models.server import run_reward_model_server

        run_reward_model_server(spec, cfg, who.index)
    else:
        from learner.trainer import run_learner

        run_learner(spec, cfg)


def run_process(who: ProcessRole, spec: RunSpec, cfg: Config) -> int:
    """`run_role` with logging set up; an exception is logged with its traceback and becomes
    code 1. Returns the process's exit code."""
    setup_logging(who.name)
    try:
        run_role(who, spec, cfg)
    except Exception:
        logging.getLogger("asyncrl.launch.worker").exception("%s failed", who.name)
        return 1
    return 0


def parse_args(argv: list[str] | None = None) -> tuple[ProcessRole, str]:
    """This process's role and the path of its run's spec, from its command line."""
    parser = argparse.ArgumentParser(prog="python -m asyncrl.launch.worker")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("spec", help="run_dir/launch.json written by the launcher")
    parser.add_argument("--index", type=int, default=0, help="server (or reward-model) index")
    parser.add_argument("--epoch", type=int, default=0, help="a rollout server's restart count")
    args = parser.parse_args(argv)
    return ProcessRole(args.role, args.index, args.epoch), args.spec


def main(argv: list[str] | None = None) -> int:
    who, spec_path = parse_args(argv)
    spec = RunSpec.load(spec_path)
    return run_process(who, spec, load_config(spec.config_path))


def exit_now(code: int) -> None:
    """Flush and leave without interpreter teardown: the process-group objects of torch
    (gloo/NCCL, TCPStore) own C++ threads whose destruction order at finalisation is not
    defined and can abort a process that already finished its work cleanly. (Ray actors end
    the same way: the Ray launcher ends them with `ray.kill`, never by a clean exit.)"""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
