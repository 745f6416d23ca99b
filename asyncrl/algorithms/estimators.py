"""Advantage estimators, each declared once: what it needs, and where its compute function is.

`ESTIMATORS` is the one registry of estimators. Each member is an `Estimator` declaration
stating what the estimator needs: a critic (the learner builds one), a minimum group size
(config validation checks `rollout.n`), a greedy baseline (the rollout servers sample one per
group), and whether it computes one advantage per sequence or per token. Config validation,
the learner and the servers all read these declarations, so adding an estimator is one
declaration (here, or `@estimator(...)` over a function in a user's module) plus its test.

This module does not import torch: the built-ins name their compute functions by import path
(`asyncrl.algorithms.advantages`, the tensor math), so validating a config, which every process and the
launcher do first, costs no torch import (about 1.3 s of start-up on this project's CPUs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from asyncrl.registry import Registry, import_object

EstimatorFn = Callable[[Any], Any]
"""`asyncrl.algorithms.advantages.AdvantageInputs` -> [B] or [B, T] advantages, or (advantages, value
targets)."""


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: how it computes and what it needs."""

    name: str
    compute: EstimatorFn | str
    """[B] per-sequence advantages (level "sequence", broadcast over sampled tokens), or [B, T]
    per-token advantages (level "token"); critic estimators return (advantages, value targets).
    A function, or its import path `package.module:name`."""
    level: Literal["sequence", "token"]
    needs_critic: bool = False
    """The learner trains a value model and passes its values; compute returns value targets."""
    min_group_size: int = 1
    """Config validation refuses rollout.n below this (a group-relative baseline needs 2)."""
    greedy_baseline: bool = False
    """The servers sample one greedy answer per group and send its reward as baseline_rewards."""

    def function(self) -> EstimatorFn:
        """The compute function (imported now when declared by path)."""
        if callable(self.compute):
            return self.compute
        return import_object(self.compute)


ESTIMATORS: Registry[Estimator] = Registry("advantage estimator", "asyncrl.algorithms.estimators")
"""`algorithm.adv_estimator` names one of these (verl's names for the built-ins)."""


def estimator(
    name: str,
    *,
    level: Literal["sequence", "token"],
    needs_critic: bool = False,
    min_group_size: int = 1,
    greedy_baseline: bool = False,
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Declare the decorated function as the estimator `name` (see `Estimator`)."""

    def wrap(fn: EstimatorFn) -> EstimatorFn:
        ESTIMATORS.register(
            name, Estimator(name, fn, level, needs_critic, min_group_size, greedy_baseline)
        )
        return fn

    return wrap


def _builtin(name: str, level: Literal["sequence", "token"], **needs: Any) -> None:
    ESTIMATORS.register(
        name, Estimator(name, f"asyncrl.algorithms.advantages:_{name}", level, **needs)
    )


_builtin("gae", "token", needs_critic=True)
_builtin("grpo", "sequence", min_group_size=2)
_builtin("rloo", "sequence", min_group_size=2)
_builtin("reinforce_plus_plus", "token")
_builtin("reinforce_plus_plus_baseline", "token", min_group_size=2)
_builtin("remax", "token", greedy_baseline=True)
