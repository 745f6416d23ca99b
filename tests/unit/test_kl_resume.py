"""The in-reward KL coefficient on resume (`learner.trainer.restored_kl_coef`): only `adaptive`
takes it from the checkpoint (it is state), and only from a checkpoint an adaptive run wrote;
a `fixed` coefficient is the config's, so `--resume RUN algorithm.kl_in_reward.coef=X` takes X.
`Learner.load_checkpoint` and `Learner.save_checkpoint` run on a stand-in trainer, the
checkpoint I/O replaced by a dict."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

import learner.trainer
from asyncrl.algorithms.kl import KLController
from asyncrl.config import load_config
from learner.trainer import Learner

FIXED = ["algorithm.kl_in_reward={type: fixed, coef: 0.05}"]
ADAPTIVE = ["algorithm.kl_in_reward={type: adaptive, coef: 0.05}"]


def _stand_in(overrides: list[str]) -> SimpleNamespace:
    cfg = load_config(None, overrides)
    none = dict.fromkeys(("model", "optimizer", "critic", "critic_optimizer"))
    return SimpleNamespace(cfg=cfg, kl_ctrl=cfg.algorithm.kl_in_reward.controller(), **none)


def _resumed_coef(monkeypatch, overrides: list[str], saved: dict) -> float:
    trainer = _stand_in(overrides)
    monkeypatch.setattr(learner.trainer, "load_checkpoint", lambda path, modules: {**saved})
    assert Learner.load_checkpoint(trainer, Path("step_3")) == 3  # type: ignore[arg-type]
    return trainer.kl_ctrl.value


def test_a_fixed_coefficient_is_the_configs_on_resume(monkeypatch):
    saved = {"version": 3, "kl_coef": 0.001, "kl_in_reward": "fixed"}
    assert _resumed_coef(monkeypatch, FIXED, saved) == 0.05


def test_an_adaptive_coefficient_resumes_from_an_adaptive_checkpoint(monkeypatch):
    saved = {"version": 3, "kl_coef": 0.0123, "kl_in_reward": "adaptive"}
    assert _resumed_coef(monkeypatch, ADAPTIVE, saved) == 0.0123


@pytest.mark.parametrize("writer", ["fixed", "none"])
def test_an_adaptive_run_from_another_variants_checkpoint_starts_at_its_coef(monkeypatch, writer):
    saved = {"version": 3, "kl_coef": 0.001, "kl_in_reward": writer}
    assert _resumed_coef(monkeypatch, ADAPTIVE, saved) == 0.05


def test_an_older_checkpoint_restores_only_into_adaptive_and_says_so(monkeypatch, caplog):
    older = {"version": 3, "kl_coef": 0.001}  # no kl_in_reward: written before the marker
    assert _resumed_coef(monkeypatch, FIXED, older) == 0.05
    with caplog.at_level(logging.WARNING, logger="asyncrl.learner"):
        assert _resumed_coef(monkeypatch, ADAPTIVE, older) == 0.001
    assert "does not say which algorithm.kl_in_reward" in caplog.text


def test_a_checkpoint_stores_the_variant_beside_its_coefficient(monkeypatch):
    trainer = _stand_in(ADAPTIVE)
    trainer.spec = SimpleNamespace(run_dir="run")
    trainer.coordinator, trainer.rank, trainer.world = None, 0, 1
    saved = {}
    monkeypatch.setattr(learner.trainer, "save_checkpoint", lambda *a: saved.update(a[6]))
    Learner.save_checkpoint(trainer, 3)  # type: ignore[arg-type]
    assert saved == {"kl_coef": 0.05, "kl_in_reward": "adaptive"}


def test_the_controllers_have_what_the_learner_reads():
    """The boundary is typed (`KLController`; mypy checks the built-ins against it in
    `asyncrl.algorithms.kl`): here, each built-in has its attributes and method."""
    for overrides in (FIXED, ADAPTIVE):
        ctrl = load_config(None, overrides).algorithm.kl_in_reward.controller()
        assert ctrl is not None
        assert (ctrl.value, ctrl.estimator) == (0.05, "kl")
        assert callable(ctrl.update)
    assert set(KLController.__annotations__) == {"value", "estimator"}
