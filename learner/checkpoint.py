"""Learner checkpoints: sharded weights and optimizer state (torch.distributed.checkpoint).

A checkpoint directory `run_dir/checkpoints/step_<version>` holds `dcp/` (every rank's shards
of the policy, its optimizer and, with a critic, the critic's), `trainer.json` (version, KL
coefficient) and `replay.json` (the replay's data position, written by the replay). The
learning-rate schedule needs no state: it is a function of the version (`learner.optim`).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def checkpoint_state(model, optimizer, critic=None, critic_optimizer=None) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    if critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(critic, critic_optimizer)
    return state


def save_sharded(path: Path, model, optimizer, critic=None, critic_optimizer=None) -> None:
    """Every rank writes its shards under path/dcp (a collective)."""
    state = checkpoint_state(model, optimizer, critic, critic_optimizer)
    dcp.save(state, checkpoint_id=str(path / "dcp"))


def load_sharded(path: Path, model, optimizer, critic=None, critic_optimizer=None) -> None:
    """Restore what `save_sharded` wrote into the (already sharded) models and optimizers."""
    state = checkpoint_state(model, optimizer, critic, critic_optimizer)
    dcp.load(state, checkpoint_id=str(path / "dcp"))
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
