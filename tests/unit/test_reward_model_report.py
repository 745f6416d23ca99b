"""tools/reward_model_report.py on synthetic runs: what each run trained on (from its config),
the rule reward read from `traj/reward_rule` where a reward model ran and from `reward_mean`
where it did not, window means and the time to 0.8 by hand, and a clear refusal of a run
without steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))

import reward_model_report  # noqa: E402


def write_run(path: Path, reward: dict, rule: list[float], model: bool) -> Path:
    path.mkdir()
    (path / "config.yaml").write_text(json.dumps({"reward": reward}))  # JSON is YAML
    lines = []
    for i, r in enumerate(rule):
        row = {"step": i + 1, "time": 100.0 + i, "step_s": 1.0, "reward_mean": r}
        if model:
            row |= {"reward_mean": 5.0 - r, "traj/reward_rule": r}  # trained on something else
        lines.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_what_each_run_trained_on_and_its_rule_reward(tmp_path, capsys):
    rule = [0.0] * 20 + [1.0] * 100  # the 20-step mean passes 0.8 at step 36
    model = write_run(tmp_path / "m", {"model": {"path": "/rm"}, "rule_weight": 0}, rule, True)
    plain = write_run(tmp_path / "r", {}, rule, False)
    both = write_run(tmp_path / "b", {"model": {"path": "/rm"}}, rule, True)
    combine = {"model": {"path": "/rm"}, "combine": {"path": "c.py"}}
    combined = write_run(tmp_path / "c", combine, rule, True)
    assert [reward_model_report.trained_on(p) for p in (model, plain, both, combined)] == [
        "model",
        "rule",
        "rule+model",
        "combine",
    ]
    for run in (model, plain):
        s = reward_model_report.summarize(run)
        assert s["first5"] == 0.0 and s["at100"] == 1.0 and s["last20"] == 1.0
        assert s["s_to_target"] == 36.0  # step 36's end (time 135) less the first start (99)
        assert s["wall_s"] == 120.0
    assert reward_model_report.main([str(model), str(plain)]) == 0
    assert "model" in capsys.readouterr().out


def test_a_run_without_steps_is_refused_by_name(tmp_path, capsys):
    empty = write_run(tmp_path / "e", {}, [], False)
    assert reward_model_report.main([str(empty)]) == 1
    assert "has no training steps" in capsys.readouterr().err
