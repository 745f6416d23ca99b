"""Reward functions, chosen by a row's `data_source`, computed next to the agent loop.

A reward function has verl's signature, `compute_score(data_source, solution_str, ground_truth,
extra_info=None) -> float | dict` (a dict carries `score` plus extra metrics). It runs in a
thread pool, off the event loop, under a timeout. An exception, a timeout or a non-finite value
scores 0.0 and is counted: a bad reward function never takes down a rollout server.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncrl.tasks import ARITH_SOURCE, arith_reward_fn

log = logging.getLogger("asyncrl.rewards")

RewardFn = Callable[..., "float | dict[str, float]"]


def _arith_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    return arith_reward_fn(solution_str, ground_truth)


REWARD_FNS: dict[str, RewardFn] = {ARITH_SOURCE: _arith_score}


def register_reward(data_source: str):
    """Decorator: `@register_reward("my_source")` over a verl-signature function."""

    def wrap(fn: RewardFn) -> RewardFn:
        REWARD_FNS[data_source] = fn
        return fn

    return wrap


class RewardComputer:
    """Scores responses off the event loop with a timeout; failures score 0 and are counted."""

    def __init__(self, timeout_s: float, max_workers: int = 4):
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward")
        self.failures: Counter[str] = Counter()

    async def score(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: str,
        extra_info: dict[str, Any] | None,
    ) -> tuple[float, dict[str, float]]:
        fn = REWARD_FNS.get(data_source)
        if fn is None:
            self.failures["unknown_data_source"] += 1
            log.warning("no reward function for data_source %r; scoring 0", data_source)
            return 0.0, {}
        loop = asyncio.get_running_loop()
        try:
            result = await asyncio.wait_for(
                loop.run_in_executor(
                    self._pool, fn, data_source, solution_str, ground_truth, extra_info
                ),
                self.timeout_s,
            )
        except asyncio.TimeoutError:
            self.failures["timeout"] += 1
            return 0.0, {}
        except Exception as e:  # a user's reward function is a process boundary of sorts
            self.failures["exception"] += 1
            log.warning("reward function for %r raised %s: %s", data_source, type(e).__name__, e)
            return 0.0, {}
        extras: dict[str, float] = {}
        if isinstance(result, dict):
            extras = {k: float(v) for k, v in result.items() if k != "score" and _is_number(v)}
            result = result.get("score", float("nan"))
        if not _is_number(result) or not math.isfinite(float(result)):
            self.failures["non_finite"] += 1
            return 0.0, extras
        return float(result), extras

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
