"""`asyncrl plot` on a real (tiny) run directory: every figure and the Chrome trace are written,
and the timeline's automatic window shows the servers generating."""

from pathlib import Path

import pytest
from matplotlib.image import imread

from asyncrl.analysis.figures import read_jsonl, read_traces
from asyncrl.analysis.timeline import timeline_window
from asyncrl.config import load_config
from asyncrl.launch.cli import main
from asyncrl.launch.run import launch

pytestmark = [pytest.mark.integration, pytest.mark.long]

PNGS = {
    "reward.png",
    "response_length.png",
    "staleness.png",
    "throughput.png",
    "idle.png",
    "step_time.png",
    "timeline.png",
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("plot_run")
    cfg = load_config(
        overrides=[
            f"trainer.run_dir={tmp / 'run'}",
            f"trainer.cache_dir={tmp / 'cache'}",
            "trainer.warmstart_steps=10",  # learning is not the point: the files are
            "trainer.total_steps=8",
            "rollout.n=4",
            "data.train_batch_size=4",
            "launch.progress=none",
        ]
    )
    return launch(cfg)


def test_asyncrl_plot_writes_every_figure_of_a_real_run(run_dir: Path, capsys) -> None:
    assert main(["plot", str(run_dir)]) == 0

    printed = {Path(line).name for line in capsys.readouterr().out.split()}
    assert printed == PNGS | {"trace.json"}
    for name in PNGS:
        image = imread(run_dir / "plots" / name)
        assert image.shape[0] > 300 and image.shape[1] > 600, name


def test_the_automatic_window_shows_the_servers_generating(run_dir: Path) -> None:
    traces = read_traces(run_dir)
    window = timeline_window(read_jsonl(run_dir / "metrics.jsonl"), traces)
    assert window is not None
    lo, hi = window

    generate = [s for s in traces["server_0"] if s["name"] == "generate"]
    assert any(lo < s["ts"] + s["dur"] and s["ts"] < hi for s in generate)
