"""`asyncrl.run`: a config from Python is validated before anything starts, overrides apply on
top without changing the caller's config. (That a run through it learns the embedded task:
tests/integration/test_pipeline.py, the bf16 default.)"""

from __future__ import annotations

import pydantic
import pytest

import asyncrl
from asyncrl.config import Config, ConfigError, apply_overrides, load_config


def test_overrides_apply_on_a_copy_and_are_validated():
    cfg = load_config()
    new = apply_overrides(cfg, ["rollout.n=3", "replay.max_staleness=0"])
    assert (new.rollout.n, new.replay.max_staleness) == (3, 0)
    assert cfg.rollout.n == 8  # the caller's config is untouched
    with pytest.raises(ConfigError, match="did you mean replay.max_staleness"):
        apply_overrides(cfg, ["replay.max_stalness=0"])


def test_a_bad_run_fails_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="rollout.n"):
        asyncrl.run(Config(), ["rollout.n=0"])
    with pytest.raises(ConfigError, match="does not exist"):
        asyncrl.run(tmp_path / "missing.yaml")
    cfg = load_config()
    with pytest.raises(pydantic.ValidationError):
        cfg.rollout.n = -1  # assignments are validated too


def test_resume_from_python_is_checked_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="not a run directory"):
        asyncrl.run(resume=tmp_path)
    with pytest.raises(ConfigError, match="its own config"):
        asyncrl.run(load_config(), resume=tmp_path)
    (tmp_path / "config.yaml").write_text("{}\n")
    with pytest.raises(ConfigError, match="is a run directory, not a checkpoint"):
        load_config(None, [f"trainer.resume_from={tmp_path}"])
