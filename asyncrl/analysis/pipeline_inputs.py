"""What the pipeline model (`pipeline_model`) is given: a fleet and the unit costs of its work.

A fleet is a run's `Config`, the one source of every setting the model shares with a real run
(`MODEL_READS` lists them), plus what only a model has: the distribution of response lengths,
how to treat the engines' batching when it should differ from `rollout.engine`, and how well the
learner ranks scale. The unit costs are measured (`tools/simulate.py calibrate`), not configured.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import reduce
from typing import Literal

from asyncrl.config import Config


@dataclass(frozen=True)
class Costs:
    """What one unit of each kind of work costs, in seconds. The defaults are the calibration
    of docs/simulator.md: 14 quiet bench_pipeline runs on the reference machine (2 CPU cores,
    the 256-hidden 4-layer bench model, one torch thread per process)."""

    gen_batch_s: float = 0.00862
    """Per engine batch (static) or per step that admits new rows (continuous): prefill."""
    gen_step_s: float = 0.000946
    """Per decode step, whatever the number of rows."""
    gen_seq_step_s: float = 0.000118
    """Per live row per decode step."""
    train_step_s: float = 0.0307
    """Per learner step, not shared out over ranks (advantages, optimizer, publish, logging)."""
    train_token_s: float = 0.000195
    """Per (padded) token trained, on one rank; N ranks share the tokens."""
    fetch_s: float = 0.00151
    """The learner's batch request when a batch is ready."""
    broadcast_s: float = 0.00843
    """A weight broadcast to one server."""
    broadcast_per_server_s: float = 0.00328
    """What each further server adds to a broadcast (gloo here: linear in the servers)."""
    apply_s: float = 0.000835
    """A server applying a received version (its engine pauses)."""
    score_s: float = 0.00063
    """A reward worker scoring one sample and sending it (a group is done when all are)."""
    lease_s: float = 0.00307
    """A lease request's round trip (half each way), agent loops started included."""
    deliver_s: float = 0.00129
    """From a group's last sample being scored until the learner's fetch of it returns."""
    prompt_tokens: float = 7.0
    """Prompt length, for the training cost."""


@dataclass(frozen=True)
class Lengths:
    """Response lengths: `fixed:L`, `lognormal:MEDIAN:SIGMA`, or empirical `values`. A draw is
    truncated at the fleet's `rollout.max_new_tokens` (a response that reaches it ends with
    reason "length")."""

    kind: Literal["fixed", "lognormal", "empirical"]
    median: float = 0.0
    sigma: float = 0.0
    values: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Lengths:
        kind, *args = text.split(":")
        if kind == "fixed" and len(args) == 1:
            return cls("fixed", median=float(args[0]))
        if kind == "lognormal" and len(args) == 2:
            return cls("lognormal", median=float(args[0]), sigma=float(args[1]))
        raise ValueError(f"lengths {text!r}: want fixed:L or lognormal:MEDIAN:SIGMA")

    def sample(self, rng: random.Random, max_tokens: int) -> int:
        if self.kind == "fixed":
            x = self.median
        elif self.kind == "lognormal":
            x = rng.lognormvariate(math.log(self.median), self.sigma)
        else:
            x = rng.choice(self.values)
        return max(1, min(max_tokens, round(x)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.median:g}"
        if self.kind == "lognormal":
            return f"lognormal:{self.median:g}:{self.sigma:g}"
        return f"empirical({len(self.values)} lengths)"


Batching = Literal["static", "continuous"]

BATCHING: dict[str, Batching] = {"hf": "static", "vllm": "continuous", "sglang": "continuous"}
"""How each `rollout.engine` samples what is queued: the HF engine in static batches (a batch
runs until its longest row ends, rows that arrive meanwhile wait for the next one), vLLM and
SGLang continuously (rows join at the next decode step)."""

MODEL_READS = (
    "rollout.num_servers",
    "rollout.engine",
    "rollout.n",
    "rollout.max_new_tokens",
    "rollout.max_concurrent_groups",
    "rollout.hf.max_batch_size",
    "reward.workers",
    "replay.max_staleness",
    "replay.capacity_groups",
    "replay.wait_timeout_s",
    "data.train_batch_size",
    "learner.world_size",
    "learner.packing",
)
"""The config fields the model reads; no other field changes its figures. (Its engine applies a
version at the next batch or decode step: `tools/sim_weight_updates.py` also reads
`rollout.weight_update_mode` and models drain and inflight.)"""


@dataclass(frozen=True)
class Fleet:
    """The pipeline's shape: a run's config (the fields in `MODEL_READS`) and what only the
    model has."""

    cfg: Config
    lengths: Lengths
    """Response lengths, each truncated at `rollout.max_new_tokens`."""
    batching: Batching | None = None
    """How the engines sample; None: as `rollout.engine` does (`BATCHING`)."""
    rank_efficiency: float = 1.0
    """Fraction of linear speed-up the learner ranks reach (assumed; 1 = perfect)."""

    @property
    def static_batches(self) -> bool:
        """Whether an engine samples whole batches rather than admitting rows at every step."""
        return (self.batching or BATCHING[self.cfg.rollout.engine]) == "static"

    @property
    def padded_training(self) -> bool:
        """Training costs samples x the batch's longest sequence (`learner.packing=false`
        pads every row to it), else the tokens really trained."""
        return not self.cfg.learner.packing

    def describe(self) -> str:
        """The config fields the model reads and the model's own settings, on one line."""
        values = [reduce(getattr, key.split("."), self.cfg) for key in MODEL_READS]
        read = " ".join(
            f"{key}={str(v).lower() if isinstance(v, bool) else v}"
            for key, v in zip(MODEL_READS, values, strict=True)
        )
        batching = "static" if self.static_batches else "continuous"
        own = f"lengths={self.lengths} batching={batching} rank_efficiency={self.rank_efficiency}"
        return f"{read} {own}"
