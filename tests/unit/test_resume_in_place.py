"""A resume by hand continues its own run directory (`asyncrl.launch.resume`): `resume_config`
builds the config from the run's config.yaml with the overrides on top, `resume_in_place`
rewinds the records to the checkpoint, sets newer checkpoints aside and records the resume, and
the CLI takes `--resume RUN_DIR` or `trainer.resume_from=RUN_DIR`. Checkpoints here are fakes
(only their parts' names and trainer.json matter); the real processes, killed and resumed, are
in tests/integration/test_resume_in_place_runs.py."""

import json
from pathlib import Path

import pytest
import yaml

from asyncrl.checkpoints import PARTS, TRAINER_FILE, complete_checkpoints
from asyncrl.config import ConfigError, load_config
from asyncrl.launch.cli import main
from asyncrl.launch.fleet import prepare_run_dir
from asyncrl.launch.resume import resume_config, resume_in_place
from asyncrl.launch.rewind import RESUMES_FILE
from asyncrl.metrics import read_jsonl


def _checkpoint(run_dir: Path, step: int, partial: bool = False) -> Path:
    path = run_dir / "checkpoints" / f"step_{step}{'.partial' if partial else ''}"
    for part in PARTS:
        (path / part).parent.mkdir(parents=True, exist_ok=True)
        (path / part).write_text("x")
    (path / TRAINER_FILE).write_text(json.dumps({"version": step, "kl_coef": 0.0}))
    return path


def _run(tmp_path: Path, *overrides: str, last_step: int = 5) -> Path:
    """A run directory as a launch killed after step `last_step` leaves it: config.yaml (with
    save_every=2 and the overrides), checkpoints 2 and 4, records to `last_step`, a torn line."""
    run_dir = tmp_path / "run"
    cfg = load_config(
        overrides=[
            f"trainer.run_dir={run_dir}",
            "trainer.total_steps=6",
            "trainer.save_every=2",
            "trainer.val_before_train=true",
            *overrides,
        ]
    )
    prepare_run_dir(cfg, "asyncrl launch trainer.save_every=2")
    for step in range(2, last_step + 1, 2):
        _checkpoint(run_dir, step)
    with (run_dir / "metrics.jsonl").open("w") as f:
        f.write(json.dumps({"step": 0, "val/mean_score": 0.1}) + "\n")
        f.writelines(
            json.dumps({"step": s, "reward_mean": 0.5}) + "\n" for s in range(1, last_step + 1)
        )
        f.write('{"step": 6, "rew')
    with (run_dir / "samples.jsonl").open("w") as f:
        f.writelines(json.dumps({"step": s}) + "\n" for s in range(1, last_step + 1))
    return run_dir


def _steps(run_dir: Path, name: str = "metrics.jsonl") -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir / name)]


def test_resume_config_is_the_runs_own_with_the_overrides_on_top(tmp_path):
    run_dir = _run(tmp_path, "learner.lr=3e-4")
    cfg = resume_config(run_dir, ["trainer.total_steps=9", "rollout.n=2"])
    tc = cfg.trainer
    assert tc.resume_from == str((run_dir / "checkpoints" / "step_4").resolve())
    assert (tc.run_dir, tc.val_before_train) == (str(run_dir), False)
    assert (tc.save_every, cfg.learner.lr) == (2, 3e-4)  # the run's own, not typed again
    assert (tc.total_steps, cfg.rollout.n) == (9, 2)  # the overrides, on top


def test_an_older_checkpoint_of_the_run_can_be_named(tmp_path):
    run_dir = _run(tmp_path)
    step_2 = run_dir / "checkpoints" / "step_2"
    cfg = resume_config(run_dir, [f"trainer.resume_from={step_2}"])
    assert cfg.trainer.resume_from == str(step_2.resolve())


@pytest.mark.parametrize(
    ("make", "overrides", "message"),
    [
        (lambda t: t / "nowhere", lambda t: [], "it does not exist, so it is not a run directory"),
        (
            lambda t: _checkpoint(t, 2).parent,
            lambda t: [],
            "has no config.yaml, so it is not a run",
        ),
        (lambda t: _checkpoint(t, 2), lambda t: [], "it is a checkpoint, not a run directory"),
        (_run, lambda t: ["trainer.run_dir=elsewhere"], "continues in its own directory"),
        (
            _run,
            lambda t: [f"trainer.resume_from={_checkpoint(t / 'other', 2)}"],
            "a resume in place continues from one of",
        ),
        (lambda t: _run(t, last_step=6), lambda t: [], "is complete: its checkpoint step_6 is "),
    ],
)
def test_what_cannot_be_resumed_is_refused_by_name(tmp_path, make, overrides, message):
    run_dir = make(tmp_path)
    with pytest.raises(ConfigError, match=message):
        resume_config(run_dir, overrides(tmp_path))


def test_a_run_without_checkpoints_says_what_save_every_gave(tmp_path):
    never = _run(tmp_path / "a", "trainer.save_every=0", last_step=1)
    with pytest.raises(ConfigError) as raised:
        resume_config(never, [])
    assert str(raised.value) == (
        f"cannot resume {never}: it has no complete checkpoint under {never / 'checkpoints'}; "
        "its config.yaml has trainer.save_every=0 and no interrupt wrote one (Ctrl-C and "
        "SIGTERM do once a step is taken, unless trainer.checkpoint_on_interrupt=false; a crash "
        "or a kill does not): run it again with trainer.save_every=N to checkpoint every N steps"
    )
    early = _run(tmp_path / "b", "trainer.save_every=4", last_step=1)
    _checkpoint(early, 4, partial=True)
    with pytest.raises(ConfigError) as raised:
        resume_config(early, [])
    assert str(raised.value).endswith(
        "with trainer.save_every=4 the first is written after step 4, and the run recorded 1 "
        "step(s); step_4.partial never finished (never resumed from)"
    )


def test_resuming_from_an_own_checkpoint_rewinds_the_run_and_records_it(tmp_path):
    """The case of issue 29: resume_from=RUN/checkpoints/step_2 trainer.run_dir=RUN, typed
    out, appended steps 3-5 a second time; now they are taken back and the newer checkpoint
    set aside, so the run reads as one and a later resume cannot pick up the abandoned step 4."""
    run_dir = _run(tmp_path)
    step_2 = run_dir / "checkpoints" / "step_2"
    cfg = load_config(
        run_dir / "config.yaml",
        [f"trainer.run_dir={run_dir}", f"trainer.resume_from={step_2}", "learner.lr=1e-5"],
    )
    lines: list[str] = []
    resumed = resume_in_place(cfg, "asyncrl launch x=1", lines.append)

    assert _steps(run_dir) == [0, 1, 2] and _steps(run_dir, "samples.jsonl") == [1, 2]
    assert complete_checkpoints(run_dir) == [step_2]
    [aside] = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("set_aside")]
    assert [p.name for p in aside.iterdir()] == ["step_4"]
    assert resumed.trainer.val_before_train is False  # the step-0 record is there already
    [record] = read_jsonl(run_dir / RESUMES_FILE)
    assert record["by"] == "command" and record["command"] == "asyncrl launch x=1"
    assert (record["checkpoint"], record["step"]) == (str(step_2.resolve()), 2)
    assert record["changed"] == {"learner.lr": {"was": 5e-4, "now": 1e-5}}
    assert record["rewound"] == {"metrics.jsonl": 4, "samples.jsonl": 3}
    assert record["set_aside"] == [str(aside / "step_4")]
    # the rewound lines are kept beside the records, not deleted (the torn line too)
    [kept] = (run_dir / "rewound").glob("*-metrics.jsonl")
    assert [json.loads(line)["step"] for line in kept.read_text().splitlines()[:3]] == [3, 4, 5]
    [kept] = (run_dir / "rewound").glob("*-samples.jsonl")
    assert kept.read_text().count("\n") == 3
    assert lines == [
        f"asyncrl: resuming {run_dir} in place from step_2 (step 2 of 6); records past step 2 "
        "rewound (metrics.jsonl: 4 lines, samples.jsonl: 3 lines)",
        "asyncrl: on top of its config.yaml: learner.lr=1e-05 (was 0.0005)",
        f"asyncrl: newer checkpoints set aside (never resumed from): {aside}",
    ]


def test_a_launch_that_is_not_a_resume_in_place_touches_nothing(tmp_path):
    run_dir = _run(tmp_path)
    before = (run_dir / "metrics.jsonl").read_text()
    elsewhere = tmp_path / "new_run"
    for overrides in (
        [f"trainer.run_dir={elsewhere}"],  # a fresh run
        [f"trainer.run_dir={run_dir}"],  # not a resume: nothing to rewind to
        [f"trainer.run_dir={elsewhere}", f"trainer.resume_from={run_dir}/checkpoints/step_4"],
    ):
        cfg = load_config(overrides=overrides)
        assert resume_in_place(cfg, "asyncrl launch", pytest.fail) is cfg
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert not (run_dir / RESUMES_FILE).exists() and not elsewhere.exists()


def test_a_run_started_from_another_runs_checkpoint_resumes_from_it_in_place(tmp_path):
    """Run b started from run a's step 2 and died at step 4 before writing a checkpoint of its
    own: a resume of b goes back to a's step 2 (the restart point) and rewinds b's records,
    leaving run a as it was."""
    a = _run(tmp_path / "a")
    a_metrics = (a / "metrics.jsonl").read_text()
    b = tmp_path / "b"
    started = load_config(
        overrides=[f"trainer.run_dir={b}", f"trainer.resume_from={a / 'checkpoints' / 'step_2'}"]
    )
    prepare_run_dir(started, "asyncrl launch")
    (b / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in (3, 4)))

    cfg = resume_config(b)
    assert cfg.trainer.resume_from == str((a / "checkpoints" / "step_2").resolve())
    named = resume_config(b, [f"trainer.resume_from={a / 'checkpoints' / 'step_2'}"])
    assert named.trainer.resume_from == cfg.trainer.resume_from  # what config.yaml's command says
    with pytest.raises(ConfigError, match="or the checkpoint the run started from"):
        resume_config(b, [f"trainer.resume_from={a / 'checkpoints' / 'step_4'}"])
    resume_in_place(cfg, "asyncrl launch --resume b", lambda line: None)
    assert _steps(b) == []
    assert (a / "metrics.jsonl").read_text() == a_metrics
    assert [p.name for p in complete_checkpoints(a)] == ["step_2", "step_4"]


@pytest.mark.parametrize("form", ["--resume", "trainer.resume_from="])
def test_the_cli_resumes_a_run_directory_either_way(tmp_path, capsys, form):
    run_dir = _run(tmp_path)
    asked = ["--resume", str(run_dir)] if form == "--resume" else [f"{form}{run_dir}"]
    assert main(["launch", *asked, "trainer.total_steps=8", "--dry-run"]) == 0
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert trainer["resume_from"] == str((run_dir / "checkpoints" / "step_4").resolve())
    assert (trainer["run_dir"], trainer["total_steps"], trainer["save_every"]) == (
        str(run_dir),
        8,
        2,
    )


def test_the_cli_refuses_a_config_file_with_a_resume(tmp_path, capsys):
    run_dir = _run(tmp_path)
    assert main(["launch", "--resume", str(run_dir), "configs/default.yaml", "--dry-run"]) == 2
    assert "runs with its own config.yaml: give overrides only" in capsys.readouterr().err


def test_a_fresh_start_into_another_runs_directory_is_refused_and_touches_nothing(tmp_path):
    """Resuming run a's checkpoint with trainer.run_dir naming run x, which did not start from
    it, would rewind x's records to another lineage: refused, x left as it was."""
    a = _run(tmp_path / "a")
    x = _run(tmp_path / "x")
    before = (x / "metrics.jsonl").read_text()
    cfg = load_config(
        overrides=[f"trainer.run_dir={x}", f"trainer.resume_from={a / 'checkpoints' / 'step_2'}"]
    )
    with pytest.raises(ConfigError, match="holds another run"):
        resume_in_place(cfg, "asyncrl launch", pytest.fail)
    assert (x / "metrics.jsonl").read_text() == before
    assert [p.name for p in complete_checkpoints(x)] == ["step_2", "step_4"]
