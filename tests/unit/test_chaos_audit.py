"""The run audit of tools/chaos.py (asyncrl.analysis.audit) on run directories written here:
it passes a clean record set (and a clean resume), and each violation fails the check made for
it: a row trained twice, a row skipped, a trajectory trained twice, a partial group, a version
going down, a resume onto other weights, a server holding weights the learner never sent, a
sample past the staleness bound."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_trajectories import one_token_trajectory

from asyncrl.analysis.audit import audit_run, row_of
from asyncrl.checkpoints import REPLAY_FILE, SHARDS_DONE, TRAINER_FILE
from asyncrl.wire.protocol import PromptItem
from replay.buffer import SavedGroup
from replay.checkpoint import ReplayState, write_state

ROOT = Path(__file__).resolve().parents[2]
N = 2  # samples per group; 2 groups per step


def _gid(row: int, suffix: str = "a") -> str:
    return f"{row}-{suffix * 8}"


def _item(gid: str) -> PromptItem:
    return PromptItem(gid, N, "asyncrl/arith", [{"role": "user", "content": "1+1"}], "2", {})


def _jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _checkpoint(
    run: Path, version: int, drawn: int, ready: list[str], reissue: list[str], given_up: int = 0
) -> None:
    ckpt = run / "checkpoints" / f"step_{version}"
    (ckpt / SHARDS_DONE).parent.mkdir(parents=True)
    (ckpt / SHARDS_DONE).write_bytes(b"")
    (ckpt / TRAINER_FILE).write_text(json.dumps({"version": version}))
    groups = [
        SavedGroup(_item(g), version, 0, [one_token_trajectory(g, i) for i in range(N)], [0.1])
        for g in ready
    ]
    state = ReplayState(
        version=version,
        rows_drawn=drawn,
        prompt_source={"drawn": drawn},
        reissue=[_item(g) for g in reissue],
        ready=groups,
        seen_ids=[],
        counters={"stale_dropped": 0, "rows_given_up": given_up},
    )
    write_state(ckpt / REPLAY_FILE, state)


# the clean record set: 4 steps of 2 groups; at step 2 row 4 is ready and row 5 in flight (it is
# re-issued under another suffix and trained at step 3); at step 4 row 8 is ready
STEPS = {
    1: [_gid(0), _gid(1)],
    2: [_gid(2), _gid(3)],
    3: [_gid(4), _gid(5, "b")],
    4: [_gid(6), _gid(7)],
}


def write_run(run: Path, steps: dict[int, list[str]] | None = None, trajs=None) -> Path:
    """A run directory whose records say what `steps` (step -> group ids trained) says."""
    steps = STEPS if steps is None else steps
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text("rollout:\n  n: 2\nreplay:\n  max_staleness: 1\n")
    samples = []
    for step, groups in steps.items():
        ids = [f"{g}/{i}" for g in groups for i in range(N)]
        ids = trajs(step, ids) if trajs else ids
        samples.append(
            {"step": step, "learner_version": step - 1, "traj_ids": ids, "group_ids": groups}
            | {"oldest_versions": [step - 1] * len(ids)}
        )
    _jsonl(run / "samples.jsonl", samples)
    _jsonl(
        run / "metrics.jsonl",
        [
            {"step": s, "version": s, "time": 100.0 + 2 * s, "samples": 4, "reward_mean": 0.1 * s}
            for s in steps
        ],
    )
    weights = [{"version": v, "checksum": f"c{v}"} for v in range(len(steps) + 1)]
    _jsonl(run / "weights_learner.jsonl", weights)
    _jsonl(run / "weights_server_0.jsonl", weights)
    _checkpoint(run, 2, drawn=6, ready=[_gid(4)], reissue=[_gid(5)])
    _checkpoint(run, 4, drawn=9, ready=[_gid(8)], reissue=[])
    return run


def _failed(run: Path) -> list[str]:
    return audit_run(run).failed()


def test_row_of_reads_the_draw_index():
    assert row_of("12-3fa4b2c1") == 12


def test_a_clean_record_set_passes(tmp_path):
    audit = audit_run(write_run(tmp_path / "run"))
    assert audit.ok, audit.table()
    c = audit.counts
    assert (c["steps"], c["rows_trained"], c["rows_lost"], c["rows_duplicated"]) == (4, 8, 0, 0)
    assert c["groups_partial"] == 0 and c["checkpoints_audited"] == 2
    assert c["samples_per_s"] == pytest.approx(12 / 6)  # steps 2..4 over 6 s
    assert c["reward_rise"] == pytest.approx(0.4 - 0.1)  # last step's minus the first's
    assert "PASS" in audit.table()


LAYOUTS = ("one_history", "restart_rewound", "restart_kept")
"""How a resume may leave the learner's weight log: the resumed learner writes the checkpoint's
version again after the rewind dropped it (`one_history`, with resumes.jsonl naming the step),
or first logs version 0 again, the rewind having dropped the checkpoint's record or not."""


def _resumed(run: Path, layout: str, resumed_checksum: str = "c2") -> None:
    """The weight logs of a learner killed after step 3 and resumed from step_2, the whole run
    restarted. The servers' logs are timelines: the dead start's process (0..3, its 3 never
    trained on), then the new one."""
    dead = [{"version": v, "checksum": f"c{v}"} for v in (0, 1, 2, 3)]
    after = [{"version": 2, "checksum": resumed_checksum}]
    after += [{"version": 3, "checksum": "c3-again"}, {"version": 4, "checksum": "c4"}]
    learner = {
        "one_history": dead[:2] + after,
        "restart_rewound": dead[:2] + [dead[0]] + after,
        "restart_kept": dead[:3] + [dead[0]] + after,
    }[layout]
    _jsonl(run / "weights_learner.jsonl", learner)
    _jsonl(run / "weights_server_0.jsonl", dead + [dead[0]] + after)
    _jsonl(run / "resumes.jsonl", [{"failed": "learner_0", "step": 2}])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_resume_from_a_checkpoint_passes(tmp_path, layout):
    run = write_run(tmp_path / "run")
    _resumed(run, layout)
    audit = audit_run(run)
    assert audit.ok, audit.table()
    assert audit.counts["server_starts"] == 2 and audit.counts["resumes_lines"] == 1


def test_a_dead_servers_versions_without_a_resume_fail(tmp_path):
    """The same logs with no resume recorded: the dead start's server weights are unexplained."""
    run = write_run(tmp_path / "run")
    _resumed(run, "one_history")
    (run / "resumes.jsonl").unlink()
    assert _failed(run) == ["server_weights"]


@pytest.mark.parametrize(
    ("layout", "failed"),
    [
        ("one_history", ["server_weights"]),
        ("restart_rewound", ["server_weights"]),
        ("restart_kept", ["learner_versions_up"]),
    ],
)
def test_a_resume_onto_other_weights_fails(tmp_path, layout, failed):
    """Where the dead start's record of 2 is rewound, the dead server's record of 2 is the
    witness; where it is kept, the learner's own."""
    run = write_run(tmp_path / "run")
    _resumed(run, layout, resumed_checksum="not-the-checkpoint")
    assert _failed(run) == failed


def test_a_resume_past_the_versions_reached_fails(tmp_path):
    run = write_run(tmp_path / "run")
    versions = (0, 1, 0, 3, 4)
    _jsonl(run / "weights_learner.jsonl", [{"version": v, "checksum": f"c{v}"} for v in versions])
    assert _failed(run) == ["learner_versions_up"]


def test_a_row_trained_twice_fails(tmp_path):
    steps = dict(STEPS) | {4: [_gid(6), _gid(1, "c")]}  # row 1 again, under a new lease
    failed = _failed(write_run(tmp_path / "run", steps))
    assert "rows_once" in failed and "rows_accounted" in failed


def test_a_skipped_row_fails(tmp_path):
    run = write_run(tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step_4")
    _checkpoint(run, 4, drawn=10, ready=[_gid(8)], reissue=[])  # row 9 drawn, nowhere now
    audit = audit_run(run)
    assert audit.failed() == ["rows_accounted"]
    assert audit.counts["rows_lost"] == 1


def test_a_row_given_up_is_accounted_for_and_no_more(tmp_path):
    """A row no server could sample (`replay.max_group_failures`) is counted given up by the
    replay: it is not lost, but it excuses one missing row only."""
    run = write_run(tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step_4")
    _checkpoint(run, 4, drawn=10, ready=[_gid(8)], reissue=[], given_up=1)
    assert audit_run(run).ok
    shutil.rmtree(run / "checkpoints" / "step_4")
    _checkpoint(run, 4, drawn=11, ready=[_gid(8)], reissue=[], given_up=1)
    assert _failed(run) == ["rows_accounted"] and audit_run(run).counts["rows_lost"] == 1


def test_a_trajectory_trained_twice_fails(tmp_path):
    def reuse(step, ids):
        return ["0-aaaaaaaa/0", *ids[1:]] if step == 3 else ids

    assert _failed(write_run(tmp_path / "run", trajs=reuse)) == ["trajectories_once"]


def test_a_partial_group_fails(tmp_path):
    def drop_one(step, ids):
        return ids[:-1] if step == 3 else ids

    run = write_run(tmp_path / "run", trajs=drop_one)
    audit = audit_run(run)
    assert audit.failed() == ["whole_groups"] and audit.counts["groups_partial"] == 1


def test_a_group_split_over_two_steps_fails(tmp_path):
    steps = dict(STEPS) | {4: [_gid(6), _gid(5, "b")]}
    assert "whole_groups" in _failed(write_run(tmp_path / "run", steps))


def test_a_step_going_down_fails(tmp_path):
    run = write_run(tmp_path / "run")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    metrics[3] |= {"step": 2, "version": 2}  # a resume that did not rewind metrics.jsonl
    _jsonl(run / "metrics.jsonl", metrics)
    assert _failed(run) == ["steps_up"]


def test_a_learner_version_going_down_fails(tmp_path):
    run = write_run(tmp_path / "run")
    versions = (0, 1, 2, 1, 3, 4)
    _jsonl(run / "weights_learner.jsonl", [{"version": v, "checksum": f"c{v}"} for v in versions])
    assert _failed(run) == ["learner_versions_up"]


def test_a_server_with_weights_the_learner_never_sent_fails(tmp_path):
    run = write_run(tmp_path / "run")
    weights = [{"version": v, "checksum": f"c{v}"} for v in range(5)]
    weights[3]["checksum"] = "corrupt"
    _jsonl(run / "weights_server_0.jsonl", weights)
    assert _failed(run) == ["server_weights"]


def test_a_server_version_going_down_within_a_process_fails(tmp_path):
    run = write_run(tmp_path / "run")
    weights = [{"version": v, "checksum": f"c{v}"} for v in (0, 2, 1, 0, 3)]  # 0: a restart
    _jsonl(run / "weights_server_0.jsonl", weights)
    assert _failed(run) == ["server_weights"]


def test_a_sample_past_the_staleness_bound_fails(tmp_path):
    run = write_run(tmp_path / "run")
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    samples[3]["oldest_versions"][0] = 1  # learner version 3, bound 1
    _jsonl(run / "samples.jsonl", samples)
    assert _failed(run) == ["staleness"]


def test_missing_records_fail(tmp_path):
    run = tmp_path / "empty"
    run.mkdir()
    assert {"samples_logged", "weights_logged"} <= set(_failed(run))


# ---- the fault injector of tools/chaos.py -----------------------------------------------------------
@pytest.fixture(scope="module")
def chaos():
    """tools/chaos.py, imported as a module."""
    spec = importlib.util.spec_from_file_location("chaos", ROOT / "tools" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["chaos"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["chaos"]


def test_the_plan_takes_the_kinds_in_turn_and_kills_learner_and_replay_once(chaos):
    plan = chaos.Plan(
        window_s=300, every_s=60, kinds=["kill", "stop"], learner_kill=True, replay_kill=True
    )
    assert plan.events() == [
        (60, "kill"),
        (100, "learner"),
        (120, "stop"),
        (180, "kill"),
        (200, "replay"),
        (240, "stop"),
    ]
    quiet = chaos.Plan(300, 0, ["kill"], learner_kill=False, replay_kill=False)
    assert quiet.events() == []


def test_fleet_members_are_found_by_their_environment(chaos, tmp_path):
    """A member and its child (a reward worker) carry the same variables; the member is the
    target. Processes of another run directory are not this run's."""
    env = os.environ | {"ASYNCRL_PROCESS": "server_3", "ASYNCRL_RUN_DIR": str(tmp_path)}
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    member = subprocess.Popen([sys.executable, "-c", child], env=env)
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env=env | {"ASYNCRL_RUN_DIR": str(tmp_path / "other")},
    )
    try:
        deadline = time.monotonic() + 20
        while len(chaos.fleet_members(tmp_path)) == 0 or _children(member.pid) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        found = chaos.fleet_members(tmp_path)
        assert list(found) == ["server_3"] and found["server_3"].pid == member.pid
        assert chaos.still_same(found["server_3"])
    finally:
        for p in (member, other):
            p.kill()
            p.wait()
    assert not chaos.still_same(found["server_3"])


def _children(pid: int) -> int:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return len(path.read_text().split()) if path.exists() else 0
