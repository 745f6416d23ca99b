"""What the run audit (`asyncrl.analysis.audit`) reads from a run directory, and nothing else:
samples.jsonl, metrics.jsonl, weights_learner.jsonl, weights_server_*.jsonl, config.yaml, the
replay's state in every complete checkpoint, stats/replay.json, the resume steps in
resumes.jsonl; and the line counts of chaos.jsonl, restarts.jsonl and resumes.jsonl. A missing
file reads as empty.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from asyncrl.checkpoints import REPLAY_FILE, missing_parts
from asyncrl.config import ReplayConfig, RolloutConfig
from asyncrl.metrics import read_jsonl

_STEP_DIR = re.compile(r"step_(\d+)")


@dataclass
class Snapshot:
    """The replay's state at one checkpoint, reduced to what the audit needs."""

    version: int
    rows_drawn: int
    ready: list[str]  # group ids complete and not trained
    reissue: list[str]  # group ids leased and not complete (leased again on resume)
    stale_dropped: int
    given_up: int  # rows no server could sample (`replay.leases.LeaseDesk.fail`)
    source_position: int | None  # the prompt source's own count of rows served, when it has one


@dataclass
class Records:
    """Everything the audit reads from a run directory."""

    n: int
    max_staleness: int
    samples: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    learner_weights: list[dict[str, Any]]
    server_weights: dict[str, list[dict[str, Any]]]
    snapshots: list[Snapshot]
    replay_stats: dict[str, float]
    lines: dict[str, int]  # lines of chaos.jsonl, restarts.jsonl, resumes.jsonl
    resume_steps: list[int]  # the checkpoint steps the launcher resumed the run at


def read_snapshot(ckpt: Path) -> Snapshot:
    """The replay's state saved in checkpoint directory `ckpt`."""
    from replay.checkpoint import read_state

    state = read_state(ckpt / REPLAY_FILE)
    source = state.prompt_source
    position = source.get("served", source.get("drawn"))
    return Snapshot(
        version=state.version,
        rows_drawn=state.rows_drawn,
        ready=[g.item.group_id for g in state.ready],
        reissue=[p.group_id for p in state.reissue],
        stale_dropped=int(state.counters.get("stale_dropped", 0)),
        given_up=int(state.counters.get("rows_given_up", 0)),
        source_position=None if position is None else int(position),
    )


def read_records(run_dir: str | Path) -> Records:
    """The records of the run in `run_dir` (missing files read as empty)."""
    run = Path(run_dir)
    cfg_path = run / "config.yaml"
    cfg = (yaml.safe_load(cfg_path.read_text()) or {}) if cfg_path.is_file() else {}
    ckpts = sorted(
        (int(m.group(1)), p)
        for p in (run / "checkpoints").glob("step_*")
        if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir() and not missing_parts(p)
    )
    stats_path = run / "stats" / "replay.json"
    return Records(
        n=int(cfg.get("rollout", {}).get("n", RolloutConfig().n)),
        max_staleness=int(cfg.get("replay", {}).get("max_staleness", ReplayConfig().max_staleness)),
        samples=read_jsonl(run / "samples.jsonl"),
        metrics=read_jsonl(run / "metrics.jsonl"),
        learner_weights=read_jsonl(run / "weights_learner.jsonl"),
        server_weights={
            p.stem.removeprefix("weights_"): read_jsonl(p)
            for p in sorted(run.glob("weights_server_*.jsonl"))
        },
        snapshots=[read_snapshot(p) for _, p in ckpts],
        replay_stats=json.loads(stats_path.read_text()) if stats_path.is_file() else {},
        resume_steps=[
            r["step"] for r in read_jsonl(run / "resumes.jsonl") if isinstance(r.get("step"), int)
        ],
        lines={
            name: len(read_jsonl(run / f"{name}.jsonl"))
            for name in ("chaos", "restarts", "resumes")
        },
    )
