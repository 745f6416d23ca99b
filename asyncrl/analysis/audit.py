"""What a run's own records say about its integrity: the audit `tools/chaos.py` prints.

It reads only what a run writes (with `trainer.log_samples` and `learner.weight_checksum` on),
as `asyncrl.analysis.run_records` reads it.

How a prompt is named: the replay draws rows from its prompt source in order and names the
lease of draw i `"{i}-{8 hex}"` (`replay.leases`, `asyncrl.data.rows.new_group_id`); a re-issued
lease keeps i, and a resumed replay goes on drawing at the checkpoint's `rows_drawn`. Draw i is
one fixed row of the stream (a task's seeded stream, or the parquet reader's permutation of
epoch i // rows), so "each row consumed once per epoch" is "each draw index trained at most
once, and none of the drawn prefix skipped".

Invariants (`Audit.ok` is false when one fails):
1. `rows_once`: no draw index is trained twice.
2. `rows_accounted`: at every complete checkpoint step_c, the rows trained by step c, its ready
   groups and its leases to re-issue hold each row of [0, rows_drawn) at most once, and the rows
   missing from them are exactly as many as the groups dropped as stale and the rows given up
   (`replay.max_group_failures`) by then; any more are `lost`. (The steps after the last
   checkpoint are covered by 1 and 5 only.)
3. `data_position`: each checkpoint's prompt-source position is its rows drawn.
4. `trajectories_once`: no trajectory id is trained twice.
5. `whole_groups`: every step trains `rollout.n` samples per group (no algorithm here filters
   samples out of a group), and a group id is trained in one step only.
6. `steps_up`: metrics.jsonl steps are 1, 2, ..., K with version == step, and samples.jsonl
   logs the same steps (a resumed run rewinds both to its checkpoint).
7. `learner_versions_up`: weights_learner.jsonl goes up within each learner start (a start
   that logs version 0 again begins a new one); a resumed start's first version is at most one
   past the versions reached before (the launcher's rewind may drop the dead start's record of
   the checkpoint's version), with the same checksum when that record is still there.
8. `server_weights`: each server's versions go up within each of its processes, and the
   checksums it reports are the learner's at those versions; a server process of a start that
   died may leave the learner's (kept) history only past a version the run resumed at, so its
   record of that version, if any, witnesses that the resume loaded the dead start's weights.
9. `staleness`: no trained sample is older than `replay.max_staleness` versions.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.analysis.run_records import Records, read_records
from asyncrl.data.rows import row_of_group


def row_of(group_id: str) -> int:
    """The draw index of a group id `"{i}-{suffix}"`."""
    return int(row_of_group(group_id))


@dataclass
class Check:
    """One invariant: whether it held, and what broke it."""

    name: str
    ok: bool
    detail: str = ""


@dataclass
class Audit:
    """The checks and the counts of one run."""

    run_dir: str
    checks: list[Check] = field(default_factory=list)
    counts: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.ok]

    def to_json(self) -> dict[str, Any]:
        return {
            "run_dir": self.run_dir,
            "ok": self.ok,
            "checks": [vars(c) for c in self.checks],
            "counts": self.counts,
        }

    def table(self) -> str:
        """The checks, then the counts, as aligned text."""
        lines = [f"audit of {self.run_dir}: {'PASS' if self.ok else 'FAIL'}"]
        width = max([len(c.name) for c in self.checks] + [len(k) for k in self.counts] + [8])
        for c in self.checks:
            lines.append(f"  {c.name:<{width}}  {'ok' if c.ok else 'FAIL'}  {c.detail}".rstrip())
        for k, v in self.counts.items():
            shown = f"{v:.4g}" if isinstance(v, float) else str(v)
            lines.append(f"  {k:<{width}}  {shown}")
        return "\n".join(lines)


# ---- the checks ---------------------------------------------------------------------------------
def _repeated(values: list[Any]) -> list[Any]:
    return sorted(v for v, k in Counter(values).items() if k > 1)


def _few(values: list[Any], k: int = 5) -> str:
    return ", ".join(map(str, values[:k])) + (
        f" (+{len(values) - k} more)" if len(values) > k else ""
    )


def check_rows(rec: Records) -> tuple[list[Check], dict[str, int]]:
    """Invariants 1-3, and the counts of rows drawn, trained, duplicated and lost."""
    trained = [row_of(g) for s in rec.samples for g in s["group_ids"]]
    twice = _repeated(trained)
    checks = [Check("rows_once", not twice, f"rows trained twice: {_few(twice)}" if twice else "")]
    problems, lost, positions = [], 0, []
    for snap in rec.snapshots:
        by_c = [row_of(g) for s in rec.samples if s["step"] <= snap.version for g in s["group_ids"]]
        held = [row_of(g) for g in snap.ready + snap.reissue]
        seen = Counter(by_c + held)
        if repeats := _repeated(list(seen.elements())):
            problems.append(f"step_{snap.version}: rows counted twice {_few(repeats)}")
        if beyond := sorted(r for r in seen if r >= snap.rows_drawn):
            problems.append(f"step_{snap.version}: rows past rows_drawn {_few(beyond)}")
        missing = snap.rows_drawn - len(set(seen) - set(beyond))
        skipped = missing - snap.stale_dropped - snap.given_up
        if skipped > 0:
            problems.append(
                f"step_{snap.version}: {skipped} row(s) of the first {snap.rows_drawn} neither "
                f"trained, held, dropped as stale nor given up"
            )
        lost = max(skipped, 0)  # the latest checkpoint's count: every earlier one is within it
        if snap.source_position is not None and snap.source_position != snap.rows_drawn:
            positions.append(
                f"step_{snap.version}: source at {snap.source_position}, {snap.rows_drawn} drawn"
            )
    checks.append(Check("rows_accounted", not problems, "; ".join(problems[:3])))
    checks.append(Check("data_position", not positions, "; ".join(positions[:3])))
    counts = {
        "rows_trained": len(set(trained)),
        "rows_duplicated": len(trained) - len(set(trained)),
        "rows_lost": lost,
        "checkpoints_audited": len(rec.snapshots),
    }
    if rec.snapshots:
        last = rec.snapshots[-1]
        counts["rows_drawn_at_last_checkpoint"] = last.rows_drawn
        counts["last_checkpoint"] = last.version
    return checks, counts


def check_samples(rec: Records) -> tuple[list[Check], dict[str, int]]:
    """Invariants 4, 5 and 9, and the count of partial groups."""
    trajs = [t for s in rec.samples for t in s["traj_ids"]]
    twice = _repeated(trajs)
    partial, problems, too_old = 0, [], []
    for s in rec.samples:
        groups = s["group_ids"]
        expected = rec.n * len(set(groups))
        if len(s["traj_ids"]) != expected or len(set(groups)) != len(groups):
            partial += max(1, -(-abs(expected - len(s["traj_ids"])) // rec.n))
            problems.append(f"step {s['step']}: {len(s['traj_ids'])} samples for {expected}")
        oldest = s.get("oldest_versions", [])
        if oldest and s["learner_version"] - min(oldest) > rec.max_staleness:
            too_old.append(f"step {s['step']}: a sample of version {min(oldest)}")
    split = _repeated([g for s in rec.samples for g in set(s["group_ids"])])
    if split:
        problems.append(f"groups trained in two steps: {_few(split)}")
    checks = [
        Check("trajectories_once", not twice, f"trained twice: {_few(twice)}" if twice else ""),
        Check("whole_groups", not problems, "; ".join(problems[:3])),
        Check("staleness", not too_old, "; ".join(too_old[:3])),
    ]
    counts = {
        "trajectories_trained": len(trajs),
        "trajectories_duplicated": len(trajs) - len(set(trajs)),
        "groups_partial": partial + len(split),
    }
    return checks, counts


def _starts(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Records split where a process starts (a version-0 record after the first)."""
    out: list[list[dict[str, Any]]] = []
    for r in records:
        if not out or r["version"] == 0:
            out.append([])
        out[-1].append(r)
    return out


def _up(versions: list[int]) -> bool:
    return all(b > a for a, b in zip(versions, versions[1:], strict=False))


def check_steps(rec: Records) -> tuple[list[Check], dict[str, int]]:
    """Invariant 6."""
    steps = [m["step"] for m in rec.metrics]
    bad = [f"{a}->{b}" for a, b in zip(steps, steps[1:], strict=False) if b != a + 1]
    if steps and steps[0] != 1:
        bad.insert(0, f"starts at {steps[0]}")
    bad += [
        f"step {m['step']} version {m['version']}" for m in rec.metrics if m["version"] != m["step"]
    ]
    sample_steps = [s["step"] for s in rec.samples]
    if sample_steps != steps:
        bad.append(f"samples.jsonl logs steps {_few(sample_steps)}, metrics.jsonl {_few(steps)}")
    return [Check("steps_up", not bad, "; ".join(bad[:3]))], {"steps": len(steps)}


def learner_history(rec: Records) -> tuple[dict[int, set[str]], list[int], list[str]]:
    """The learner's checksums by version, the versions it resumed at, and what breaks
    invariant 7. A resumed learner logs version 0 (the base model it built) and then the
    checkpoint's version; the launcher's rewind may have dropped the dead start's record of
    that version (it is written again), so a resume may come one past the versions reached."""
    learner: dict[int, set[str]] = {}
    problems, resumes, reached = [], [], -1
    for k, start in enumerate(_starts(rec.learner_weights)):
        versions = [r["version"] for r in start]
        if not _up(versions):
            problems.append(f"learner start {k}: versions {_few(versions)}")
        if k and len(versions) > 1:
            resumed = versions[1]
            resumes.append(resumed)
            if resumed > reached + 1:
                problems.append(f"learner start {k} resumed at {resumed}, past {reached} reached")
            elif resumed in learner and start[1]["checksum"] not in learner[resumed]:
                problems.append(f"learner start {k}: version {resumed} resumed with other weights")
        for r in start:
            learner.setdefault(r["version"], set()).add(r["checksum"])
        reached = max([reached, *versions])
    return learner, resumes, problems


def check_weights(rec: Records) -> tuple[list[Check], dict[str, int]]:
    """Invariants 7 and 8. Server logs are timelines (never rewound), so a server process of a
    start that died goes on past the version the run resumed at with weights the kept learner
    records do not hold: a server process may leave the learner's history only past a resume
    point c, having matched it up to c (its record of c, when it has one, is then the witness
    that the resumed learner loaded the very weights the dead one had at c). Resume points:
    where the learner's log starts again at version 0, and the steps in resumes.jsonl (a
    launcher whose resumed learner does not log version 0 again)."""
    learner, resumes, problems = learner_history(rec)
    resumes += rec.resume_steps
    checks = [Check("learner_versions_up", not problems, "; ".join(problems[:3]))]
    wrong = []
    for name, records in rec.server_weights.items():
        for start in _starts(records):
            versions = [r["version"] for r in start]
            if not _up(versions):
                wrong.append(f"{name}: versions {_few(versions)}")
            off = [
                r["version"]
                for r in start
                if r.get("checksum") and r["version"] in learner
                if r["checksum"] not in learner[r["version"]]
            ]
            if off and not any(c < off[0] for c in resumes):
                wrong.append(f"{name}: version {off[0]} is not the learner's")
    checks.append(Check("server_weights", not wrong, "; ".join(wrong[:3])))
    counts = {
        "learner_starts": len(_starts(rec.learner_weights)),
        "server_starts": sum(len(_starts(r)) for r in rec.server_weights.values()),
    }
    return checks, counts


def progress(rec: Records) -> dict[str, float]:
    """Throughput (samples trained per second between the first and the last step's records,
    rewound steps excluded) and reward rise (mean reward of the last 20% of steps minus the
    first 20%)."""
    m = rec.metrics
    out: dict[str, float] = {"samples_trained": float(sum(r.get("samples", 0) for r in m))}
    if len(m) >= 2:
        span = m[-1]["time"] - m[0]["time"]
        out["train_window_s"] = span
        out["samples_per_s"] = sum(r.get("samples", 0) for r in m[1:]) / span if span > 0 else 0.0
    if m:
        k = max(1, len(m) // 5)
        first = [r["reward_mean"] for r in m[:k]]
        last = [r["reward_mean"] for r in m[-k:]]
        out["reward_first_20pct"] = sum(first) / k
        out["reward_last_20pct"] = sum(last) / k
        out["reward_rise"] = out["reward_last_20pct"] - out["reward_first_20pct"]
    return out


def audit_run(run_dir: str | Path) -> Audit:
    """Every check and count of the run in `run_dir` (see the module docstring)."""
    rec = read_records(run_dir)
    audit = Audit(str(run_dir))
    if not rec.samples:
        audit.checks.append(
            Check("samples_logged", False, "no samples.jsonl (trainer.log_samples)")
        )
    if not rec.learner_weights:
        audit.checks.append(
            Check("weights_logged", False, "no weights_learner.jsonl (learner.weight_checksum)")
        )
    for part in (check_rows, check_samples, check_steps, check_weights):
        checks, counts = part(rec)
        audit.checks += checks
        audit.counts |= counts
    stats = rec.replay_stats
    audit.counts["stale_dropped"] = int(stats.get("stale_dropped", 0))
    if stats:  # at the stop: what the replay still held, and what it had drawn in all
        drawn = int(stats.get("leases_granted", 0) - stats.get("leases_reissued", 0))
        held = int(stats.get("groups_ready", 0) + stats.get("groups_in_flight", 0))
        audit.counts["rows_drawn_at_stop"] = drawn
        audit.counts["rows_held_at_stop"] = held
        # leases waiting to be re-issued at the stop are in neither count: an upper bound
        audit.counts["rows_unaccounted_at_stop"] = (
            drawn - audit.counts["rows_trained"] - held - audit.counts["stale_dropped"]
        )
    audit.counts |= {f"{k}_lines": v for k, v in rec.lines.items()}
    audit.counts |= progress(rec)
    return audit
