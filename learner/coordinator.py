"""What a learner rank asks of the world outside its process group, behind one interface.

Learner rank 0 is two things: an SPMD training rank like the others, and the run's coordinator
(the replay's client, the weight sync's sending side, validation, the loggers, the trace and
the samples and weight-checksum logs). `trainer.Learner` runs the SPMD stages on every rank and
hands everything that leaves the learner group to its `Coordinator`: rank 0 gets the `Leader`
(`learner.leader`), which does the talking; every other rank gets a `Follower`, which talks to
nobody and only takes part in the collectives the stages need (draining the weight gathers).
Both are built in `learner.trainer.setup_learner`; neither knows the `Learner`.

The `Learner` calls every method on every rank, in step, so no stage branches on the rank, and
a test drives `Learner.train_step` with a fake coordinator (tests/unit/test_learner_coordinator.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from asyncrl.metrics import StageTimer
from asyncrl.weights.layout import ParamSpec
from asyncrl.weights.probe import DeliveryProbe
from asyncrl.wire.samples import Batch
from learner.batch import TrainBatch


@dataclass
class Weights:
    """One version's weights as the learner ranks stream them out."""

    version: int
    specs: list[ParamSpec]
    """The sync layout (`learner.fsdp.sync_specs`): floating point in the engine's dtype."""
    tensors: Iterator[tuple[str, torch.Tensor]]
    """(name, full tensor) in `specs` order (`learner.fsdp.sync_tensors`). Gathering them is a
    collective: every rank must drain this iterator, in step."""
    probe: DeliveryProbe | None = None
    """The delivery probe the engines check the version against (`learner.delivery`)."""


@dataclass
class StepOutcome:
    """What one `Learner.train_step` did, for the step's record in the logs."""

    version: int
    """The version trained at (the step made version + 1)."""
    batch: TrainBatch
    timer: StageTimer
    """The step's stages and how long each took."""
    step_time_s: float
    """Since the end of the previous step (or the learner's set-up)."""
    checksum: str | None
    """The checksum of the weights sent (learner.weight_checksum), else None."""


class Coordinator(Protocol):
    """Learner rank 0's outward work. Every rank calls each method at the same point of a step;
    what the follower (every other rank) does is said with each."""

    def fetch_batch(self, version: int, should_stop: Callable[[], bool]) -> Batch | None:
        """Leader: the replay's next batch of whole groups trainable at `version`, waiting for
        it; None once `should_stop()` turns true (the run stops), or once a restarted rollout
        server waits to join the weight sync (`joins_waiting`). Follower: None, always: its
        batch comes from rank 0 through the broadcast in `Learner.fetch_batch`."""
        ...

    def joins_waiting(self) -> bool:
        """Leader: whether its last `fetch_batch` or `validate` stopped waiting because a
        restarted server waits to join the weight sync (`learner.sync_fleet`): with one server
        no batch (nor validation score) comes until it has weights, so every rank then gathers
        the current version for `catch_up`. Follower: False (rank 0's answer is what every
        rank acts on)."""
        ...

    def catch_up(self, weights: Weights) -> None:
        """Leader: join the server epochs waiting and send them `weights`, the version every
        other member holds already (nothing is logged: no new version). Follower: drain
        `weights.tensors` (the gathers)."""
        ...

    def deliver_weights(self, weights: Weights) -> str | None:
        """Leader: send the version to every member of the weight sync (joining restarted
        servers and dropping failed ones first: `learner.sync_fleet`), returning once each has
        it or is dropped; with learner.weight_checksum, log and return its checksum. Follower:
        drain `weights.tensors` (the gathers) and return None."""
        ...

    def record_weights(self, weights: Weights) -> None:
        """Weights the servers already hold (the base model, version 0): the leader logs their
        checksum (learner.weight_checksum) and sends nothing. Follower: drain the tensors."""
        ...

    def publish_version(self, version: int) -> None:
        """Leader: tell the replay that `version` is the learner's (after its weights reached
        the servers). Follower: nothing."""
        ...

    def validate(self, version: int) -> dict[str, float]:
        """Leader: run the validation set through the rollout servers as an evaluation job and
        return its scores as `val/<name>`; {} once a restarted server waits to join the weight
        sync (`joins_waiting`), after which a call for the same version waits for the same job.
        Follower: {} at once (rank 0's `joins_waiting` decides what comes next)."""
        ...

    def log(self, version: int, metrics: dict[str, float], step: StepOutcome | None = None) -> None:
        """Leader: one record of `version` for every logger (metrics.jsonl, ...): `metrics`,
        and with `step`, the step's batch, throughput and stage times, its trace spans and its
        line of samples.jsonl. Follower: nothing."""
        ...

    def checkpoint(self, path: str, version: int) -> None:
        """The replay's part of the checkpoint of `version`: leader, the replay writes its whole
        state to `path` (`learner.checkpoint`). Follower: nothing."""
        ...

    def shutdown(self) -> None:
        """The run ended normally: the leader tells every server that no more versions come,
        closes the loggers and flushes the trace. Follower: nothing."""
        ...

    def close(self) -> None:
        """The process ends, however it ends: the leader writes its stats (peak memory).
        Follower: nothing."""
        ...


class Follower:
    """The coordinator of learner ranks 1..N-1: it talks to nobody. Its batches come from rank
    0's broadcast, its only part in a weight sync is the gathers, and the rest is rank 0's."""

    def fetch_batch(self, version: int, should_stop: Callable[[], bool]) -> Batch | None:
        """None: the batch arrives through `Learner.fetch_batch`'s broadcast."""
        return None

    def joins_waiting(self) -> bool:
        """Rank 0 knows; its answer is broadcast."""
        return False

    def catch_up(self, weights: Weights) -> None:
        """Take part in the gathers; rank 0 sends."""
        for _ in weights.tensors:
            pass

    def deliver_weights(self, weights: Weights) -> str | None:
        """Take part in the gathers; rank 0 sends."""
        for _ in weights.tensors:
            pass
        return None

    def record_weights(self, weights: Weights) -> None:
        """Take part in the gathers; rank 0 logs."""
        for _ in weights.tensors:
            pass

    def publish_version(self, version: int) -> None:
        """Rank 0 tells the replay."""

    def validate(self, version: int) -> dict[str, float]:
        """Rank 0 validates; no scores here."""
        return {}

    def log(self, version: int, metrics: dict[str, float], step: StepOutcome | None = None) -> None:
        """Rank 0 logs."""

    def checkpoint(self, path: str, version: int) -> None:
        """Rank 0 asks the replay."""

    def shutdown(self) -> None:
        """Rank 0 tells the servers."""

    def close(self) -> None:
        """Nothing of its own to write."""
