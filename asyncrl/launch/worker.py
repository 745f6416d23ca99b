"""Entry point of every fleet process: `python -m asyncrl.launch.worker ROLE SPEC [--index I]`.

The local launcher starts one of these per process; the Ray launcher's actors call
`run_process` directly with the spec and config they were handed. Either way errors become a
clear message and exit code 1 here, at the process boundary, and the launcher names the
process that died.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

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


def process_name(role: str, index: int = 0) -> str:
    """replay, server_<index>, reward_model_<index>, learner (a learner rank's launcher calls
    it learner_<rank>)."""
    return f"{role}_{index}" if role in ("server", "reward_model") else role


def run_role(role: str, spec: RunSpec, cfg: Config, index: int = 0) -> None:
    """Run one role to its end in this process (until stopped, for the replay and servers)."""
    if role == "replay":
        from replay.service import run_replay

        run_replay(cfg, spec.replay_address, spec.run_dir, spec.model_path)
    elif role == "server":
        from rollout_servers.factories import run_server

        run_server(spec, cfg, index)
    elif role == "reward_model":
        from reward_models.server import run_reward_model_server

        run_reward_model_server(spec, cfg, index)
    elif role == "learner":
        from learner.trainer import run_learner

        run_learner(spec, cfg)
    else:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")


def run_process(role: str, spec: RunSpec, cfg: Config, index: int = 0) -> int:
    """`run_role` with logging set up; an exception is logged with its traceback and becomes
    code 1. Returns the process's exit code."""
    name = process_name(role, index)
    setup_logging(name)
    try:
        run_role(role, spec, cfg, index)
    except Exception:
        logging.getLogger("asyncrl.launch.worker").exception("%s failed", name)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.launch.worker")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("spec", help="run_dir/launch.json written by the launcher")
    parser.add_argument("--index", type=int, default=0, help="server (or reward-model) index")
    args = parser.parse_args(argv)
    spec = RunSpec.load(args.spec)
    return run_process(args.role, spec, load_config(spec.config_path), args.index)


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
