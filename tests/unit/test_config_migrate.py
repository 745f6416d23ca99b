"""A run directory written before the algorithm keys became typed variants keeps its flat
algorithm block in config.yaml (a full dump): `asyncrl launch --resume RUN` and `asyncrl eval
--run-dir RUN` migrate it into the variants the old learner ran (`asyncrl.config.migrate`),
while a user's config or override that spells an old key is still refused naming the new one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from asyncrl.checkpoints import PARTS, TRAINER_FILE
from asyncrl.config import ConfigError, config_to_yaml, load_config
from asyncrl.config.migrate import migrate_algorithm
from asyncrl.launch.eval_weights import run_eval_config
from asyncrl.launch.resume import changed_keys, resume_config

OLD_ALGORITHM = """\
algorithm:
  adv_estimator: grpo
  norm_adv_by_std: true
  gamma: 1.0
  lam: 1.0
  policy_loss: ppo
  clip_ratio_low: 0.2
  clip_ratio_high: 0.2
  clip_ratio_c: 3.0
  loss_agg_mode: token-mean
  decoupled: false
  is_level: 'off'
  is_cap: 2.0
  is_batch_normalize: false
  reject_level: 'off'
  reject_metric: ratio
  reject_agg: mean
  reject_low: null
  reject_high: null
  use_kl_in_reward: false
  kl_penalty: kl
  kl_ctrl: fixed
  kl_coef: 0.001
  kl_target: 0.1
  kl_horizon: 10000
  use_kl_loss: false
  kl_loss_coef: 0.001
  kl_loss_type: low_var_kl
  entropy_coeff: 0.0
  value_clip: 0.5
"""
"""The algorithm block of `asyncrl launch --dry-run` at 3469acd, the last commit before the
variants (every other section of that dump is as today's)."""

TIS_REJECT_KL = {
    "decoupled": "true",
    "is_level": "sequence",
    "is_cap": "5.0",
    "is_batch_normalize": "true",
    "reject_level": "token",
    "reject_metric": "k3",
    "reject_high": "0.5",
    "use_kl_in_reward": "true",
    "kl_ctrl": "adaptive",
    "kl_coef": "0.01",
    "kl_target": "0.2",
    "use_kl_loss": "true",
    "kl_loss_coef": "0.05",
    "kl_loss_type": "k3",
    "clip_ratio_high": "0.28",
}
"""An old truncated_is + token rejection + adaptive KL in the reward + KL loss run."""


def _old_run(tmp_path: Path, **values: str) -> Path:
    """A run directory as 3469acd left it: config.yaml with the flat algorithm block (`values`
    replacing its defaults) and a complete checkpoint at step 2."""
    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"trainer.run_dir={run_dir}", "trainer.total_steps=6"])
    tree = yaml.safe_load(config_to_yaml(cfg))
    block = OLD_ALGORITHM
    for key, value in values.items():
        block = block.replace(f"\n  {key}: ", f"\n  {key}: {value} # ", 1)
    tree["algorithm"] = yaml.safe_load(block)["algorithm"]
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("# asyncrl launch\n" + yaml.safe_dump(tree))
    checkpoint = run_dir / "checkpoints" / "step_2"
    for part in PARTS:
        (checkpoint / part).parent.mkdir(parents=True, exist_ok=True)
        (checkpoint / part).write_text("x")
    (checkpoint / TRAINER_FILE).write_text(json.dumps({"version": 2, "kl_coef": 0.0}))
    return run_dir


def test_the_default_old_dump_migrates_to_the_defaults(tmp_path, capsys):
    run_dir = _old_run(tmp_path)
    cfg = resume_config(run_dir)
    assert cfg.algorithm == load_config().algorithm
    assert "flat algorithm keys were migrated" in capsys.readouterr().err
    assert changed_keys(run_dir / "config.yaml", cfg) == {}


def test_an_old_truncated_is_rejection_kl_run_keeps_its_algorithm(tmp_path):
    run_dir = _old_run(tmp_path, **TIS_REJECT_KL)
    algo = resume_config(run_dir, ["trainer.total_steps=9"]).algorithm
    assert algo.model_dump(mode="json", include={"policy_loss", "correction"}) == {
        "policy_loss": {
            "type": "ppo",
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "clip_ratio_c": 3.0,
        },
        "correction": {
            "type": "truncated_is",
            "level": "sequence",
            "cap": 5.0,
            "batch_normalize": True,
        },
    }
    assert algo.rejection.model_dump() == {
        "type": "token",
        "metric": "k3",
        "low": None,
        "high": 0.5,
    }
    assert algo.kl_in_reward.model_dump() == {
        "type": "adaptive",
        "coef": 0.01,
        "estimator": "kl",
        "target": 0.2,
        "horizon": 10000,
    }
    assert algo.kl_loss.model_dump() == {"type": "reference", "coef": 0.05, "estimator": "k3"}
    cfg, _ = run_eval_config(str(run_dir), None, [], "job")
    assert cfg.algorithm == algo


@pytest.mark.parametrize(
    ("values", "correction"),
    [
        ({}, {"type": "none"}),
        ({"decoupled": "true"}, {"type": "decoupled"}),
        (
            {"decoupled": "true", "is_level": "token"},
            {"type": "truncated_is", "level": "token", "cap": 2.0, "batch_normalize": False},
        ),
    ],
)
def test_the_correction_is_the_one_the_old_flags_ran(values, correction):
    tree = yaml.safe_load(OLD_ALGORITHM)
    tree["algorithm"].update({key: yaml.safe_load(value) for key, value in values.items()})
    assert migrate_algorithm(tree)
    assert tree["algorithm"]["correction"] == correction
    assert not migrate_algorithm(tree)  # the new spelling is left as it is


def test_a_rejection_without_bounds_rejected_nothing():
    tree = yaml.safe_load(OLD_ALGORITHM)
    tree["algorithm"]["reject_level"] = "sequence"
    migrate_algorithm(tree)
    assert tree["algorithm"]["rejection"] == {"type": "none"}


def test_a_gspo_run_drops_the_clip_it_never_read(tmp_path):
    run_dir = _old_run(tmp_path, policy_loss="gspo", clip_ratio_c="5.0")
    assert resume_config(run_dir).algorithm.policy_loss.model_dump() == {
        "type": "gspo",
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
    }


def test_a_users_config_with_old_keys_is_still_refused(tmp_path):
    run_dir = _old_run(tmp_path)
    with pytest.raises(ConfigError, match="algorithm.decoupled was renamed: use "):
        load_config(run_dir / "config.yaml")
    with pytest.raises(ConfigError, match="algorithm.use_kl_loss was renamed"):
        resume_config(run_dir, ["algorithm.use_kl_loss=true"])


@pytest.mark.parametrize(
    "override", ["algorithm.policy_loss.type=gspo", "algorithm.policy_loss=gspo"]
)
def test_a_resume_switches_the_loss_of_a_full_dump(tmp_path, override):
    """`--resume RUN algorithm.policy_loss.type=gspo`: the dump's ppo default clip_ratio_c is
    dropped, its clip_ratio_high kept."""
    run_dir = _old_run(tmp_path, clip_ratio_high="0.28")
    assert resume_config(run_dir, [override]).algorithm.policy_loss.model_dump() == {
        "type": "gspo",
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
    }
    with pytest.raises(ConfigError, match="clip_ratio_c=5.0 is not a field of"):
        resume_config(run_dir, ["algorithm.policy_loss.clip_ratio_c=5.0", override])
