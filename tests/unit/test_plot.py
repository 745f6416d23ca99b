"""Plots and the Chrome trace from a synthetic run directory: every figure is written and
readable, spans convert to µs trace events, and missing keys or traces never crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.image import imread

from asyncrl.analysis.plot import main, plot_run
from asyncrl.analysis.timeline import timeline_window, write_chrome_trace

T0 = 1_700_000_000.0
STEPS = 10
METRIC_PNGS = {
    "reward.png",
    "response_length.png",
    "staleness.png",
    "throughput.png",
    "idle.png",
    "step_time.png",
}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _full_row(step: int) -> dict:
    return {
        "step": step,
        "version": step,
        "time": T0 + step,
        "reward_mean": 0.3 + 0.02 * step,
        "reward_std": 0.4,
        "response_len_mean": 20.0 + step,
        "response_len_p50": 19.0 + step,
        "response_len_max": 40 + step,
        "staleness_mean": 0.5,
        "staleness_max": 1,
        "staleness_hist": [3, 5] if step % 2 else [4, 2, 2],
        "samples_per_s": 100.0 + step,
        "gen_tokens_per_s": 2000.0,
        "train_tokens_per_s": 1800.0,
        "learner_idle_ratio": 0.2,
        "server_idle_ratio": 0.1,
        "time_fetch_batch_s": 0.2,
        "time_update_s": 0.6,
        "time_broadcast_weights_s": 0.1,
        "weight_sync_s": 0.12,
        "loss": 0.01,
    }


def _learner_spans() -> list[dict]:
    spans = []
    for step in range(1, STEPS + 1):
        start = T0 + step - 1.0
        for name, offset, dur in (("fetch_batch", 0.05, 0.2), ("update", 0.25, 0.6)):
            spans.append({"name": name, "cat": "learner", "ts": start + offset, "dur": dur})
        spans.append(
            {"name": "broadcast_weights", "cat": "learner", "ts": start + 0.86, "dur": 0.1}
        )
    return spans


def _server_spans() -> list[dict]:
    spans = []
    for i in range(2 * STEPS):
        ts = T0 + 0.5 * i
        spans.append(
            {
                "name": "generate",
                "cat": "rollout",
                "ts": ts,
                "dur": 0.4,
                "args": {"batch": 8, "version": i // 2},
            }
        )
    for step in range(1, STEPS + 1):
        spans.append({"name": "apply_weights", "cat": "sync", "ts": T0 + step - 0.05, "dur": 0.03})
    return spans


@pytest.fixture
def full_run(tmp_path: Path) -> Path:
    run = tmp_path / "full"
    rows = [_full_row(s) for s in range(1, STEPS + 1)]
    rows.append({"step": STEPS, "time": T0 + STEPS + 0.5, "val/mean_score": 0.7})
    _write_jsonl(run / "metrics.jsonl", rows)
    _write_jsonl(run / "trace" / "learner_0.jsonl", _learner_spans())
    _write_jsonl(run / "trace" / "server_0.jsonl", _server_spans())
    # A writer killed mid-line leaves a partial last line; it must be skipped, not fatal.
    with (run / "trace" / "server_0.jsonl").open("a") as f:
        f.write('{"name": "generate", "ts": 1')
    return run


@pytest.fixture
def metrics_only_run(tmp_path: Path) -> Path:
    """An older run: no trace dir, none of the newer keys, a validation-only row, a null."""
    run = tmp_path / "old"
    rows = [
        {"step": s, "time": T0 + s, "reward_mean": 0.5, "samples_per_s": 10.0, "loss": None}
        for s in range(1, 6)
    ]
    rows.append({"step": 5, "val/mean_score": 0.4})
    _write_jsonl(run / "metrics.jsonl", rows)
    return run


def _assert_png(path: Path) -> None:
    assert path.stat().st_size > 10_000, path
    image = imread(path)
    height, width, channels = image.shape
    assert height > 300 and width > 600 and channels in (3, 4), (path, image.shape)


def test_plot_run_writes_every_figure(full_run: Path) -> None:
    paths = plot_run(full_run)

    assert {p.name for p in paths} == METRIC_PNGS | {"timeline.png"}
    assert all(p.parent == full_run / "plots" for p in paths)
    for path in paths:
        _assert_png(path)


def test_plot_run_honours_out_dir_and_window(full_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "elsewhere"

    paths = plot_run(full_run, out, window=(2, 3))

    assert out / "timeline.png" in paths
    _assert_png(out / "timeline.png")


def test_timeline_window_spans_the_chosen_steps(full_run: Path) -> None:
    rows = [_full_row(s) for s in range(1, STEPS + 1)]
    traces = {"learner_0": _learner_spans()}

    # Step A starts where step A-1's metrics row was written; step B ends at its own row.
    assert timeline_window(rows, traces, (3, 4)) == (T0 + 2, T0 + 4)
    # No window: the learner is equally busy throughout, so the five steps mid-run (4 to 8).
    assert timeline_window(rows, traces) == (T0 + 3, T0 + 8)
    # The first step has no previous row: it starts at its first learner span.
    assert timeline_window(rows, traces, (1, 2)) == (T0 + 0.05, T0 + 2)
    # Without metrics, the learner's `update` spans choose the window.
    assert timeline_window([], traces, (2, 2)) == (T0 + 1.25, T0 + 1.85)


def test_metrics_only_run_plots_without_timeline(metrics_only_run: Path) -> None:
    paths = plot_run(metrics_only_run)

    assert {p.name for p in paths} == {"reward.png", "throughput.png"}
    for path in paths:
        _assert_png(path)


def test_rows_missing_every_optional_key_write_nothing(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1}, {"version": 2}, {}])

    assert plot_run(tmp_path) == []


def test_run_dir_without_metrics_or_traces_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)


def test_chrome_trace_events(full_run: Path, tmp_path: Path) -> None:
    path = write_chrome_trace(full_run, tmp_path / "trace.json")

    events = json.loads(path.read_text())["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert sorted(names.values()) == ["learner_0", "server_0"]
    pid_of = {name: pid for pid, name in names.items()}
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 3 * STEPS + 3 * STEPS  # learner stages; generate + apply_weights
    assert {e["name"] for e in complete} == {
        "fetch_batch",
        "update",
        "broadcast_weights",
        "generate",
        "apply_weights",
    }
    for event in complete:
        assert set(event) >= {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
        assert isinstance(event["tid"], int)
    first_update = min((e for e in complete if e["name"] == "update"), key=lambda e: e["ts"])
    assert first_update["pid"] == pid_of["learner_0"]
    assert first_update["ts"] == pytest.approx((T0 + 0.25) * 1e6, abs=1.0)
    assert first_update["dur"] == pytest.approx(0.6e6)
    generate = next(e for e in complete if e["name"] == "generate")
    assert generate["pid"] == pid_of["server_0"]
    assert generate["args"] == {"batch": 8, "version": 0}
    # Categories get separate tids, so an apply_weights never overlaps a generate on one tid.
    apply = next(e for e in complete if e["name"] == "apply_weights")
    assert apply["tid"] != generate["tid"]


def test_chrome_trace_without_traces_is_empty_but_valid(
    metrics_only_run: Path, tmp_path: Path
) -> None:
    path = write_chrome_trace(metrics_only_run, tmp_path / "trace.json")

    assert json.loads(path.read_text())["traceEvents"] == []


def test_main_prints_written_paths(full_run: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"

    assert main([str(full_run), "--out", str(out), "--window", "4:6"]) == 0

    printed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in printed) == sorted(
        METRIC_PNGS | {"timeline.png", "trace.json"}
    )
    assert all(Path(p).is_file() for p in printed)


def test_main_rejects_a_bad_window(full_run: Path) -> None:
    with pytest.raises(SystemExit):
        main([str(full_run), "--window", "6:4"])


def test_main_reports_a_missing_run_dir(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path / "nope")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
