"""`asyncrl eval`: score a dataset with rollout servers, already up (`--address`) or started for
it; `asyncrl.launch.cli` parses the command line and calls `cmd_eval`.

The steps: the config (a run's own, with its weights, for `--run-dir` without `--address`),
the prompts (every row checked first), the scoring through the replay, and the summary
written as JSON (`--output`, else under the run directory).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config, ConfigError
from asyncrl.launch.commands import config_from_args, split_config_and_overrides, stop_on_signals

if TYPE_CHECKING:
    from asyncrl.launch.eval_weights import RunWeights
    from asyncrl.wire.protocol import PromptItem


def cmd_eval(ns: argparse.Namespace) -> int:
    """Send a dataset through running servers (--address) or a fleet started for it. That fleet
    serves --run-dir's own weights when given a run (its final weights, else its latest
    checkpoint's: `asyncrl.launch.eval_weights`), else the config's model."""
    from asyncrl.evaluation import eval_prompts, load_eval_rows
    from asyncrl.launch.data_check import DataError
    from asyncrl.launch.fleet import LaunchError
    from asyncrl.launch.run import check_eval_data

    _move_config_args_out_of_data(ns)
    # unguessable: a job belongs to its first sender, so another client must not take its id
    job = f"eval-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(4)}"
    cfg, weights = _eval_config(ns, job)
    n = ns.n or cfg.data.val_n
    temperature = cfg.data.val_temperature if ns.temperature is None else ns.temperature
    check_eval_data(ns.data, cfg)
    rows = load_eval_rows(ns.data, cfg.data)
    try:
        prompts = eval_prompts(rows, n, temperature, job)
    except ValueError as e:  # a bad row after the first (rows counted across the files)
        raise DataError(f"--data {' '.join(ns.data)}: {e}") from None
    stop_on_signals()
    try:
        summary, run_dir = _score(ns, cfg, weights, prompts, n, job)
    except LaunchError as e:
        print(f"asyncrl: eval failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nasyncrl: interrupted", file=sys.stderr)
        return 130
    print()
    for key, value in summary.items():
        print(f"  {key:40s} {value:.4f}")
    scored = {} if weights is None else {"weights": str(weights.path), "step": weights.step}
    results = {"data": ns.data, "n": n, "temperature": temperature, **scored, **summary}
    _write_results(ns, run_dir, job, results)
    return 0


def _eval_config(ns: argparse.Namespace, job: str) -> tuple[Config, RunWeights | None]:
    """The config to score with, and the weights of --run-dir's run when the fleet started for
    the job serves them (--run-dir without --address: with that run's config)."""
    from asyncrl.launch.eval_weights import run_eval_config

    weights = None
    if ns.run_dir and not ns.address:  # RUN's weights, with RUN's config
        cfg, weights = run_eval_config(ns.run_dir, *split_config_and_overrides(ns.args), job)
    else:
        cfg = config_from_args(ns.args)
    if ns.output is None and ns.address and not ns.run_dir:
        raise ConfigError(
            "asyncrl eval --address without --run-dir: say where the results go with --output FILE"
        )
    return cfg, weights


def _score(
    ns: argparse.Namespace,
    cfg: Config,
    weights: RunWeights | None,
    prompts: list[PromptItem],
    n: int,
    job: str,
) -> tuple[dict[str, float], Path | None]:
    """Run the job through the servers at --address, or through a fleet started for it (and
    stopped after, its exported weights deleted); the summary and that fleet's run directory."""
    from asyncrl.evaluation import run_eval_job
    from asyncrl.launch.eval_weights import delete_export, serving
    from asyncrl.launch.fleet import client_key
    from asyncrl.launch.run import serve
    from asyncrl.wire.replay_client import ReplayClient

    fleet, run_dir = None, None
    try:
        if ns.address:
            address, auth = ns.address, _eval_key(ns)
        else:
            if weights is not None:
                print(f"asyncrl: evaluating {weights.describe()}", flush=True)
                cfg = serving(cfg, weights)
            fleet, run_dir = serve(cfg, command="asyncrl eval " + shlex.join(ns.args))
            address, auth = fleet.spec.replay_address, client_key(fleet.spec)
        print(
            f"asyncrl: evaluating {len(prompts)} prompts x {n} samples through {address}",
            flush=True,
        )
        summary = run_eval_job(
            ReplayClient(address, auth),
            prompts,
            job,
            cfg.trainer.val_timeout_s,
            progress=_eval_progress,
        )
    finally:
        if fleet is not None:
            fleet.stop_all()
        if weights is not None:
            delete_export(cfg)  # a copy of a checkpoint's weights, if one was made
    return summary, run_dir


def _write_results(
    ns: argparse.Namespace, run_dir: Path | None, job: str, results: dict[str, Any]
) -> None:
    """The summary as JSON: --output, else in --run-dir's run, else in the fleet's own run
    directory (`eval/<job>.json`)."""
    from asyncrl.metrics import write_json_atomic

    if ns.output:
        out = Path(ns.output)
    elif ns.run_dir:
        out = Path(ns.run_dir) / "eval" / f"{job}.json"
    else:
        assert run_dir is not None  # --address without --run-dir nor --output is refused first
        out = run_dir / "eval" / f"{job}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, results)
    print(f"asyncrl: results written to {out}")


def _move_config_args_out_of_data(ns: argparse.Namespace) -> None:
    """`--data` takes several files, so argparse also hands it whatever follows it: the
    `section.key=value` overrides and a YAML config given after it go back where they belong,
    in the order given, so `eval --data X key=value` means what it says."""
    data = [a for a in ns.data if not _is_config_arg(a)]
    moved = [a for a in ns.data if _is_config_arg(a)]
    if not data:
        raise ConfigError(f"asyncrl eval --data names no data file (got {ns.data})")
    configs = [a for a in moved if "=" not in a]
    ns.data, ns.args = data, configs + list(ns.args) + [a for a in moved if "=" in a]


def _is_config_arg(arg: str) -> bool:
    """A `section.key=value` override or a YAML config file, not a data file."""
    key = arg.split("=", 1)[0]
    is_override = "=" in arg and "/" not in key and "." in key
    return is_override or arg.endswith((".yaml", ".yml"))


def _eval_key(ns: argparse.Namespace):
    """The client key for a replay started elsewhere: from --secret-file, --run-dir, or
    $ASYNCRL_RUN_SECRET."""
    from asyncrl.wire.auth import SECRET_ENV, AuthError, key_from_env, read_secret, role_key

    if ns.secret_file or ns.run_dir:
        try:
            return role_key(read_secret(ns.secret_file or ns.run_dir), "client")
        except AuthError as e:
            raise ConfigError(str(e)) from None
    if os.environ.get(SECRET_ENV):
        return key_from_env("client")
    raise ConfigError(
        "asyncrl eval --address needs the run's secret: --run-dir RUN_DIR (of the `asyncrl "
        f"serve`/`launch` run), --secret-file FILE, or ${SECRET_ENV}"
    )


def _eval_progress(done: int, expected: int) -> None:
    print(f"\r  {done}/{expected} samples scored", end="", flush=True)
