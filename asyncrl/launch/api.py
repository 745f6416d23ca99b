"""The Python entry point: a training job from a script or a notebook, as `asyncrl launch`
runs it from the shell (`asyncrl.run` is this function).

    import asyncrl
    from asyncrl.config import load_config

    cfg = load_config()  # configs/default.yaml (the embedded default), or load_config(PATH)
    cfg.rollout.n = 8  # assignments are validated
    result = asyncrl.run(cfg, ["trainer.total_steps=50"])
    result.run_dir, result.final["reward_mean"]

A `Config` built from scratch (`Config(rollout={"n": 8})`) has the library's defaults, not
configs/default.yaml's. Either is validated as a YAML file is: unknown keys and bad values
raise `ConfigError` naming them before anything starts; a process that fails raises `LaunchError`
naming it. Every process is stopped before `run` returns or raises (Ctrl-C included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.config import Config, ConfigError, apply_overrides, load_config
from asyncrl.launch.progress import training_rows
from asyncrl.launch.resume import resume_config
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl


@dataclass
class RunResult:
    """What a finished run left: its directory and its per-step metrics."""

    run_dir: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """One row per learner step (metrics.jsonl's training rows), in step order."""

    @property
    def final(self) -> dict[str, Any]:
        """The last step's metrics ({} when no step ran)."""
        return self.metrics[-1] if self.metrics else {}


def run(
    config: Config | str | Path | None = None,
    overrides: Sequence[str] = (),
    resume: str | Path | None = None,
) -> RunResult:
    """Train as `asyncrl launch` does: `config` is a `Config`, a YAML file, or None for the
    embedded default (configs/default.yaml); `overrides` are `section.key=value` strings
    applied on top. `resume`: a run directory to continue in place from its newest checkpoint
    with its own config (`asyncrl launch --resume`; `config` must then be None). Returns when
    the run ends."""
    if resume is not None:
        if config is not None:
            raise ConfigError("asyncrl.run(resume=...) continues the run with its own config")
        cfg = resume_config(resume, overrides)
        args = [f"resume={str(resume)!r}", *map(repr, overrides)]
    else:
        if isinstance(config, Config):
            cfg = apply_overrides(config, overrides)
        else:
            cfg = load_config(config, list(overrides))
        given = "Config(...)" if isinstance(config, Config) else repr(str(config))
        args = [given, *map(repr, overrides)]  # (a Config's values are in config.yaml)
    run_dir = launch(cfg, command="asyncrl.run(" + ", ".join(args) + ")")
    return RunResult(run_dir, training_rows(read_jsonl(run_dir / "metrics.jsonl")))
