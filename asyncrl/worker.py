"""Entry point of every fleet process: `python -m asyncrl.worker ROLE SPEC [--index I]`.

The launcher starts one of these per process; errors become a clear message and exit code 1
here, at the process boundary, and the launcher names the process that died.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.run_spec import RunSpec


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.worker")
    parser.add_argument("role", choices=["replay", "server", "learner"])
    parser.add_argument("spec", help="run_dir/launch.json written by the launcher")
    parser.add_argument("--index", type=int, default=0, help="server index")
    args = parser.parse_args(argv)
    spec = RunSpec.load(args.spec)
    cfg = load_config(spec.config_path)
    name = f"{args.role}_{args.index}" if args.role == "server" else args.role
    setup_logging(name)
    log = logging.getLogger("asyncrl.worker")
    try:
        if args.role == "replay":
            from replay.service import run_replay

            run_replay(cfg, spec.replay_address, str(Path(spec.run_dir) / "stats" / "replay.json"))
        elif args.role == "server":
            from rollout_servers.server import run_server

            run_server(spec, cfg, args.index)
        else:
            from learner.trainer import run_learner

            run_learner(spec, cfg)
    except Exception:
        log.exception("%s failed", name)
        return 1
    return 0


def exit_now(code: int) -> None:
    """Flush and leave without interpreter teardown: the process-group objects of torch
    (gloo/NCCL, TCPStore) own C++ threads whose destruction order at finalisation is not
    defined and can abort a process that already finished its work cleanly."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
