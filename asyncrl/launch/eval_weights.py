"""The weights `asyncrl eval --run-dir RUN` scores when it starts its own fleet (no --address):
RUN's, never the model the run started from.

Which weights (`run_weights`):
1. RUN/final, the Hugging Face directory a finished run writes (`trainer.save_final`), when it
   holds its config.json and is at least as new as RUN's newest complete checkpoint;
2. else RUN's newest complete checkpoint (`asyncrl.checkpoints.latest_checkpoint`): a run
   still going, interrupted, run with `trainer.save_final=false`, or finished and then resumed
   to go further (`--resume RUN trainer.total_steps=...`), which leaves the old final/ in place
   until it finishes again;
3. else none: ConfigError naming what RUN lacks.

"As new": final/ records its learner version (`asyncrl.checkpoints.final_step`), compared with
the checkpoint's step. Final weights written before that was recorded are compared by time
instead: final/config.json's modification time against the checkpoint's trainer.json (final/
is written after the run's last checkpoint, and a resumed run's checkpoints after it).
metrics.jsonl cannot date final/: after a resume its last step is the resumed run's. Falling back to the run's starting model is
   what this module exists to prevent (issue 40: such an eval scored the warm-start, 0.55,
   for a run whose own weights scored 0.87).

A checkpoint holds the learner's sharded state (torch.distributed.checkpoint), which no engine
loads, so `export_checkpoint` turns its model part into a Hugging Face directory the way the
learner writes RUN/final (`learner.checkpoint.save_final_weights`): the run's own model
(its `trainer.model_path`, or the embedded model the run was warm-started to), with the run's
LoRA adapters when it had them, loaded from the shards in one process without a process group,
and saved in float32 with the tokenizer. With LoRA the adapters are merged, as in RUN/final.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from asyncrl.checkpoints import SHARDS_DIR, TRAINER_FILE, final_step, latest_checkpoint
from asyncrl.config import Config, ConfigError, load_config, parse_override

FINAL_DIR = "final"
"""Where a finished run's weights are (`trainer.save_final`), relative to its run directory."""

EXPORTED_MODEL = "model"
"""Where, in its fleet's directory RUN/eval/<job>/, an eval of a checkpoint puts the checkpoint
exported as a Hugging Face directory (deleted when the eval ends: a copy of the weights)."""


@dataclass(frozen=True)
class RunWeights:
    """The weights of a run directory that an evaluation scores."""

    path: Path  # RUN/final (a Hugging Face directory) or RUN/checkpoints/step_N
    step: int | None  # the checkpoint's learner step; None for the final weights
    older_final: bool = False  # a checkpoint chosen over RUN/final, which is older

    def describe(self) -> str:
        """How the eval names them in its output."""
        if self.step is None:
            return f"the run's final weights ({self.path})"
        why = (
            f"its {FINAL_DIR}/ weights are older: it was resumed after it finished"
            if self.older_final
            else f"the run has no {FINAL_DIR}/ weights: not finished, or trainer.save_final=false"
        )
        return f"the run's latest checkpoint, step {self.step} ({self.path}; {why})"


def run_weights(run_dir: str | Path) -> RunWeights:
    """RUN's final weights unless its newest complete checkpoint is newer, else that checkpoint
    (module docstring); ConfigError when it has neither."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        what = "does not exist" if not run_dir.exists() else "has no config.yaml"
        raise ConfigError(
            f"--run-dir {run_dir} {what}: it is not a run directory (the trainer.run_dir of an "
            "`asyncrl launch`)"
        )
    final = run_dir / FINAL_DIR
    has_final = (final / "config.json").is_file()
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        if has_final:
            return RunWeights(final, None)
    else:
        step = int(checkpoint.name.removeprefix("step_"))
        if has_final and _final_is_as_new(final, checkpoint, step):
            return RunWeights(final, None)
        return RunWeights(checkpoint, step, older_final=has_final)
    raise ConfigError(
        f"--run-dir {run_dir} has no weights to evaluate: no {final}/config.json (written when "
        f"a run ends, trainer.save_final) and no complete checkpoint under "
        f"{run_dir / 'checkpoints'} (trainer.save_every); to score the model it started from, "
        "drop --run-dir"
    )


def _final_is_as_new(final: Path, checkpoint: Path, step: int) -> bool:
    """Whether RUN/final holds weights at least as new as `checkpoint` (of learner `step`): by
    its recorded version, else (older runs) by modification time (module docstring)."""
    recorded = final_step(final)
    if recorded is not None:
        return recorded >= step
    final_time = (final / "config.json").stat().st_mtime
    return final_time >= (checkpoint / TRAINER_FILE).stat().st_mtime


def run_eval_config(
    run_dir: str, config_path: str | None, overrides: list[str], job: str
) -> tuple[Config, RunWeights]:
    """`eval --run-dir RUN` without --address: RUN's own config.yaml with `overrides` on top,
    the eval fleet's directory RUN/eval/<job>/ (its logs, config and secret), and RUN's weights.
    ConfigError when RUN has none, or for a config file, a model or a run directory given
    alongside (RUN decides all three)."""
    weights = run_weights(run_dir)
    if config_path is not None:
        raise ConfigError(
            f"asyncrl eval --run-dir {run_dir} runs with that run's config.yaml: give "
            f"overrides only (section.key=value), not {config_path}"
        )
    for text in overrides:
        if parse_override(text)[0] in (["trainer", "model_path"], ["trainer", "run_dir"]):
            raise ConfigError(
                f"{text} with asyncrl eval --run-dir {run_dir}: the run's weights are scored "
                "and the results written under it; drop --run-dir to evaluate another model "
                "(trainer.model_path=DIR)"
            )
    cfg = load_config(
        Path(run_dir) / "config.yaml", ["trainer.resume_from=null", *overrides], run_dir_config=True
    )
    return _with_trainer(cfg, run_dir=str(Path(run_dir) / "eval" / job)), weights


def serving(cfg: Config, weights: RunWeights) -> Config:
    """`cfg` (`run_eval_config`'s) serving `weights`: RUN/final as it is, a checkpoint exported
    first into RUN/eval/<job>/model on the run's own model (`export_checkpoint`)."""
    model = weights.path
    if weights.step is not None:
        model = export_checkpoint(weights.path, cfg, Path(cfg.trainer.run_dir) / EXPORTED_MODEL)
    return _with_trainer(cfg, model_path=str(model))


def delete_export(cfg: Config) -> None:
    """Delete what `serving` exported for `cfg`, if anything: a copy of a run's weights."""
    shutil.rmtree(Path(cfg.trainer.run_dir) / EXPORTED_MODEL, ignore_errors=True)


def _with_trainer(cfg: Config, **fields: str) -> Config:
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=fields)})


def export_checkpoint(checkpoint: Path, run_cfg: Config, out: Path) -> Path:
    """Write the model of `checkpoint` (a complete `step_N` of the run whose config is
    `run_cfg`) as a Hugging Face directory at `out`; returns `out`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from asyncrl.launch.fleet import prepare_model
    from learner.checkpoint import save_final_weights
    from learner.lora import add_adapters

    base = prepare_model(run_cfg)  # the run's starting model: its shapes, config, tokenizer
    lora = run_cfg.learner.lora
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if lora.rank:
        model = add_adapters(model, lora)
    shards = str(checkpoint / SHARDS_DIR)
    saved = dcp.FileSystemReader(shards).read_metadata().state_dict_metadata
    state = model.state_dict()
    wanted = {k: t for k, t in state.items() if f"model.{k}" in saved}
    loaded = {t.untyped_storage().data_ptr() for t in wanted.values()}
    absent = [
        k
        for k, t in state.items()
        if k not in wanted and t.untyped_storage().data_ptr() not in loaded
    ]
    if absent:  # a tied weight shares a loaded one's storage; anything else is another model
        raise ConfigError(
            f"{checkpoint} does not hold the weights of the run's model {base}: "
            f"{len(absent)} missing, {absent[0]} the first"
        )
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"model": wanted}, checkpoint_id=shards, no_dist=True)  # in place, into `model`
    save_final_weights(out, model, lora, base, rank=0)
    return out
