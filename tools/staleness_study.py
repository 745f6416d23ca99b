"""The staleness study (issue 31): run a grid of `asyncrl launch` runs, resumably, then report.

    python tools/staleness_study.py run --grid tiny --out runs/study_tiny [--seeds 0,1]
        [--only 's4-*'] [--lrs 5e-4,1e-3] [--dry-run] [section.key=value ...]
    python tools/staleness_study.py run --grid smollm2 --out runs/study_smollm2 --seeds 1 \
        --only 's8-*,s0-*'                  # a second seed for staleness 8 and its references
    python tools/staleness_study.py report --out runs/study_tiny --figure F.png --table T.md
        [--json T.json] [--window 20] [--smooth 10] [--fraction 0.9]

A cell is (grid, staleness, variant, lr, seed), named `s{staleness}-{variant}-lr{lr}-seed{seed}`;
its run directory is OUT/CELL and its stdout and stderr go to OUT/CELL.log. Each cell is one
`asyncrl launch` subprocess, so a crash or an OOM of one run does not stop the study.

Order: the runs are interleaved, all cells of the first seed in a shuffled (seeded, so the
same every time) order, then the next seed's, so consecutive runs differ in configuration and
drift of the machine hits every cell alike.

Resuming: `run` again with the same arguments. A cell whose run finished (its metrics.jsonl
holds the config's `trainer.total_steps` steps and its log the launcher's last line, "asyncrl:
done in") is skipped; one that started but did not finish is moved aside to
OUT/CELL.failed-N (its log to OUT/CELL.failed-N.log) and run again.

The grids (`GRIDS`) and the variants (`VARIANTS`): a new variant is one more entry in
`VARIANTS`. Staleness 0 is synchronous (on-policy) RL: there the proximal policy is the
behaviour policy, so importance weights are 1 and nothing is rejected, and `tis`, `icepop` and
the other corrections reduce to `none`. Only `none` runs there, and `decoupled_mb`, whose
mini-batches make every optimizer step after the first off-policy even at staleness 0 (it is
its own synchronous reference). A variant's synchronous reference is its own staleness-0 cell
when it has one, else `none`'s, at the same lr (and seed).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from compare_algorithms import DECOUPLED_TIS as TIS
from compare_algorithms import REJECT
from study_report import cell_finished, report

ROOT = Path(__file__).resolve().parents[1]
DECOUPLED = ["algorithm.correction.type=decoupled"]
ICEPOP = [*DECOUPLED, *REJECT]  # token rejection on the ratio outside [0.5, 2]
INFLIGHT = ["rollout.weight_update_mode=inflight"]


@dataclass(frozen=True)
class Variant:
    """One correction setting: its overrides, and at which staleness values it runs."""

    overrides: tuple[str, ...]
    stalenesses: tuple[int, ...] | None = None  # None: every staleness of the grid above 0
    sync: bool = False  # also runs at staleness 0 (its own synchronous reference)

    def runs_at(self, staleness: int) -> bool:
        if staleness == 0:
            return self.sync
        return self.stalenesses is None or staleness in self.stalenesses


VARIANTS: dict[str, Variant] = {
    "none": Variant(("algorithm.correction.type=none",), sync=True),
    "tis": Variant(tuple(TIS)),
    # 4 optimizer steps per batch (16 groups) and 2 epochs: the clip has something to act on
    "decoupled_mb": Variant(
        (*DECOUPLED, "learner.ppo_mini_batch_size=4", "learner.ppo_epochs=2"), sync=True
    ),
    "icepop": Variant(tuple(ICEPOP)),
    # in-flight weight updates against drain mode, with the same correction, at staleness 2
    "inflight_none": Variant(("algorithm.correction.type=none", *INFLIGHT), stalenesses=(2,)),
    "inflight_tis": Variant((*TIS, *INFLIGHT), stalenesses=(2,)),
    # verl's variants (docs/algorithms.md), at the stalenesses where the corrections must act:
    # TIS with the weights normalised to mean 1 over the batch (rollout_is_batch_normalize)
    "tis_bn": Variant((*TIS, "algorithm.correction.batch_normalize=true"), stalenesses=(4, 8)),
    # TIS plus sequence rejection on the max per-token k3 (rollout_rs=seq_max_k3): 0.2 drops a
    # sequence with any token ratio outside about [0.5, 1.8] (IcePop masks [0.5, 2] token by token)
    "tis_k3max": Variant(
        (
            *TIS,
            "algorithm.rejection.type=sequence",
            "algorithm.rejection.metric=k3",
            "algorithm.rejection.agg=max",
            "algorithm.rejection.high=0.2",
        ),
        stalenesses=(4, 8),
    ),
}


@dataclass(frozen=True)
class Grid:
    """What one grid runs: the launch's config file (None: the embedded default) and values."""

    config: str | None
    stalenesses: tuple[int, ...]
    lrs: tuple[str, ...]  # the default first, then the high one
    seeds: tuple[int, ...]
    variants: tuple[str, ...] = tuple(VARIANTS)


GRIDS = {
    # the broad sweep: the embedded tiny model, 500 steps, ~90 s a run on 2 cores. 1e-3 is
    # twice the default; whether the uncorrected runs degrade there is for the sweep to show.
    "tiny": Grid(None, (0, 2, 4, 8), ("5e-4", "1e-3"), (0, 1)),
    # the points that decide the defaults: SmolLM2 on two-digit addition (docs/off_policy.md),
    # one seed by default
    "smollm2": Grid("configs/smollm2_arith20.yaml", (0, 2, 4, 8), ("1e-5", "3e-5"), (0,)),
}


@dataclass(frozen=True)
class Cell:
    staleness: int
    variant: str
    lr: str
    seed: int

    @property
    def name(self) -> str:
        return f"s{self.staleness}-{self.variant}-lr{self.lr}-seed{self.seed}"

    def overrides(self) -> list[str]:
        return [
            f"replay.max_staleness={self.staleness}",
            *VARIANTS[self.variant].overrides,
            f"learner.lr={self.lr}",
            f"trainer.seed={self.seed}",
            f"data.seed={self.seed}",
        ]


def grid_cells(grid: Grid, seeds: tuple[int, ...], lrs: tuple[str, ...]) -> list[Cell]:
    cells = []
    for seed in seeds:
        for lr in lrs:
            for name in grid.variants:
                cells += [
                    Cell(s, name, lr, seed) for s in grid.stalenesses if VARIANTS[name].runs_at(s)
                ]
    return cells


def interleave(cells: list[Cell], order_seed: int = 0) -> list[Cell]:
    """Seed by seed (in the order seeds first appear), each seed's cells shuffled by a seeded
    generator (the same order every time): consecutive runs differ in configuration, across
    the seam between two seeds too."""
    out: list[Cell] = []
    for seed in dict.fromkeys(c.seed for c in cells):
        block = [c for c in cells if c.seed == seed]
        random.Random(f"{order_seed}-{seed}").shuffle(block)
        if out and len(block) > 1 and _config(block[0]) == _config(out[-1]):
            block = block[1:] + block[:1]
        out += block
    return out


def _config(cell: Cell) -> tuple[int, str, str]:
    return cell.staleness, cell.variant, cell.lr


def select(cells: list[Cell], only: str | None) -> list[Cell]:
    """Cells whose name matches any of the comma-separated fnmatch patterns of `only`."""
    if not only:
        return cells
    pats = only.split(",")
    return [c for c in cells if any(fnmatch.fnmatchcase(c.name, p) for p in pats)]


def decide(out: Path, name: str) -> str:
    """'skip' (finished), 'rerun' (started, not finished: move it aside first) or 'run'."""
    run_dir = out / name
    if cell_finished(run_dir, out / f"{name}.log"):
        return "skip"
    if run_dir.exists() or (out / f"{name}.log").exists():
        return "rerun"
    return "run"


def move_aside(out: Path, name: str) -> Path:
    """Move an unfinished cell's run directory and log to the first free CELL.failed-N."""
    n = 1
    while (out / f"{name}.failed-{n}").exists() or (out / f"{name}.failed-{n}.log").exists():
        n += 1
    target = out / f"{name}.failed-{n}"
    if (out / name).exists():
        shutil.move(out / name, target)
    if (out / f"{name}.log").exists():
        shutil.move(out / f"{name}.log", out / f"{name}.failed-{n}.log")
    return target


def launch_cmd(
    grid: Grid, config: str | None, cell: Cell, out: Path, extra: list[str]
) -> list[str]:
    cmd = [sys.executable, "-m", "asyncrl.launch.cli", "launch"]
    if config:
        cmd.append(config)
    return [
        *cmd,
        *cell.overrides(),
        f"trainer.run_dir={out / cell.name}",
        "launch.progress=none",
        "trainer.save_final=false",
        *extra,
    ]


def run_grid(ns: argparse.Namespace) -> int:
    grid = GRIDS[ns.grid]
    seeds = tuple(int(s) for s in ns.seeds.split(",")) if ns.seeds else grid.seeds
    lrs = tuple(ns.lrs.split(",")) if ns.lrs else grid.lrs
    config = ns.config if ns.config is not None else grid.config
    if ns.config is not None:  # the launch runs in the source tree: resolve from here
        config = str(Path(ns.config).resolve())
    cells = interleave(select(grid_cells(grid, seeds, lrs), ns.only))
    out = Path(ns.out).resolve()
    plan = [(c, decide(out, c.name)) for c in cells]
    todo = [c for c, d in plan if d != "skip"]
    print(f"{ns.grid}: {len(cells)} cells, {len(todo)} to run, {len(cells) - len(todo)} done")
    if ns.dry_run:
        for i, (c, d) in enumerate(plan, 1):
            print(
                f"{i:4d}/{len(plan)} {d:5s} {' '.join(launch_cmd(grid, config, c, out, ns.extra))}"
            )
        return 0
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    started, took, failed = time.monotonic(), list[float](), list[str]()
    for i, cell in enumerate(todo, 1):
        if decide(out, cell.name) == "rerun":
            print(f"  {cell.name}: unfinished, moved to {move_aside(out, cell.name).name}")
        eta = f"{(len(todo) - i + 1) * sum(took) / len(took) / 60:.1f} min" if took else "?"
        print(
            f"[{i}/{len(todo)}] {cell.name} elapsed {(time.monotonic() - started) / 60:.1f} min"
            f" eta {eta}",
            flush=True,
        )
        t0 = time.monotonic()
        with open(out / f"{cell.name}.log", "w") as log:
            cmd = launch_cmd(grid, config, cell, out, ns.extra)
            log.write("# " + " ".join(cmd) + "\n")
            log.flush()
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            ).returncode
        took.append(time.monotonic() - t0)
        if not cell_finished(out / cell.name, out / f"{cell.name}.log"):
            failed.append(cell.name)
            print(f"  {cell.name}: did not finish (exit {rc}); see {cell.name}.log", flush=True)
    print(f"done in {(time.monotonic() - started) / 60:.1f} min; {len(failed)} failed {failed}")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the grid's unfinished cells")
    r.add_argument("--grid", choices=sorted(GRIDS), required=True)
    r.add_argument("--out", required=True, help="the study's directory (one run dir per cell)")
    r.add_argument("--config", help="the launch's config file (default: the grid's)")
    r.add_argument("--seeds", help="comma-separated seeds (default: the grid's)")
    r.add_argument("--lrs", help="comma-separated learning rates (default: the grid's)")
    r.add_argument("--only", help="comma-separated fnmatch patterns of cell names")
    r.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    r.add_argument("extra", nargs="*", help="section.key=value overrides for every cell")
    p = sub.add_parser("report", help="table, figure and staleness check of finished cells")
    p.add_argument("--out", required=True)
    p.add_argument("--figure", type=Path)
    p.add_argument("--table", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--window", type=int, default=20, help="final reward: mean of the last N steps")
    p.add_argument("--smooth", type=int, default=10, help="running-mean window (steps)")
    p.add_argument("--fraction", type=float, default=0.9, help="of the sync run's final reward")
    ns = ap.parse_args()
    return run_grid(ns) if ns.cmd == "run" else report(ns)


if __name__ == "__main__":
    raise SystemExit(main())
