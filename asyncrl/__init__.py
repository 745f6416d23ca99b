"""asyncrl: asynchronous RL for language models. This package is the shared core, plus three
sub-packages around it.

The core is what every fleet shares; it imports no fleet, no launch code and no demo. Its
sub-packages, in their import order: each imports only those listed before it and the base
modules (`registry`, `dtypes`, `cpu`, `trace`, `metrics`, `loggers`, `checkpoints`), with
`placement` and `run_spec` between `config/` and `weights/`, and `evaluation` above all
(`CORE_ORDER` in tests/unit/test_layout.py):
- `wire/`: what crosses a process boundary: `wire.protocol` (every message between processes,
  with `wire.samples`, `wire.reward_protocol` and `wire.bounds`) over `wire.codec` (typed
  MessagePack frames, validated on decode) and `wire.sockets` (ZeroMQ); `wire.router`: the
  authenticated endpoint every service runs; `wire.auth`: the run secret and one key per role, an
  HMAC on every message; `wire.binds`: torch's stores listening on the run's host only;
  `wire.replay_client`: the blocking client of the replay.
- `algorithms/`: `algorithms.estimators`, the advantage estimators, each declared once in
  `ESTIMATORS` (torch-free); `algorithms.advantages`: their tensor math; the algorithm's config
  variants (`algorithms.variants`), each family a registry of classes declared once:
  `algorithms.policy_losses` (`POLICY_LOSSES`), `algorithms.corrections`
  (`OFF_POLICY_CORRECTIONS`, `REJECTIONS`) and `algorithms.kl` (`KL_IN_REWARD`, `KL_LOSSES`).
- `data/`: verl-schema rows (`asyncrl.data.rows`; `asyncrl.data.prompts`: `PromptReader`,
  `render_prompt_ids`, the `TASKS` registry) and GSM8K's preparation (`asyncrl.data.gsm8k`).
- `config/`: the typed configuration tree (`config.load_config`, `config.Config`; a module per
  section, `config.learner`, `config.rollout`, `config.replay` and so on, over `config.base`).
- `weights/`: `weights.sync`, the bucketed broadcast of weights from learner rank 0 to the rollout
  servers (its jobs: `weights.fanout` to the members, `weights.staged_slots`, `weights.packing`
  into buckets), over the `weights.transports` it chooses between; `weights.receiver`, the
  servers' side; `weights.group` and `weights.sealed_store`, the joins; `weights.lora`: the
  layout of LoRA adapters on that wire.
The modules of their own: `checkpoints` (the layout of a checkpoint directory), `evaluation`
(pass@k and the evaluation job), `registry` (the one `Registry` class behind every family users
extend), `placement` (which GPU each process gets), `cpu`, `dtypes`, and `metrics`, `trace`,
`loggers`, `run_spec` (what a run writes and where things are).

Sub-packages:
- `launch`: the layer above the fleets (CLI, role dispatch, local and Ray launchers, progress).
- `demo`: the embedded task and tiny model, and the SmolLM2 import; plugged in by entry points.
- `analysis`: plots of a run and the pipeline's discrete-event model.

The package itself is the public face: `asyncrl.run(config)` trains from Python
(`asyncrl.launch.api`), imported only when called, so importing any core module never loads
the launch layer.

docs/architecture.md draws the layers; tests/unit/test_layout.py enforces the import rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.launch.api import RunResult


def run(
    config: Config | str | Path | None = None,
    overrides: Sequence[str] = (),
    resume: str | Path | None = None,
) -> RunResult:
    """Train as `asyncrl launch` does (or continue the run directory `resume` in place) and
    return the run directory and per-step metrics (`asyncrl.launch.api.run`)."""
    from asyncrl.launch.api import run as run_job

    return run_job(config, overrides, resume)
