"""The `asyncrl` subcommands other than `eval` (`asyncrl.launch.eval_command`): launch, serve,
config, plot, data and model; `asyncrl.launch.cli` parses the command line and calls them.

Each imports the launch layer only when it runs, so a config that fails at once is refused
before anything heavy loads.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path

from asyncrl.config import Config, ConfigError, config_to_yaml, load_config


def split_config_and_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt, which stops the fleets in order (a training
    run's learner writes its checkpoint first, `asyncrl.launch.interrupt`). SIGINT is
    set explicitly: a launcher started as a background job of a script inherits it ignored
    (the shell does that), and Python then never installs its own handler, so `kill -INT` did
    nothing and the fleets trained on (seen in a local CI run: 20 minutes, until the end)."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def cmd_launch(ns: argparse.Namespace) -> int:
    resume, args = _resumed_run_dir(ns)
    cfg = config_from_args(args) if resume is None else _resume_config(resume, args)
    if ns.dry_run:
        sys.stdout.write(config_to_yaml(cfg, comments=True))
        return 0
    from asyncrl.launch.fleet import LaunchError
    from asyncrl.launch.interrupt import RunInterrupted
    from asyncrl.launch.run import launch

    stop_on_signals()
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


def _resume_config(run_dir: str, args: list[str]) -> Config:
    """`--resume RUN_DIR [overrides]`: the run's own config.yaml, the overrides on top."""
    from asyncrl.launch.resume import resume_config

    config_path, overrides = split_config_and_overrides(args)
    if config_path is not None:
        raise ConfigError(
            f"a resume of {run_dir} runs with its own config.yaml: give overrides only "
            f"(section.key=value), not {config_path}"
        )
    return resume_config(run_dir, overrides)


def config_from_args(args: list[str]) -> Config:
    """`[CONFIG] [section.key=value ...]`: the config file (default configs/default.yaml) with
    the overrides on top, validated."""
    config_path, overrides = split_config_and_overrides(args)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"expected section.key=value overrides after the config file, got {bad}")
    return load_config(config_path, overrides)


def cmd_serve(ns: argparse.Namespace) -> int:
    from asyncrl.launch.fleet import LaunchError
    from asyncrl.launch.restarts import watch_serving
    from asyncrl.launch.run import serve

    cfg = config_from_args(ns.args)
    stop_on_signals()
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


def cmd_config(ns: argparse.Namespace) -> int:
    """Every key of the config (or of one section): type, default, bound, docstring."""
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
