"""asyncrl: asynchronous RL for language models. This package is the shared core, plus three
sub-packages around it.

The core (the modules directly in `asyncrl/`) is what every fleet shares; it imports no fleet,
no launch code and no demo:
- `config`: the typed configuration tree (`load_config`; the learner's sections live in
  `learner_config`, the common base in `config_base`, the sandbox's in `sandbox_config`).
- `protocol` (every message between processes) over `codec` (typed MessagePack frames, validated
  on decode) and `transport` (ZeroMQ sockets); `replay_client`: the learner's side of the replay.
- `auth`: the run secret and one key per role, an HMAC on every message; `binds`: torch's
  stores listening on the run's host only.
- `weight_sync`: bucketed broadcast of weights from learner rank 0 to the rollout servers;
  `lora`: the layout of LoRA adapters on that wire, and how an engine merges them.
- `data`: verl-schema rows (validation, `PromptReader`, `render_prompt_ids`, row -> `PromptItem`)
  and the `TASKS` registry; `data_check`: a run's datasets checked before any fleet starts;
  `gsm8k`: GSM8K preparation and its final-answer parser.
- `checkpoints`: the layout of a checkpoint directory, shared by its writers and readers.
- `estimators`: the advantage estimators, each declared once in `ESTIMATORS` (torch-free);
  `advantages`: their tensor math and `compute_advantages`; `policy_losses`: the policy
  losses, each declared once in `POLICY_LOSSES` (their tensor math in `learner.losses`).
- `evaluation`: pass@k and the evaluation job the learner and `asyncrl eval` run.
- `registry`: the one `Registry` class behind every family users extend.
- `metrics`, `trace`, `loggers`, `run_spec`: what a run writes and where things are.

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
