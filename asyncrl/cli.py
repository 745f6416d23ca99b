"""The `asyncrl` command line.

    asyncrl launch [CONFIG] [section.key=value ...] [--dry-run]

CONFIG defaults to configs/default.yaml (the embedded default: a tiny model on a synthetic task,
on CPU). Overrides are validated with the file before anything starts.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys

from asyncrl.config import ConfigError, config_to_yaml, load_config


def _split_config_and_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_launch(ns: argparse.Namespace) -> int:
    config_path, overrides = _split_config_and_overrides(ns.args)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"expected section.key=value overrides after the config file, got {bad}")
    cfg = load_config(config_path, overrides)
    if ns.dry_run:
        sys.stdout.write(config_to_yaml(cfg))
        return 0
    from asyncrl.launcher import LaunchError, launch

    signal.signal(signal.SIGTERM, _interrupt)  # stop the fleets in order, as on Ctrl-C
    command = "asyncrl launch " + shlex.join(ns.args)
    try:
        launch(cfg, command=command.strip())
    except LaunchError as e:
        print(f"asyncrl: launch failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nasyncrl: interrupted; every process was stopped", file=sys.stderr)
        return 130
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("launch", help="train: start the replay, rollout servers and learner")
    p.add_argument("args", nargs="*", metavar="[CONFIG] [section.key=value ...]")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=cmd_launch)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except ConfigError as e:
        print(f"asyncrl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
