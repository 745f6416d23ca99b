"""Where step metrics go: `trainer.logger` names any of console, jsonl, wandb, tensorboard.

`metrics.jsonl` in the run directory is always written (the launcher's progress display and
`asyncrl` tools read it), so `jsonl` is implied. wandb runs offline unless `WANDB_MODE` says
otherwise: no account or network is needed, and the run lands in `run_dir/wandb/`
(`wandb sync` uploads it later). tensorboard writes event files to `run_dir/tensorboard/`.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from asyncrl.metrics import JsonlWriter

log = logging.getLogger("asyncrl.loggers")


class MetricsLogger(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    def __init__(self, path: Path):
        self._writer = JsonlWriter(path)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._writer.write({"step": step, **metrics})

    def close(self) -> None:
        self._writer.close()


class ConsoleLogger:
    """A compact line per step in the learner's log (the launcher shows its own progress)."""

    KEYS = (
        "reward_mean",
        "val/mean_score",
        "loss",
        "mismatch_kl",
        "staleness_mean",
        "samples_per_s",
    )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        parts = [f"{k}={metrics[k]:.4g}" for k in self.KEYS if isinstance(metrics.get(k), float)]
        log.info("step %d %s", step, " ".join(parts))

    def close(self) -> None:
        pass


class WandbLogger:
    def __init__(self, run_dir: Path, project: str, name: str, config: dict[str, Any]):
        wandb = _require("wandb")

        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        self._run = wandb.init(project=project, name=name, dir=str(run_dir), config=config)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        self._run.finish()


class TensorboardLogger:
    def __init__(self, run_dir: Path):
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self._writer.add_scalar(k, v, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _require(package: str) -> Any:
    try:
        return importlib.import_module(package)
    except ImportError:
        raise RuntimeError(
            f"trainer.logger includes {package} but it is not installed: "
            "pip install -e '.[loggers]'"
        ) from None


class MultiLogger:
    """Fans one record out to every configured logger."""

    def __init__(self, loggers: list[MetricsLogger]):
        self.loggers = loggers

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for lg in self.loggers:
            lg.log(metrics, step)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def setup_loggers(names: Sequence[str], run_dir: Path, config: dict[str, Any]) -> MultiLogger:
    """The loggers named in `trainer.logger` (metrics.jsonl always included)."""
    loggers: list[MetricsLogger] = [JsonlLogger(run_dir / "metrics.jsonl")]
    for name in dict.fromkeys(names):
        if name == "console":
            loggers.append(ConsoleLogger())
        elif name == "wandb":
            loggers.append(WandbLogger(run_dir, "asyncrl", run_dir.name, config))
        elif name == "tensorboard":
            loggers.append(TensorboardLogger(run_dir))
    return MultiLogger(loggers)
