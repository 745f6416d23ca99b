"""What makes the plots readable (issue 29): rolling means, a reward band inside the reward's
range, a timeline window where every process works, and one colour per stage."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from asyncrl.analysis.figures import (
    EXTRA_STAGE_COLOURS,
    STAGE_COLOURS,
    clip_band,
    rolling_mean,
    smoothing_window,
    stage_colours,
)
from asyncrl.analysis.plot import observed_reward_range, reward_band, staleness_shares
from asyncrl.analysis.timeline import busiest_steps, step_bounds, timeline_window

REPO = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000.0


def test_rolling_mean_is_centred_and_shrinks_at_the_ends() -> None:
    assert rolling_mean([0.0, 3.0, 6.0, 9.0, 0.0], 3) == [1.5, 3.0, 6.0, 5.0, 4.5]
    assert rolling_mean([1.0, 5.0, 2.0], 1) == [1.0, 5.0, 2.0]
    assert rolling_mean([], 5) == []


def test_smoothing_window_is_odd_and_bounded() -> None:
    assert smoothing_window(5) == 1  # too few points to smooth
    assert smoothing_window(100) == 11
    assert smoothing_window(100_000) == 51
    assert all(smoothing_window(n) % 2 == 1 for n in range(0, 700, 7))


def test_clip_band_keeps_both_edges_in_range() -> None:
    lower, upper = clip_band([0.1, 0.5, 0.9], [0.5, 0.5, 0.5], 0.0, 1.0)

    assert lower == pytest.approx([0.0, 0.0, 0.4])
    assert upper == pytest.approx([0.6, 1.0, 1.0])
    assert clip_band([0.5], [2.0], None, None) == ([-1.5], [2.5])


def test_reward_band_of_a_binary_reward_stays_in_0_1(tmp_path: Path) -> None:
    # A 0/1 reward: a per-sample std near 0.5 around every mean, as the issue saw (-0.2 to 1.2).
    rows = [
        {"step": s, "reward_mean": 0.3 + 0.5 * (s % 2), "reward_std": 0.48} for s in range(1, 41)
    ]
    trajectories = [{"reward": float(i % 2), "eval": False} for i in range(50)]
    trajectories.append({"reward": 7.0, "eval": True})  # evaluation rewards do not count
    (tmp_path / "rollout_metrics.jsonl").write_text(
        "".join(json.dumps(t) + "\n" for t in trajectories)
    )

    reward_range = observed_reward_range(tmp_path)
    steps, lower, upper = reward_band(rows, reward_range)

    assert reward_range == (0.0, 1.0)
    assert steps == list(range(1, 41))
    assert min(lower) >= 0.0 and max(upper) <= 1.0
    assert min(lower) == 0.0 and max(upper) == 1.0  # clipped, not merely narrow
    assert observed_reward_range(tmp_path / "missing") is None


def test_staleness_shares_are_each_steps_histogram_normalised() -> None:
    rows: list[dict] = [
        {"step": 1, "staleness_hist": [3, 1]},  # shorter than the longest: padded with 0
        {"step": 2, "staleness_hist": [0, 0, 0]},  # no samples: left out
        {"step": 3},  # an older row without a histogram
        {"step": 4, "staleness_hist": [0, 2, 2]},
    ]

    steps, shares = staleness_shares(rows, 3)

    assert steps == [1, 4]
    assert shares == [[0.75, 0.0], [0.25, 0.5], [0.0, 0.5]]


def _stop_early_trace(steps: int, generation_stops: float) -> tuple[list[dict], dict]:
    """`steps` one-second learner steps; the learner waits for batches (fetch_batch) through
    the first five steps, then trains; two servers generate until `generation_stops` seconds."""
    rows = [{"step": s, "time": T0 + s} for s in range(1, steps + 1)]
    learner = []
    for s in range(1, steps + 1):
        start = T0 + s - 1
        if s <= 5:
            learner.append({"name": "fetch_batch", "cat": "learner", "ts": start, "dur": 0.95})
        else:
            learner.append({"name": "fetch_batch", "cat": "learner", "ts": start, "dur": 0.05})
            learner.append({"name": "update", "cat": "learner", "ts": start + 0.05, "dur": 0.9})
    traces = {"learner_0": learner}
    for server in range(2):
        traces[f"server_{server}"] = [
            {"name": "generate", "cat": "rollout", "ts": T0 + 0.25 * i, "dur": 0.24}
            for i in range(int(generation_stops / 0.25))
        ]
    return rows, traces


def test_default_window_is_where_every_process_works_not_the_tail() -> None:
    rows, traces = _stop_early_trace(steps=30, generation_stops=20.0)

    window = timeline_window(rows, traces)
    assert window is not None
    lo, hi = window

    # Steps 6 to 20 have the learner training and both servers generating; 26-30 (the old
    # default, the last five) have servers that stopped.
    assert lo >= T0 + 5 and hi <= T0 + 20
    generating = [s for s in traces["server_0"] if lo <= s["ts"] and s["ts"] + s["dur"] <= hi]
    assert len(generating) >= 4 * 5 - 1
    # Among equally busy stretches, the one nearest the middle of the run: 12 s to 17 s.
    bounds = step_bounds(rows, traces)
    assert busiest_steps(sorted(bounds), bounds, traces) == [13, 14, 15, 16, 17]


def test_an_explicit_window_still_wins() -> None:
    rows, traces = _stop_early_trace(steps=30, generation_stops=20.0)

    assert timeline_window(rows, traces, (26, 30)) == (T0 + 25, T0 + 30)
    # A window with no step in it falls back to the automatic choice.
    assert timeline_window(rows, traces, (90, 99)) == timeline_window(rows, traces)


def _recorded_stage_names() -> set[str]:
    """Every span name a run can record: the learner's timed stages and the servers' spans."""
    trainer = (REPO / "learner" / "trainer.py").read_text()
    server = (REPO / "rollout_servers" / "server.py").read_text()
    names = set(re.findall(r'timer\("(\w+)"\)', trainer))
    names |= set(re.findall(r'trace\.record\(\s*"(\w+)"', server))
    return names


def test_every_recorded_stage_has_its_own_colour() -> None:
    names = _recorded_stage_names()

    assert {"fetch_batch", "update", "validate", "generate", "apply_weights"} <= names
    assert names <= set(STAGE_COLOURS), f"stages without a colour: {names - set(STAGE_COLOURS)}"
    colours = stage_colours(sorted(names))
    assert len(set(colours.values())) == len(names)


def test_unknown_stages_get_colours_no_known_stage_uses() -> None:
    colours = stage_colours(["update", "new_stage", "other_stage", "update"])

    assert colours["update"] == STAGE_COLOURS["update"]
    assert colours["new_stage"] != colours["other_stage"]
    assert not {colours["new_stage"], colours["other_stage"]} & set(STAGE_COLOURS.values())
    palette = list(STAGE_COLOURS.values()) + EXTRA_STAGE_COLOURS
    assert len(set(palette)) == len(palette)
