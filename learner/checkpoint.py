"""Learner checkpoints: sharded weights and optimizer state (torch.distributed.checkpoint), the
trainer's state and the replay's, written together (layout: `asyncrl.checkpoints`); and the
final weights as a plain Hugging Face model directory.

`save_checkpoint` writes every part into `step_<v>.partial/` (the ranks' shards, then the
replay's state, asked of the replay through the coordinator after version v was published and
before the next batch is asked for, then `trainer.json`) and renames it to `step_<v>` last: a
checkpoint is complete when it exists at all. The learning-rate schedule needs no state: it is
a function of the version (`learner.optim`).

The replay is told where to write its part relative to the run directory
(`checkpoints/step_<v>.partial/replay.msgpack`), never as the learner's path to it: the
replay resolves it against its own run directory (`replay.access.AccessRules.checkpoint_path`),
which is the same directory whatever either process's working directory and however
`trainer.run_dir` was written (a relative `runs/{time}`, the default, included).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from asyncrl.checkpoints import (
    REPLAY_FILE,
    SHARDS_DIR,
    TRAINER_FILE,
    check_complete,
    checkpoint_dir,
    partial_dir,
    prune,
    publish,
    write_final_step,
)
from asyncrl.config.learner import LoraConfig
from asyncrl.metrics import write_json_atomic
from learner.fsdp import iter_full_tensors
from learner.lora import is_adapted, merged_state, save_adapter

log = logging.getLogger("asyncrl.learner")


class ReplayState(Protocol):
    """The replay's side of a checkpoint (the learner's coordinator, `learner.coordinator`)."""

    def checkpoint(self, path: str, version: int) -> None:
        """Have the replay write its whole state at `version` to `path`, relative to the run
        directory."""
        ...


def save_checkpoint(
    run_dir: Path,
    version: int,
    rank: int,
    world: int,
    modules: tuple,
    replay: ReplayState,
    trainer_state: dict[str, Any],
    keep: int = 0,
    spare: str | None = None,
) -> Path:
    """All ranks: write the checkpoint of `version` (a collective). `modules`: (model,
    optimizer, critic, critic optimizer), the critic's None without one; `replay` and
    `trainer_state` (written as trainer.json, with the version) are rank 0's; `keep` > 0: rank
    0 then deletes all but the newest `keep` checkpoints, never `spare` (the checkpoint the
    run resumed from, `asyncrl.checkpoints.prune`). Returns the checkpoint's directory."""
    partial = partial_dir(run_dir, version)
    if rank == 0 and partial.exists():  # left by an attempt that died before its rename
        shutil.rmtree(partial)
    if world > 1:
        dist.barrier()  # nobody writes into it before it is cleared
    save_sharded(partial, *modules)
    if rank == 0:
        replay.checkpoint(str(partial.relative_to(run_dir) / REPLAY_FILE), version)
        write_json_atomic(partial / TRAINER_FILE, {"version": version, **trainer_state})
        final = publish(partial)
        log.info("checkpoint at version %d written to %s", version, final)
        if keep > 0:
            for path in prune(run_dir, keep, spare):
                log.info("deleted checkpoint %s (trainer.keep_checkpoints=%d)", path.name, keep)
    return checkpoint_dir(run_dir, version)


def save_final_weights(
    out: Path,
    model: torch.nn.Module,
    lora: LoraConfig,
    model_path: str,
    rank: int,
    step: int | None = None,
) -> None:
    """All ranks (the gathers are collectives): rank 0 writes the final weights as an ordinary
    Hugging Face model directory at `out`; with LoRA, the merged model, and the adapter in
    peft's format under out/adapter. `step`, the learner version of the weights, is recorded
    beside them (`asyncrl.checkpoints.FINAL_STEP_FILE`) so that an eval can tell an old final/
    from a newer checkpoint of the same run, resumed since (`asyncrl.checkpoints`)."""
    full = {name: t.cpu().clone() for name, t in iter_full_tensors(model)}
    if rank != 0:
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = None
    if is_adapted(model):
        full, adapter = merged_state(full, lora)
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    plain.load_state_dict(full)
    plain.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    if adapter is not None:
        save_adapter(out / "adapter", adapter, lora, model_path)
    if step is not None:
        write_final_step(out, step)
    log.info("final weights written to %s", out)


def load_checkpoint(path: Path, modules: tuple) -> dict[str, Any]:
    """Restore a complete `save_checkpoint` directory into `modules` (as there); returns its
    trainer.json. Raises IncompleteCheckpoint, naming the missing file, for anything else."""
    check_complete(path)
    load_sharded(path, *modules)
    return json.loads((path / TRAINER_FILE).read_text())


def checkpoint_state(model, optimizer, critic=None, critic_optimizer=None) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    if critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(critic, critic_optimizer)
    return state


def save_sharded(path: Path, model, optimizer, critic=None, critic_optimizer=None) -> None:
    """Every rank writes its shards under path/dcp (a collective); rank 0 writes dcp/.metadata
    once every rank's shards are written."""
    state = checkpoint_state(model, optimizer, critic, critic_optimizer)
    dcp.save(state, checkpoint_id=str(path / SHARDS_DIR))


def load_sharded(path: Path, model, optimizer, critic=None, critic_optimizer=None) -> None:
    """Restore what `save_sharded` wrote into the (already sharded) models and optimizers."""
    state = checkpoint_state(model, optimizer, critic, critic_optimizer)
    dcp.load(state, checkpoint_id=str(path / SHARDS_DIR))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    if critic is not None:
        set_state_dict(
            critic,
            critic_optimizer,
            model_state_dict=state["critic"],
            optim_state_dict=state["critic_optim"],
        )
