"""tools/search_demo_report.py on synthetic runs: window means, the spread over runs, and a
clear refusal of a run without steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))

import search_demo_report  # noqa: E402


def write_run(path: Path, rewards: list[float]) -> Path:
    path.mkdir()
    lines = [
        {
            "step": i + 1,
            "reward_mean": r,
            "traj/agent_useful_search": r / 2,
            "traj/agent_tool_calls": 1,
        }
        for i, r in enumerate(rewards)
    ]
    (path / "metrics.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in [{"event": "start"}, *lines])
    )
    return path


def test_window_means_and_the_spread_over_runs(tmp_path, capsys):
    a = write_run(tmp_path / "a", [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    b = write_run(tmp_path / "b", [0.2, 0.2, 0.2, 0.2, 0.2, 0.6])
    means = search_demo_report.window_means(search_demo_report.steps_of(a), 2, 3)
    assert means["reward_mean@first"] == 0.1 and abs(means["reward_mean@last"] - 0.8) < 1e-9
    assert abs(means["traj/agent_useful_search@last"] - 0.4) < 1e-9
    assert search_demo_report.main([str(a), str(b), "--first", "2", "--last", "3"]) == 0
    out = capsys.readouterr().out
    assert "0.150±0.071" in out  # first-2 reward means 0.1 and 0.2


def test_a_run_without_steps_is_refused_by_name(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"event": "start"}\n')
    assert search_demo_report.main([str(empty)]) == 1
    assert "has no learner steps" in capsys.readouterr().err
