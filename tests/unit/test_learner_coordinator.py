"""`Learner.train_step` driven through a fake coordinator: one rank on CPU, a tiny model, no
replay and no weight sync. The SPMD stages must fetch through the coordinator, update the
weights, deliver the new weights as version + 1, publish version + 1 and log the step, in
that order; `learner.leader.step_record` turns what was logged into a metrics.jsonl record."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.config import load_config
from asyncrl.run_spec import RunSpec
from asyncrl.wire.samples import Batch
from learner.coordinator import Coordinator, Follower, StepOutcome, Weights
from learner.leader import step_record
from learner.trainer import Learner

VOCAB = 50
JOIN = "a restarted server waits to join"


class FakeCoordinator:
    """Hands over the batches it is given and records what the learner sends out."""

    def __init__(self, batches: list[Batch | str]) -> None:
        """`batches`: what each fetch hands over in turn; JOIN: no batch, a server waits to
        join the weight sync."""
        self.batches = batches
        self.calls: list[tuple] = []  # (method, version) in call order
        self.delivered: dict[int, dict[str, torch.Tensor]] = {}
        self.logged: list[tuple[int, dict[str, float], StepOutcome | None]] = []
        self._join = False
        self.validation_joins = 0

    def fetch_batch(self, version: int, should_stop: Callable[[], bool]) -> Batch | None:
        self.calls.append(("fetch_batch", version))
        got = self.batches.pop(0) if self.batches and not should_stop() else None
        self._join = got == JOIN
        return got if isinstance(got, Batch) else None

    def joins_waiting(self) -> bool:
        return self._join

    def catch_up(self, weights: Weights) -> None:
        self.calls.append(("catch_up", weights.version))
        self.delivered[weights.version] = {n: t.clone() for n, t in weights.tensors}

    def deliver_weights(self, weights: Weights) -> str | None:
        self.calls.append(("deliver_weights", weights.version))
        self.delivered[weights.version] = {n: t.clone() for n, t in weights.tensors}
        assert [s.name for s in weights.specs] == list(self.delivered[weights.version])
        return None

    def record_weights(self, weights: Weights) -> None:
        self.calls.append(("record_weights", weights.version))
        for _ in weights.tensors:
            pass

    def publish_version(self, version: int) -> None:
        self.calls.append(("publish_version", version))

    def validate(self, version: int) -> dict[str, float]:
        self.calls.append(("validate", version))
        self._join = self.validation_joins > 0  # so many calls end early for a join first
        if self._join:
            self.validation_joins -= 1
            return {}
        return {"val/mean_score": 0.5}

    def log(self, version: int, metrics: dict[str, float], step: StepOutcome | None = None) -> None:
        self.calls.append(("log", version))
        self.logged.append((version, dict(metrics), step))

    def checkpoint(self, path: str, version: int) -> None:
        self.calls.append(("checkpoint", version))

    def shutdown(self) -> None:
        self.calls.append(("shutdown", None))

    def close(self) -> None:
        self.calls.append(("close", None))


def _batch_message(seed: int = 0) -> Batch:
    """Two groups of two samples (prompts of 3 tokens, responses of 2 to 4), rewards that
    differ within each group (so GRPO's advantages are not 0), behaviour log-probs of a
    uniform policy over the vocabulary (what the random model is close to: ratios near 1)."""
    rng = np.random.default_rng(seed)
    responses = [2, 4, 3, 2]
    b, total = len(responses), sum(responses)
    return Batch(
        request_id=1,
        traj_ids=[f"t{i}" for i in range(b)],
        group_ids=["g0", "g0", "g1", "g1"],
        data_sources=["s"] * b,
        finish_reasons=["stop"] * b,
        rewards=np.array([1.0, 0.0, 0.0, 1.0], np.float32),
        baseline_rewards=np.full(b, np.nan, np.float32),
        prompt_offsets=np.arange(0, 3 * b + 1, 3),
        response_offsets=np.cumsum([0, *responses]),
        prompt_ids=rng.integers(1, VOCAB, 3 * b).astype(np.int32),
        response_ids=rng.integers(1, VOCAB, total).astype(np.int32),
        loss_mask=np.ones(total, np.uint8),
        behaviour_logprobs=np.full(total, -math.log(VOCAB), np.float32),
        versions=np.zeros(total, np.int32),
        metric_names=["turns"],
        metric_values=np.ones(b, np.float32),
        fleet={"server_idle_ratio": 0.25},
        stale_dropped=0,
    )


@pytest.fixture
def one_rank(tmp_path):
    """A process group of one (gloo, an in-memory store: no socket to rendezvous on) and a
    tiny random Llama saved where the learner loads it from."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield RunSpec(str(tmp_path / "run"), str(tmp_path / "model"), "unused", "unused", 0, 0, 1)
    dist.destroy_process_group()


def _learner(spec: RunSpec, coordinator: Coordinator, *overrides: str) -> Learner:
    cfg = load_config(None, ["learner.lr=0.01", "trainer.save_final=false", *overrides])
    return Learner(cfg, spec, 0, 1, torch.device("cpu"), coordinator)


def _params(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in learner.model.state_dict().items()}


def test_a_step_fetches_updates_delivers_publishes_and_logs_through_the_coordinator(one_rank):
    fake = FakeCoordinator([_batch_message()])
    learner = _learner(one_rank, fake)
    before = _params(learner)

    assert learner.train_step(3)

    assert fake.calls == [
        ("fetch_batch", 3),
        ("deliver_weights", 4),
        ("publish_version", 4),
        ("log", 4),
    ]
    after = _params(learner)
    assert any(not torch.equal(before[n], after[n]) for n in before), "no weight moved"
    # what was delivered as version 4 is the updated model, every tensor of it
    assert fake.delivered[4].keys() == after.keys()
    assert all(torch.equal(fake.delivered[4][n], after[n]) for n in after)
    version, metrics, step = fake.logged[0]
    assert version == 4 and step is not None and step.version == 3
    assert {"loss", "grad_norm", "clip_frac", "mismatch_kl", "adv_mean", "lr"} <= metrics.keys()
    assert step.batch.size == 4 and step.checksum is None and step.step_time_s > 0
    stages = ["fetch_batch", "compute_logprobs", "compute_advantages", "update"]
    stages += ["broadcast_weights", "publish_version", "validate"]
    assert list(step.timer.seconds) == stages
    record = step_record(step, _batch_message(), metrics, max_staleness=2)
    expected = {"step", "version", "time", "reward_mean", "reward_std", "samples"}
    expected |= {"response_len_mean", "response_len_p50", "response_len_max", "stale_dropped"}
    expected |= {"staleness_mean", "staleness_max", "train_tokens_per_s", "weight_sync_s"}
    expected |= {"step_time_s", "samples_per_s", "gen_tokens_per_s", "learner_idle_ratio"}
    expected |= {"peak_rss_mb", "traj/turns", "server_idle_ratio", *metrics}
    expected |= {f"time_{stage}_s" for stage in stages}
    assert expected <= record.keys()
    assert (record["step"], record["version"], record["samples"]) == (4, 4, 4)
    assert record["response_len_mean"] == pytest.approx(11 / 4)


def test_a_server_waiting_to_join_gets_the_current_weights_and_the_wait_goes_on(one_rank):
    """Issue 40: with one rollout server, a restarted one must get the current version while
    the learner waits for a batch, or no batch ever comes."""
    fake = FakeCoordinator([JOIN, JOIN, _batch_message()])
    learner = _learner(one_rank, fake)
    before = _params(learner)

    assert learner.train_step(3)

    assert fake.calls == [
        ("fetch_batch", 3),
        ("catch_up", 3),
        ("fetch_batch", 3),
        ("catch_up", 3),
        ("fetch_batch", 3),
        ("deliver_weights", 4),
        ("publish_version", 4),
        ("log", 4),
    ]
    # what the joiners got is the version the learner holds, before the step's update
    assert all(torch.equal(fake.delivered[3][n], before[n]) for n in before)
    assert any(not torch.equal(fake.delivered[4][n], before[n]) for n in before)


def test_a_server_waiting_to_join_during_validation_is_caught_up_and_validation_goes_on(
    one_rank,
):
    fake = FakeCoordinator([_batch_message()])
    fake.validation_joins = 1
    learner = _learner(one_rank, fake, "trainer.val_every=1")
    assert learner.train_step(0)
    assert fake.calls[-4:] == [("validate", 1), ("catch_up", 1), ("validate", 1), ("log", 1)]
    assert fake.logged[-1][1]["val/mean_score"] == 0.5


def test_no_batch_ends_the_loop_with_nothing_sent(one_rank):
    fake = FakeCoordinator([])
    learner = _learner(one_rank, fake, "trainer.total_steps=5")
    learner.run()
    assert fake.calls == [("fetch_batch", 0), ("shutdown", None)]


def test_a_run_records_the_base_weights_then_validates_and_logs_each_version(one_rank):
    fake = FakeCoordinator([_batch_message(0), _batch_message(1)])
    learner = _learner(
        one_rank,
        fake,
        "trainer.total_steps=2",
        "trainer.val_before_train=true",
        "trainer.val_every=2",
        "learner.weight_checksum=true",
    )
    learner.run()
    assert fake.calls == [
        ("record_weights", 0),
        ("validate", 0),
        ("log", 0),
        ("fetch_batch", 0),
        ("deliver_weights", 1),
        ("publish_version", 1),
        ("log", 1),
        ("fetch_batch", 1),
        ("deliver_weights", 2),
        ("publish_version", 2),
        ("validate", 2),
        ("log", 2),
        ("shutdown", None),
    ]
    assert fake.logged[0] == (0, {"val/mean_score": 0.5}, None)
    assert fake.logged[2][1]["val/mean_score"] == 0.5


def test_a_follower_takes_part_in_the_gathers_and_talks_to_nobody():
    drained = []

    def tensors():
        for name in ("a", "b"):
            drained.append(name)
            yield name, torch.zeros(1)

    follower = Follower()
    assert follower.fetch_batch(0, lambda: False) is None
    assert not follower.joins_waiting()
    follower.catch_up(Weights(0, [], tensors()))
    assert drained == ["a", "b"]
    drained.clear()
    assert follower.deliver_weights(Weights(1, [], tensors())) is None
    assert drained == ["a", "b"]
    assert follower.validate(1) == {}
