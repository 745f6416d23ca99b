"""tools/chaos.py on the embedded default, two rollout servers, 30 s from the first step: it
freezes a server every 6 s (SIGSTOP, SIGCONT 3 s later, the same process), logs every fault, the
run goes on to its deadline, and the audit of the run's own records passes (every row once, whole groups,
versions only up, the servers holding the learner's weights).

With `kills` (marked slow: about 3 minutes here) the servers are SIGKILLed too, the learner and
the replay are killed once each, and the same audit must pass: the launcher restarts a dead
rollout server (`launch.max_restarts`) and resumes the run from its checkpoint after a learner
or replay death (`trainer.auto_resume`).

On the default config (one rollout server, the user-path rule of tests/README.md) its only
server is SIGKILLed and SIGSTOPped in turn, and every kill must heal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.metrics import read_jsonl

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "kills",
    [pytest.param(False, marks=pytest.mark.long), pytest.param(True, marks=pytest.mark.slow)],
)
def test_chaos_run_passes_its_audit(tmp_path, kills):
    run_dir = tmp_path / "run"
    faults = ["--kinds", "kill,stop"] if kills else ["--kinds", "stop"]
    if not kills:
        faults += ["--no-learner-kill", "--no-replay-kill"]
    minutes = "1.5" if kills else "0.5"
    cmd = [
        *(sys.executable, str(ROOT / "tools" / "chaos.py"), "--minutes", minutes),
        *("--every", "6", "--stop-s", "3", "--settle-s", "60", *faults),
        *(f"trainer.cache_dir={tmp_path / 'cache'}", "trainer.warmstart_steps=50"),
        *("data.train_batch_size=4", "rollout.n=4", "rollout.num_servers=2"),
        *("launch.progress=none", "launch.server_timeout_s=10", f"trainer.run_dir={run_dir}"),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    audit = json.loads((run_dir / "audit.json").read_text())
    assert audit["ok"] and all(c["ok"] for c in audit["checks"])
    counts = audit["counts"]
    assert counts["steps"] >= 5 and counts["checkpoints_audited"] >= 1
    assert counts["rows_lost"] == counts["rows_duplicated"] == counts["groups_partial"] == 0

    faults = read_jsonl(run_dir / "chaos.jsonl")
    stops = [f for f in faults if f["kind"] == "sigstop"]
    conts = [f for f in faults if f["kind"] == "sigcont"]
    assert stops, "no server was frozen"
    assert [(f["target"], f["pid"]) for f in conts] == [(f["target"], f["pid"]) for f in stops]
    # each "t" is rounded to 0.01 s, and 13.01 - 10.01 < 3 in floating point: compare the
    # freeze's length in hundredths
    held = [round(100 * (c["t"] - s["t"])) for s, c in zip(stops, conts, strict=True)]
    assert min(held) >= 300, held
    assert "sigstop" in proc.stdout  # each fault is printed as well
    if kills:
        kinds = {(f["kind"], f["target"].split("_")[0]) for f in faults}
        assert {("sigkill", "server"), ("sigkill", "learner"), ("sigkill", "replay")} <= kinds


@pytest.mark.long
def test_chaos_on_the_default_config_heals_every_kill_of_its_one_server(tmp_path, model_cache):
    """The user-path rule (tests/README.md): the default config as shipped, one rollout server,
    chaos run from a working directory of the test's own (`runs/chaos-{time}` under it), the
    server SIGKILLed and SIGSTOPped in turn. Every kill must heal: the restart rejoins the
    weight sync while the learner waits for a batch no other server could make (issue 40: it
    waited an hour), so training goes on after each kill and the audit passes."""
    cmd = [
        *(sys.executable, str(ROOT / "tools" / "chaos.py"), "--minutes", "1"),
        *("--every", "12", "--stop-s", "3", "--settle-s", "60", "--kinds", "kill,stop"),
        *("--no-learner-kill", "--no-replay-kill"),
        *(f"trainer.cache_dir={model_cache}", "launch.progress=none"),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    (run_dir,) = (tmp_path / "runs").glob("chaos-*")
    audit = json.loads((run_dir / "audit.json").read_text())
    assert audit["ok"] and all(c["ok"] for c in audit["checks"])
    kills = [f for f in read_jsonl(run_dir / "chaos.jsonl") if f["kind"] == "sigkill"]
    assert len(kills) == 2 and {f["target"] for f in kills} == {"server_0"}
    restarts = [r for r in read_jsonl(run_dir / "restarts.jsonl") if r["event"] == "restart"]
    assert len(restarts) == len(kills)
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert any(r["time"] > kills[-1]["time"] + 1 for r in steps), "no step after the last kill"
