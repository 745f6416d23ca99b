"""`launch` and `serve`: check the run's data, prepare a run, start the fleets with the
configured backend, watch them, and stop everything at the end, on Ctrl-C or SIGTERM (after
the learner's checkpoint, and then saying how to go on: `interrupt.py`), or as soon as any
process dies (naming the first to die, why, and the deaths that followed it; with
trainer.auto_resume a learner or replay death restarts the run from its newest checkpoint,
`resume.py`). Both backends hand back a `Fleet` (`fleet.py`) and run the same role functions
(`worker.run_process`), so the data plane (ZeroMQ, torch.distributed) does not depend on the
backend.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections.abc import Sequence
from pathlib import Path

from asyncrl.config import Config
from asyncrl.config.reward import scored_by_the_model_alone
from asyncrl.launch.data_check import check_agent_names, check_data, check_files, check_rewards
from asyncrl.launch.fleet import Fleet, LaunchError, prepare_model, prepare_run_dir
from asyncrl.launch.interrupt import (
    FleetsInterrupted,
    RunInterrupted,
    interrupt_report,
    save_on_interrupt,
)
from asyncrl.launch.local import start_local_fleets
from asyncrl.launch.progress import Progress
from asyncrl.launch.restarts import watch
from asyncrl.launch.resume import resume_in_place, run_with_resumes
from asyncrl.metrics import read_jsonl
from asyncrl.placement import launch_placement


def start_fleets(cfg: Config, run_dir: Path, model_path: str, with_learner: bool = True) -> Fleet:
    """Start the replay, the servers and, when training, the learner ranks, with the
    configured backend, and wait until the replay answers. Without a learner the servers keep the weights
    they loaded."""
    if cfg.launch.backend == "ray":
        try:
            import ray  # noqa: F401
        except ImportError:
            raise LaunchError(
                'launch.backend=ray needs Ray: pip install -e ".[ray]" (or pip install ray)'
            ) from None
        from asyncrl.launch.ray_cluster import start_ray_fleets

        return start_ray_fleets(cfg, run_dir, model_path, with_learner)
    return start_local_fleets(cfg, run_dir, model_path, with_learner)


def reward_sources() -> list[str]:
    """The data sources with a registered reward function (built-ins and entry points)."""
    from rollout_servers.rewards.functions import REWARD_FNS

    return REWARD_FNS.names()


def agent_loops(cfg: Config) -> list[str]:
    """The agent loops a row may name: the registered ones and the configured default."""
    from rollout_servers.agents.registry import AGENT_LOOPS

    return [*AGENT_LOOPS.names(), cfg.rollout.agent_loop]


def check_run_data(cfg: Config) -> None:
    """The run's datasets, their reward functions and agent loops, checked before anything is
    created or started (`asyncrl.launch.data_check`); DataError names the key, file and row or column."""
    check_data(cfg, reward_sources())
    check_agent_names("data.train_files", cfg.data.train_files, agent_loops(cfg))
    check_agent_names("data.val_files", cfg.data.val_files, agent_loops(cfg))


def check_eval_data(files: Sequence[str], cfg: Config) -> None:
    """`asyncrl eval --data FILE ...`: the same checks on the files to evaluate."""
    model_alone = scored_by_the_model_alone(cfg.reward)
    check_rewards(
        check_files("--data", files), reward_sources(), cfg.reward.custom.path, model_alone
    )
    check_agent_names("--data", files, agent_loops(cfg))


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where a Hugging Face config.json states the model's context, in the order looked for."""


def check_lengths(cfg: Config, model_path: str) -> None:
    """LaunchError, before any process starts, when the configured lengths cannot fit the
    model's context (its config.json, or the engine's own cap when one is set, which wins: a
    rope-scaled model may serve more than its max_position_embeddings): a response budget with
    no room left for a prompt, or the longest prompt plus the response budget. Without this a
    run trains on responses the engine silently cut at the context."""
    path = Path(model_path) / "config.json"
    model = json.loads(path.read_text())
    key = next((k for k in CONTEXT_KEYS if isinstance(model.get(k), int)), None)
    if key is None:
        return  # a model that states no context: nothing to check against
    context, where = model[key], f"{key} in {path}"
    rc = cfg.rollout
    engine_cap = {"vllm": rc.vllm.max_model_len, "sglang": rc.sglang.context_length}
    if engine_cap.get(rc.engine, 0):  # set by the user: trusted (rope scaling may allow more)
        name = "max_model_len" if rc.engine == "vllm" else "context_length"
        context, where = engine_cap[rc.engine], f"rollout.{rc.engine}.{name}"
    budget, prompt = rc.max_new_tokens, cfg.data.max_prompt_length
    if budget >= context:
        raise LaunchError(
            f"rollout.max_new_tokens={budget} leaves no room for a prompt in the model's "
            f"context of {context} tokens ({where})"
        )
    if prompt is not None and prompt + budget > context:
        raise LaunchError(
            f"data.max_prompt_length={prompt} plus rollout.max_new_tokens={budget} is "
            f"{prompt + budget} tokens, beyond the model's context of {context} ({where}): "
            "lower one of them"
        )


def serve(cfg: Config, command: str = "asyncrl serve") -> tuple[Fleet, Path]:
    """Start the replay and the rollout servers only, on trainer.model_path (any checkpoint
    directory) or the embedded model; the caller stops the fleet."""
    existing = Path(cfg.trainer.run_dir)
    if "{time}" not in cfg.trainer.run_dir and (
        (existing / "metrics.jsonl").exists() or (existing / "checkpoints").exists()
    ):
        raise LaunchError(
            f"trainer.run_dir={existing} holds a training run: serving or evaluating into it "
            "would overwrite its config.yaml (which --resume trusts) and run.secret; use "
            "another trainer.run_dir (eval: --output FILE puts the results anywhere)"
        )
    check_run_data(cfg)
    launch_placement(cfg, with_learner=False)  # one that cannot work fails before the model
    model_path = prepare_model(cfg)
    check_lengths(cfg, model_path)
    run_dir = prepare_run_dir(cfg, command)
    fleet = start_fleets(cfg, run_dir, model_path, with_learner=False)
    return fleet, run_dir


def launch(cfg: Config, command: str = "asyncrl launch") -> Path:
    """Run one training job end to end; returns the run directory. A run resumed from a
    checkpoint of its own run directory continues it in place, its records rewound to the
    checkpoint (`resume_in_place`). With trainer.auto_resume, a learner or replay death
    restarts the run from its newest checkpoint (`resume.py`). An interrupt ends in
    RunInterrupted, whose text says how to go on (`interrupt.py`)."""
    started = time.monotonic()
    check_run_data(cfg)
    launch_placement(cfg)  # one that cannot work fails before the model is prepared
    model_path = prepare_model(cfg)
    check_lengths(cfg, model_path)
    with contextlib.ExitStack() as held:
        existing = Path(cfg.trainer.run_dir)
        locked = existing.is_dir()
        if locked:  # a resume, say: held before its records are rewound
            hold_run_dir(existing, held)
        cfg = resume_in_place(cfg, command)
        run_dir = prepare_run_dir(cfg, command)
        if not locked or run_dir.resolve() != existing.resolve():
            hold_run_dir(run_dir, held)
        print(f"asyncrl: run directory {run_dir}", flush=True)
        progress = Progress(
            cfg.trainer.total_steps, cfg.replay.max_staleness, cfg.launch.progress, started
        )
        try:
            run_with_resumes(
                cfg, run_dir, command, lambda attempt: train(attempt, run_dir, model_path, progress)
            )
        except KeyboardInterrupt as stop:  # every process is stopped: say where the run stands
            why = str(stop) if isinstance(stop, FleetsInterrupted) else ""
            raise RunInterrupted(interrupt_report(cfg, run_dir, why)) from None
    summary = progress.summary(read_jsonl(run_dir / "metrics.jsonl"))
    print(f"asyncrl: done in {time.monotonic() - started:.0f}s. {summary}", flush=True)
    if cfg.trainer.save_final:
        print(f"asyncrl: final weights in {run_dir / 'final'}", flush=True)
    return run_dir


LOCK_FILE = ".launch.lock"
"""Held (flock) by the launch training in a run directory, for as long as it runs."""


def hold_run_dir(run_dir: Path, held: contextlib.ExitStack) -> None:
    """Take `run_dir`'s LOCK_FILE until `held` closes (or this process ends): a second launch
    or resume into a directory a launch is training in would rewind and interleave the
    records the first is still writing. LaunchError naming the directory when it is taken."""
    path = run_dir / LOCK_FILE
    lock = open(path, "a")  # noqa: SIM115 (held open until `held` closes)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise LaunchError(
            f"{run_dir} is in use: another asyncrl launch is training in it ({path} is "
            "locked); wait for it to end, or use another trainer.run_dir"
        ) from None
    held.callback(lock.close)


def train(cfg: Config, run_dir: Path, model_path: str, progress: Progress) -> None:
    """One attempt: start the fleets, watch them until the learner ranks finish (LaunchError
    when a member dies first; FleetsInterrupted on an interrupt, once the learner wrote its
    checkpoint, `save_on_interrupt`), and stop them either way."""
    fleet = start_fleets(cfg, run_dir, model_path)
    print(
        f"asyncrl: started replay, {cfg.rollout.num_servers} rollout server(s), "
        f"{cfg.learner.world_size} learner rank(s); logs in {run_dir / 'logs'}",
        flush=True,
    )
    try:
        watch(fleet, progress)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM: checkpoint first (`interrupt.py`)
        raise FleetsInterrupted(save_on_interrupt(fleet, cfg, progress.note)) from None
    finally:
        fleet.stop_all()
