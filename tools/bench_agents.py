"""Benchmark agent loops: the single-turn loop with each response's length fixed in advance.

    rollout.agent_loop=tools.bench_agents:LognormalLengthAgent   (with ASYNCRL_BENCH_LENGTHS)

`LognormalLengthAgent` samples each response to exactly L new tokens (`ignore_eos`, so a random
model's EOS does not end it early), L drawn from a lognormal with the median and 99th percentile
in the environment variable `ASYNCRL_BENCH_LENGTHS="MEDIAN:P99"` (default 32:512), capped by
`rollout.max_new_tokens`. L is a function of the prompt's data row and the sample's index in
its group only, so two runs over the same rows (drain and inflight, `tools/bench_pipeline.py
--lengths lognormal`) sample the same lengths.

Import path: the rollout server imports `tools.bench_agents` by that name, so the repository
root must be on its `sys.path` (tools/ is not an installed package): `bench_pipeline.py` puts it
on `PYTHONPATH`, which the local launcher's processes inherit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import random
from collections import Counter
from typing import Any

from asyncrl.wire.protocol import PromptItem
from rollout_servers.agents.base import AgentResult
from rollout_servers.agents.single_turn import SingleTurnAgentLoop
from rollout_servers.engines.base import Engine, SamplingParams

LENGTHS_ENV = "ASYNCRL_BENCH_LENGTHS"
Z_99 = 2.3263478740408408
"""The standard normal's 99th percentile."""


def lognormal_sigma(median: float, p99: float) -> float:
    """The sigma of the lognormal with this median and 99th percentile."""
    if not 0 < median <= p99:
        raise ValueError(f"want 0 < median <= p99, got median {median}, p99 {p99}")
    return math.log(p99 / median) / Z_99


def lognormal_length(median: float, p99: float, cap: int, key: str) -> int:
    """A length in [1, cap] from the lognormal (median, p99), the same for the same `key`."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    x = random.Random(seed).lognormvariate(math.log(median), lognormal_sigma(median, p99))
    return max(1, min(cap, round(x)))


def lengths_from_env() -> tuple[float, float]:
    median, _, p99 = os.environ.get(LENGTHS_ENV, "32:512").partition(":")
    return float(median), float(p99)


class LognormalLengthAgent(SingleTurnAgentLoop):
    """The single-turn loop, each response exactly `lognormal_length(...)` tokens long (see
    the module docstring). The key is the group's data row (`group_id` is `row-uuid`) and the
    sample's arrival order within its group: samples of one group are interchangeable, so the
    group's lengths are the same multiset in every run."""

    def __init__(self, engine: Engine, tokenizer: Any, params: SamplingParams, **unused: Any):
        super().__init__(engine, tokenizer, params, **unused)
        self.median, self.p99 = lengths_from_env()
        self._started: Counter[str] = Counter()  # samples started per group in flight

    def length_for(self, prompt: PromptItem, cap: int) -> int:
        index = self._started[prompt.group_id]
        self._started[prompt.group_id] += 1
        if self._started[prompt.group_id] >= prompt.n:
            del self._started[prompt.group_id]  # the group's last sample: forget it
        row = prompt.group_id.split("-")[0]
        return lognormal_length(self.median, self.p99, cap, f"{row}/{index}/{prompt.eval_job}")

    async def run(self, prompt: PromptItem, params: SamplingParams | None = None) -> AgentResult:
        base = params or self.params
        length = self.length_for(prompt, base.max_new_tokens)
        fixed = dataclasses.replace(base, max_new_tokens=length, ignore_eos=True)
        return await super().run(prompt, fixed)
