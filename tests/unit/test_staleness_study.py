"""The staleness study (tools/staleness_study.py, tools/study_report.py): its pure logic on
hand-built numbers and synthetic run directories."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def study():
    """tools/staleness_study.py, imported as its command line does (tools/ first on sys.path:
    it imports tools/study_report.py and that tools/real_model_report.py by name)."""
    sys.path.insert(0, str(ROOT / "tools"))
    module = importlib.import_module("staleness_study")
    yield module
    for name in ("staleness_study", "study_report", "real_model_report", "compare_algorithms"):
        sys.modules.pop(name, None)
    sys.path.remove(str(ROOT / "tools"))


@pytest.fixture
def report(study):
    return sys.modules["study_report"]


def fake_run(out: Path, name: str, hists: list[list[int]], bound: int, total: int, done=True):
    """A run directory as `asyncrl launch` leaves it: config.yaml, metrics.jsonl, the log."""
    run = out / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(
        f"# asyncrl launch\nreplay:\n  max_staleness: {bound}\ntrainer:\n  total_steps: {total}\n"
    )
    with open(run / "metrics.jsonl", "w") as f:
        for i, hist in enumerate(hists):
            worst = max(k for k, c in enumerate(hist) if c) if any(hist) else 0
            row = {"step": i + 1, "time": 0.0, "reward_mean": 0.5, "samples": sum(hist)}
            f.write(json.dumps({**row, "staleness_max": worst, "staleness_hist": hist}) + "\n")
    (out / f"{name}.log").write_text("asyncrl: done in 3s.\n" if done else "Traceback\n")
    return run


def test_running_mean_and_first_reaching_by_hand(report):
    assert report.running_mean([0.0, 1.0, 1.0, 0.0], 2) == [0.0, 0.5, 1.0, 0.5]
    xs = [10.0, 20.0, 30.0, 40.0]
    assert report.first_reaching(xs, [0.0, 0.5, 1.0, 0.5], 0.5) == 20.0
    assert report.first_reaching(xs, [0.0, 0.5, 1.0, 0.5], 0.9) == 30.0
    assert report.first_reaching(xs, [0.0, 0.5, 1.0, 0.5], 1.1) is None


def test_collapse_is_a_drop_of_0_2_from_the_running_peak(report):
    rise_and_fall = [0.0, 0.9, 0.9, 0.9, 0.5, 0.5]  # peak 0.9 (2-step), final 0.5: drop 0.4
    assert report.collapsed(rise_and_fall, smooth=2, window=2)
    small_dip = [0.0, 0.9, 0.9, 0.9, 0.8, 0.75]  # final 0.775: drop 0.125
    assert not report.collapsed(small_dip, smooth=2, window=2)
    assert not report.collapsed([0.1, 0.2, 0.3, 0.4], smooth=2, window=2)


def test_staleness_check_passes_a_run_that_keeps_the_bound(report, tmp_path):
    run = fake_run(tmp_path, "s2-none-lr5e-4-seed0", [[8, 0, 0], [4, 2, 2]], bound=2, total=2)
    assert report.staleness_problems(report.step_rows(run), 2) == []


def test_staleness_check_names_every_breaking_step(report, tmp_path):
    hists = [[8, 0, 0], [4, 2, 1, 1], [8, 0, 0]]  # step 2: one sample 3 versions old
    run = fake_run(tmp_path, "s2-none-lr5e-4-seed0", hists, bound=2, total=3)
    problems = report.staleness_problems(report.step_rows(run), 2)
    assert len(problems) == 1 and problems[0].startswith("step 2:")
    assert report.staleness_problems([], 2) == ["no step records"]
    bad_count = [{"step": 1, "staleness_max": 0, "staleness_hist": [3], "samples": 4}]
    assert "3 of 4" in report.staleness_problems(bad_count, 0)[0]


def test_report_exits_nonzero_when_a_cell_breaks_the_bound(study, tmp_path, capsys, monkeypatch):
    fake_run(tmp_path, "s0-none-lr5e-4-seed0", [[8]] * 3, bound=0, total=3)
    fake_run(tmp_path, "s2-none-lr5e-4-seed0", [[4, 2, 2]] * 3, bound=2, total=3)
    argv = ["staleness_study.py", "report", "--out", str(tmp_path), "--window", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    assert study.main() == 0
    fake_run(tmp_path, "s2-tis-lr5e-4-seed0.failed-1", [[4, 2, 1, 1]], bound=2, total=3)
    assert study.main() == 1  # a run moved aside trained samples too: it is checked
    assert "BROKEN in 1 cells: s2-tis-lr5e-4-seed0.failed-1" in capsys.readouterr().out
    (tmp_path / "s2-tis-lr5e-4-seed0.failed-1" / "metrics.jsonl").unlink()
    (tmp_path / "s2-tis-lr5e-4-seed0.failed-1" / "config.yaml").unlink()
    fake_run(tmp_path, "s2-tis-lr5e-4-seed0", [[4, 2, 1, 1]] * 3, bound=2, total=3)
    assert study.main() == 1
    assert "STALENESS BOUND BROKEN in 1 cells: s2-tis-lr5e-4-seed0" in capsys.readouterr().out


def test_a_cell_still_starting_is_not_a_break_while_no_records_stay_a_problem(
    study, report, tmp_path, capsys, monkeypatch
):
    fake_run(tmp_path, "s0-none-lr5e-4-seed0", [[8]] * 3, bound=0, total=3)
    fake_run(tmp_path, "s4-tis-lr5e-4-seed0", [], bound=4, total=3, done=False)  # starting
    monkeypatch.setattr(sys, "argv", ["staleness_study.py", "report", "--out", str(tmp_path)])
    assert study.main() == 0
    out = capsys.readouterr().out
    assert "s4-tis-lr5e-4-seed0 (unfinished): no step records yet" in out
    assert "BROKEN" not in out
    assert report.staleness_problems([], 4) == ["no step records"]  # as a finished run's


def test_resume_decision_and_moving_aside(study, tmp_path):
    fake_run(tmp_path, "done", [[8]] * 3, bound=0, total=3)
    fake_run(tmp_path, "short", [[8]] * 2, bound=0, total=3)  # 2 of 3 steps
    fake_run(tmp_path, "crashed", [[8]] * 3, bound=0, total=3, done=False)
    assert study.decide(tmp_path, "done") == "skip"
    assert study.decide(tmp_path, "short") == "rerun"
    assert study.decide(tmp_path, "crashed") == "rerun"
    assert study.decide(tmp_path, "new") == "run"
    assert study.move_aside(tmp_path, "short").name == "short.failed-1"
    fake_run(tmp_path, "short", [[8]], bound=0, total=3)
    assert study.move_aside(tmp_path, "short").name == "short.failed-2"
    assert (tmp_path / "short.failed-2.log").exists() and study.decide(tmp_path, "short") == "run"


def test_interleaved_order_is_seed_by_seed_shuffled_and_repeatable(study):
    cells = study.grid_cells(study.GRIDS["tiny"], (0, 1), ("5e-4", "1e-3"))
    order = study.interleave(cells)
    assert order == study.interleave(cells) and sorted(map(str, order)) == sorted(map(str, cells))
    half = len(order) // 2
    assert {c.seed for c in order[:half]} == {0} and {c.seed for c in order[half:]} == {1}
    assert [c.name for c in order[:half]] != [c.name for c in cells[:half]]  # shuffled
    configs = [(c.staleness, c.variant, c.lr) for c in order]
    assert all(a != b for a, b in zip(configs, configs[1:], strict=False))


def test_grid_runs_only_none_and_decoupled_mb_at_staleness_0_and_inflight_at_2(study):
    cells = study.grid_cells(study.GRIDS["tiny"], (0,), ("5e-4",))
    assert {c.variant for c in cells if c.staleness == 0} == {"none", "decoupled_mb"}
    assert {c.staleness for c in cells if c.variant.startswith("inflight")} == {2}
    assert {c.staleness for c in cells if c.variant == "tis"} == {2, 4, 8}
    cell = next(c for c in cells if c.variant == "tis" and c.staleness == 4)
    assert cell.name == "s4-tis-lr5e-4-seed0"
    assert {"trainer.seed=0", "data.seed=0", "replay.max_staleness=4"} <= set(cell.overrides())
    assert [c.name for c in study.select(cells, "s4-*,s0-none*")] == [
        c.name for c in cells if c.staleness == 4 or c.name.startswith("s0-none")
    ]


def test_sync_reference_is_the_variants_own_staleness_0_else_none(report):
    def run(s, v):
        return report.CellRun(f"s{s}-{v}", s, v, "5e-4", 0, [1.0], [8], [0.5], {})

    groups = report.group_runs([run(0, "none"), run(0, "decoupled_mb"), run(4, "tis")])
    groups.update(report.group_runs([run(4, "decoupled_mb")]))
    assert report.sync_of(groups, groups[(4, "tis", "5e-4")]).variant == "none"
    assert report.sync_of(groups, groups[(4, "decoupled_mb", "5e-4")]).variant == "decoupled_mb"


def test_group_final_standard_error_across_seeds_else_steps(report):
    def run(seed, rewards):
        return report.CellRun("x", 2, "none", "5e-4", seed, [0.0] * 4, [1] * 4, rewards, {})

    one = report.Group(2, "none", "5e-4", [run(0, [0.0, 0.0, 0.2, 0.4])])
    final, se = one.final(2)
    assert final == pytest.approx(0.3) and se == pytest.approx(0.1)  # sd 0.1414 / sqrt 2
    two = report.Group(2, "none", "5e-4", [run(0, [0.0, 0.2]), run(1, [0.0, 0.6])])
    final, se = two.final(1)
    assert final == pytest.approx(0.4) and se == pytest.approx(0.2)  # sd 0.2828 / sqrt 2


def test_wallclock_pairs_each_seed_with_its_own_sync_run_by_hand(report):
    def run(s, seed, seconds, rewards):
        n = len(rewards)
        return report.CellRun(
            f"s{s}-none-lr5e-4-seed{seed}",
            s,
            "none",
            "5e-4",
            seed,
            seconds,
            list(range(1, n + 1)),
            rewards,
            {},
        )

    # seed 0: sync final (last 2 steps) 0.5; its running means (2 steps) 0, 0.25, 0.5 reach it
    # at t=30; the async run's 0.5, 0.5, 0.55 at t=5: 6x; it ends at 15 against 30
    # seed 1: the async run never reaches its sync run's 0.8; seed 2 has no sync run
    runs = [
        run(0, 0, [10.0, 20.0, 30.0], [0.0, 0.5, 0.5]),
        run(4, 0, [5.0, 10.0, 15.0], [0.5, 0.5, 0.6]),
        run(0, 1, [10.0, 20.0], [0.8, 0.8]),
        run(4, 1, [5.0, 10.0], [0.1, 0.1]),
        run(4, 2, [5.0, 10.0], [0.9, 0.9]),
    ]
    ns = type("NS", (), {"window": 2, "smooth": 2})()
    rows = {r["cell"]: r for r in report.wallclock(report.group_runs(runs), ns)}
    assert set(rows) == {"s4-none-lr5e-4-seed0", "s4-none-lr5e-4-seed1"}
    zero = rows["s4-none-lr5e-4-seed0"]
    assert zero["sync_final"] == pytest.approx(0.5)
    assert (zero["sync_reaches_s"], zero["reaches_s"]) == (30.0, 5.0)
    assert zero["speedup"] == pytest.approx(6.0)
    assert (zero["sync_done_s"], zero["done_s"]) == (30, 15)
    one = rows["s4-none-lr5e-4-seed1"]
    assert one["reaches_s"] is None and one["speedup"] is None and one["sync_reaches_s"] == 10.0
    text = report.wallclock_table(list(rows.values()), ns)
    assert "| s4-none-lr5e-4-seed1 | 0.800 | 10 | never | - | 20 | 10 | 2.00x |" in text
