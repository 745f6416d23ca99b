"""The replay's components, and the one place they are built (`setup_replay_components`).

`replay.service.ReplayService` receives them and drives them from its loop; none of them knows
the service. They share one `Counter` (every name in `replay.counters.COUNTERS` and
`replay.health.HEALTH_COUNTERS`): each counts its own events in it, the service reports it, and
a checkpoint saves it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import Config
from replay.access import AccessRules
from replay.admission import AdmissionController
from replay.batches import BatchDesk
from replay.buffer import GroupBuffer
from replay.counters import COUNTERS
from replay.eval_jobs import EvalJobs
from replay.fleet_stats import FleetStats
from replay.group_filter import GroupFilter
from replay.health import FleetHealth
from replay.intake import SampleIntake
from replay.leases import LeaseDesk, LeaseRules
from replay.prompts import PromptSource, setup_prompt_source
from replay.sample_checks import TokenLimits


@dataclass(frozen=True)
class ReplayComponents:
    """What the replay's loop drives (see the module docstring)."""

    counters: Counter[str]  # every counter of the replay, shared by the components below
    access: AccessRules  # who signed a message, whether it may send it, where checkpoints go
    buffer: GroupBuffer  # each lease's samples, from grant to batch
    eval_jobs: EvalJobs  # evaluation prompts, leased first, and their scores
    admission: AdmissionController  # how many leases may start now; freed by the desks below
    leases: LeaseDesk  # grants within admission, over the buffer and evaluation jobs
    group_filter: GroupFilter  # zero-variance groups dropped as they complete (DAPO)
    intake: SampleIntake  # each arriving sample into its group or evaluation job
    batches: BatchDesk  # batches out of the buffer, stale groups dropped
    health: FleetHealth  # which server epochs are alive
    fleet: FleetStats  # the servers' counters, turned into each batch's fleet metrics


def setup_replay_components(
    cfg: Config,
    secret: bytes,
    run_dir: str | Path | None = None,
    model_path: str | None = None,
    prompts: PromptSource | None = None,
) -> ReplayComponents:
    """The replay's components for `cfg`. `secret`: the run secret every peer's key derives
    from; `run_dir`: where checkpoints and `failed_groups.jsonl` are written (None: no
    checkpoints, given-up groups only logged); `model_path`: the model whose vocabulary and
    context every sample is checked against and whose tokenizer measures prompts (None: no
    model, no limits); `prompts`: the prompt source (default: the config's,
    `setup_prompt_source`)."""
    rc = cfg.replay  # (Config checks that capacity_groups holds a batch)
    run_dir = None if run_dir is None else Path(run_dir)
    prompts = setup_prompt_source(cfg, model_path) if prompts is None else prompts
    counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
    buffer = GroupBuffer(
        seen_ids_limit=max(1 << 16, 16 * rc.capacity_groups * cfg.rollout.n),
        limits=TokenLimits.of_model(model_path),
    )
    eval_jobs = EvalJobs(rc.lease_timeout_s, max_bytes=int(rc.eval_jobs_mb * 2**20))
    admission = AdmissionController.from_config(cfg)
    leases = LeaseDesk(
        LeaseRules.from_config(cfg),
        admission,
        prompts,
        buffer,
        eval_jobs,
        counters,
        None if run_dir is None else run_dir / "failed_groups.jsonl",
    )
    health = FleetHealth(cfg.launch.server_timeout_s, counters)
    fleet = FleetStats()
    group_filter = GroupFilter(rc.filter_groups, buffer, admission, counters)
    return ReplayComponents(
        counters=counters,
        access=AccessRules(secret, cfg.rollout.num_servers, run_dir),
        buffer=buffer,
        eval_jobs=eval_jobs,
        admission=admission,
        leases=leases,
        group_filter=group_filter,
        intake=SampleIntake(buffer, eval_jobs, group_filter, counters),
        batches=BatchDesk(rc.max_staleness, buffer, admission, fleet, counters, group_filter),
        health=health,
        fleet=fleet,
    )
