"""`asyncrl launch` with a reward-model fleet (`reward.model.path`): the embedded task is
learned from the reward model alone (`reward.rule_weight=0`: the rule reward is logged, never
trained on); SIGKILLed reward-model servers are restarted (tools/chaos.py's `rmkill`), and the
run's audit holds: every row trained once, whole groups, and every response a rollout server
sent to the fleet settled once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.demo.reward_model import RewardModelSpec, build_reward_model, prepare_reward_model
from asyncrl.demo.tasks import ArithmeticTask
from asyncrl.demo.tiny_model import build_tokenizer
from asyncrl.launch.progress import training_rows
from asyncrl.metrics import read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def random_reward_model(tmp_path_factory) -> Path:
    """A tiny untrained classifier with the embedded policy's tokenizer: what it scores does
    not matter here, only that it is served, killed and served again."""
    out = tmp_path_factory.mktemp("rm")
    tokenizer = build_tokenizer()
    build_reward_model(tokenizer, RewardModelSpec(), seed=0).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_the_embedded_task_is_learned_from_the_reward_model_alone(tmp_path, model_cache):
    """The tiny classifier of `asyncrl.demo.reward_model` (trained on right vs wrong sums, no
    rule in sight) is the only reward for 200 steps of the embedded default; the rule reward,
    logged beside it, rises (from 0.28 to a best 20-step mean of 0.75, 0.75 and 0.64 in the
    three runs kept). Not judged on the last 20 steps: in the third the policy found wrong
    answers the model scores above 0 (55% of its wrong answers after step 170) and the rule
    reward fell back to 0.49 while the model's rose: reward hacking (docs/rewards.md)."""
    rm = prepare_reward_model(model_cache, ArithmeticTask(), steps=600, seed=0)
    run_dir = tmp_path / "run"
    cmd = [
        *(sys.executable, "-m", "asyncrl.launch.cli", "launch", "trainer.total_steps=200"),
        *(f"trainer.cache_dir={model_cache}", f"trainer.run_dir={run_dir}"),
        *(f"reward.model.path={rm}", "reward.rule_weight=0", "launch.progress=none"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows = training_rows(read_jsonl(run_dir / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, 201))
    rule = [r["traj/reward_rule"] for r in rows]
    first, best = _mean(rule[:5]), max(_mean(rule[i : i + 20]) for i in range(181))
    assert best > 0.55 and best - first > 0.2, f"rule reward {first:.3f} -> best {best:.3f}"
    # what was trained on is the model's score alone (a logit: about -5 wrong, +5 right)
    assert all(r["reward_mean"] == pytest.approx(r["traj/reward_model"], abs=1e-4) for r in rows)
    server = json.loads((run_dir / "stats" / "server_0.json").read_text())
    assert server["reward_model_items"] == server["reward_model_settled"] > 0
    assert server.get("reward_model_timeout", 0) == server.get("reward_model_error", 0) == 0


def test_killed_reward_model_servers_are_restarted_and_the_audit_holds(
    tmp_path, random_reward_model
):
    run_dir = tmp_path / "run"
    cmd = [
        *(sys.executable, str(ROOT / "tools" / "chaos.py"), "--minutes", "0.5"),
        *("--every", "6", "--kinds", "rmkill", "--no-learner-kill", "--no-replay-kill"),
        *("--settle-s", "60", f"trainer.cache_dir={tmp_path / 'cache'}"),
        *("trainer.warmstart_steps=50", "data.train_batch_size=4", "rollout.n=4"),
        *(f"reward.model.path={random_reward_model}", "reward.num_servers=2"),
        *("reward.model.resend_s=2", "reward.model.timeout_s=30"),
        "launch.restart_backoff_s=0.5",  # the last kill's restart comes before the stop
        *("launch.progress=none", f"trainer.run_dir={run_dir}"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    audit = json.loads((run_dir / "audit.json").read_text())
    checks = {c["name"]: c for c in audit["checks"]}
    assert audit["ok"] and checks["reward_models"]["ok"], checks
    counts = audit["counts"]
    assert counts["rows_lost"] == counts["rows_duplicated"] == counts["groups_partial"] == 0
    kills = [f for f in read_jsonl(run_dir / "chaos.jsonl") if f["kind"] == "sigkill"]
    assert len(kills) >= 3 and all(f["target"].startswith("reward_model_") for f in kills)
    restarts = [r for r in read_jsonl(run_dir / "restarts.jsonl") if r["event"] == "restart"]
    assert len(restarts) >= len(kills)
    server = json.loads((run_dir / "stats" / "server_0.json").read_text())
    assert server["reward_model_items"] == server["reward_model_settled"] > 0
    # a server still loading when the run stops ends before it can write its counters
    for path in (run_dir / "stats").glob("reward_model_*.json"):
        stats = json.loads(path.read_text())
        assert stats["rejected_unauthenticated"] == 0 and stats["handler_errors"] == 0
