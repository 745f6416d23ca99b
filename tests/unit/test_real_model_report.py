"""tools/real_model_report.py on made-up runs: the gain and its standard error, the
"reaches the sync run's final reward sooner" verdict, and the figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def fake_run(path: Path, rewards: list[float], seconds_per_step: float) -> Path:
    path.mkdir()
    (path / "config.yaml").write_text("{}\n")
    start = (path / "config.yaml").stat().st_mtime
    with open(path / "metrics.jsonl", "w") as f:
        for i, r in enumerate(rewards):
            row = {"step": i + 1, "time": start + (i + 1) * seconds_per_step, "samples": 64}
            f.write(json.dumps({**row, "reward_mean": r, "mismatch_kl": 1e-3}) + "\n")
    return path


def test_report_gain_verdict_and_figure(tmp_path):
    rising = [0.2, 0.3] * 3 + [0.6, 0.7] * 6  # first 5: 0.24; last 10: 0.65
    sync = fake_run(tmp_path / "s", rising, seconds_per_step=40.0)
    fast = fake_run(tmp_path / "a", rising, seconds_per_step=20.0)
    figure = tmp_path / "fig.png"
    out = subprocess.run(
        [sys.executable, "tools/real_model_report.py", f"x-sync={sync}", f"x-async={fast}"]
        + ["--figure", str(figure)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "MPLBACKEND": "Agg"},
        check=True,
    ).stdout
    row = next(line for line in out.splitlines() if line.startswith("| x-async"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5:8] == ["0.240", "0.650", "+0.410"]
    assert float(cells[8]) > 0 and float(cells[9]) > 2  # SE, gain / SE
    assert cells[10] == "never"  # minutes to 0.8: the made-up runs stop at 0.7
    assert "x-async: reaches x-sync's final reward 0.650" in out and ": sooner" in out
    assert figure.stat().st_size > 10_000


def test_report_refuses_a_run_too_short_to_judge(tmp_path):
    short = fake_run(tmp_path / "s", [0.1] * 9, seconds_per_step=1.0)
    out = subprocess.run(
        [sys.executable, "tools/real_model_report.py", f"x-sync={short}"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "need 15" in out.stderr
