"""Dynamic sampling in the replay (`replay.group_filter`, `replay.filter_groups`): groups whose
metric does not vary never reach a batch, their slots are freed at once, they cost the other
groups nothing, the bound stops the filter for a step, and the step's metrics say so. Driven
through the service's own handlers, as the learner and a server would."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from fake_trajectories import one_token_trajectory

from asyncrl.config import Config
from asyncrl.wire.protocol import LeaseRequest, PromptItem
from asyncrl.wire.router import Peer
from asyncrl.wire.samples import Batch, BatchRequest
from learner.leader import zero_variance_groups
from replay.service import ReplayService, setup_replay_service

SECRET = bytes(32)
SERVER, LEARNER = Peer(b"s", "server_0"), Peer(b"l", "learner")


def _config(**filter_groups) -> Config:
    """One server, groups of 2 samples, batches of 2 groups, strictly on-policy: a staleness
    window of 2 groups."""
    return Config.model_validate(
        {
            "rollout": {"n": 2, "num_servers": 1, "max_concurrent_groups": 8},
            "data": {"train_batch_size": 2},
            "replay": {"max_staleness": 0, "filter_groups": {"enable": True, **filter_groups}},
        }
    )


@pytest.fixture
def service(request) -> Iterator[ReplayService]:
    cfg = getattr(request, "param", None) or _config()
    svc = setup_replay_service(cfg, f"inproc://filter-{id(request)}", None, secret=SECRET)
    svc.sent = []  # type: ignore[attr-defined]
    record = lambda peer, msg: svc.sent.append(msg)  # type: ignore[attr-defined]  # noqa: E731
    svc._send = svc.held_leases._send = svc.held_batches._send = record  # type: ignore[method-assign]
    yield svc
    svc.close()


def _lease(service: ReplayService, k: int, version: int = 0) -> list[PromptItem]:
    service.sent.clear()  # type: ignore[attr-defined]
    service._on_lease_request(SERVER, LeaseRequest(1, 0, version, k))
    grants = [m for m in service.sent if hasattr(m, "prompts")]  # type: ignore[attr-defined]
    return grants[-1].prompts if grants else []  # (a held request is answered empty first)


def _fill(service: ReplayService, item: PromptItem, rewards, **metrics) -> None:
    """The group's samples, with these rewards (and per-sample metrics), through the intake."""
    for i, reward in enumerate(rewards):
        metric = {k: float(v[i]) for k, v in metrics.items()}
        traj = one_token_trajectory(item.group_id, i, reward, metric)
        assert service.intake.take(traj) == ("accepted", "")


def _batch(service: ReplayService, version: int = 0) -> Batch | None:
    service.sent.clear()  # type: ignore[attr-defined]
    service._on_batch_request(LEARNER, BatchRequest(9, version, 2))
    sent = service.sent  # type: ignore[attr-defined]
    batches = [m for m in sent if isinstance(m, Batch) and m.traj_ids]  # (not the held one's)
    return batches[-1] if batches else None


def test_zero_variance_groups_never_reach_a_batch_and_leasing_goes_on(service):
    a, b = _lease(service, 2)
    assert _lease(service, 1) == []  # the window (2 groups) is full
    _fill(service, a, [1, 1])  # all correct: no signal
    assert service.counters["groups_filtered"] == 1 and len(service.buffer) == 1
    assert service.admission.issued == 1  # its slot is free at once
    (c,) = _lease(service, 1)
    _fill(service, b, [0, 0])  # all wrong: no signal either
    (d,) = _lease(service, 1)
    _fill(service, c, [1, 0])
    assert _batch(service) is None  # one useful group is not a batch
    _fill(service, d, [0, 1])
    batch = _batch(service)
    assert batch is not None and set(batch.group_ids) == {c.group_id, d.group_id}
    assert zero_variance_groups(batch) == 0
    assert batch.fleet["filter_groups_dropped"] == 2.0
    assert batch.fleet["filter_groups_frac"] == 0.5  # 2 dropped, 2 trained
    assert batch.fleet["filter_extra_samples_per_trained"] == 1.0  # 4 extra for 4 trained
    assert batch.fleet["filter_bound_hit"] == 0.0
    stats = service.stats()
    assert (stats["groups_filtered"], stats["samples_filtered"]) == (2.0, 4.0)
    assert stats["leases_granted"] == 4.0 and stats["groups_served"] == 2.0
    assert stats["groups_issued"] == 2.0  # issued = trained + held: the filtered count nowhere


def test_the_next_step_counts_from_zero(service):
    a, b = _lease(service, 2)
    _fill(service, a, [1, 0])
    _fill(service, b, [0, 1])
    batch = _batch(service)
    assert batch is not None and batch.fleet["filter_groups_dropped"] == 0.0
    assert batch.fleet["filter_groups_frac"] == 0.0
    assert batch.fleet["filter_extra_samples_per_trained"] == 0.0


def test_a_filtered_group_costs_the_others_no_staleness_budget(service):
    """A group filtered between two useful ones neither narrows the window for later leases nor
    stands in front of a ready group: the useful group leased after it is served at once, at
    the version it was leased at, as if the filtered one had never been leased."""
    a, b = _lease(service, 2)
    _fill(service, b, [1, 0])  # ready, waiting for a second group
    _fill(service, a, [0, 0])  # the oldest lease, filtered
    assert service.admission.staleness_budget(0) == 1  # as with b alone leased
    (c,) = _lease(service, 1)
    _fill(service, c, [0, 1])
    batch = _batch(service, version=0)  # strictly on-policy: nothing may wait a version
    assert batch is not None and batch.group_ids == [b.group_id] * 2 + [c.group_id] * 2
    assert batch.stale_dropped == 0 and service.counters["stale_dropped"] == 0


@pytest.mark.parametrize("service", [_config(max_filtered_per_step=1)], indirect=True)
def test_past_the_bound_the_step_trains_on_what_it_has_and_says_so(service, caplog):
    a, b = _lease(service, 2)
    _fill(service, a, [1, 1])  # filtered: the step's one
    (c,) = _lease(service, 1)
    with caplog.at_level("WARNING", logger="asyncrl.replay"):
        _fill(service, b, [1, 1])  # the bound is hit: kept
        _fill(service, c, [0, 0])  # kept too, and the warning is not repeated
    assert [r.message.count("max_filtered_per_step=1") for r in caplog.records] == [1]
    assert service.counters["filter_bound_hits"] == 1
    assert service.counters["filter_groups_passed"] == 2
    batch = _batch(service)
    assert batch is not None and zero_variance_groups(batch) == 2
    assert batch.fleet["filter_bound_hit"] == 1.0 and batch.fleet["filter_groups_dropped"] == 1.0
    (d,) = _lease(service, 1, version=1)  # a new step: the filter works again
    _fill(service, d, [0, 0])
    assert service.counters["groups_filtered"] == 2


@pytest.mark.parametrize("service", [_config(metric="acc")], indirect=True)
def test_another_metric_decides_and_a_missing_one_keeps_the_group(service):
    a, b = _lease(service, 2)
    _fill(service, a, [0.9, 0.4], acc=[1, 1])  # rewards vary, accuracy does not: filtered
    assert service.counters["groups_filtered"] == 1
    _fill(service, b, [1, 1])  # no `acc`: kept, counted
    assert service.counters["filter_metric_missing"] == 1 and service.buffer.num_ready == 1


@pytest.mark.parametrize(
    "service",
    [Config.model_validate({"rollout": {"n": 2}, "data": {"train_batch_size": 2}})],
    indirect=True,
)
def test_off_by_default_every_group_is_trained(service):
    a, b = _lease(service, 2)
    _fill(service, a, [1, 1])
    _fill(service, b, [0, 0])
    batch = _batch(service)
    assert batch is not None and zero_variance_groups(batch) == 2
    assert not [k for k in batch.fleet if k.startswith("filter_")]
    assert service.counters["groups_filtered"] == 0


@pytest.mark.parametrize(
    "service",
    [
        Config.model_validate(
            {
                "rollout": {"n": 1},
                "data": {"train_batch_size": 2},
                "algorithm": {"adv_estimator": "reinforce_plus_plus"},
                "replay": {"filter_groups": {"enable": True}},
            }
        )
    ],
    indirect=True,
)
def test_a_group_of_one_sample_is_kept(service):
    a, b = _lease(service, 2)
    _fill(service, a, [1])
    _fill(service, b, [0])
    batch = _batch(service)
    assert batch is not None and len(batch.traj_ids) == 2


def test_the_learner_counts_zero_variance_groups_by_reward():
    batch = Batch(
        request_id=0,
        traj_ids=list("abcdefg"),
        group_ids=["x", "x", "y", "y", "z", "z", "w"],
        data_sources=["s"] * 7,
        finish_reasons=["stop"] * 7,
        rewards=np.array([1, 1, 0, 1, 0.5, 0.5, 1], np.float32),  # x and z; w is alone
        baseline_rewards=np.full(7, np.nan, np.float32),
        prompt_offsets=np.zeros(8, np.int64),
        response_offsets=np.zeros(8, np.int64),
        prompt_ids=np.zeros(0, np.int32),
        response_ids=np.zeros(0, np.int32),
        loss_mask=np.zeros(0, np.uint8),
        behaviour_logprobs=np.zeros(0, np.float32),
        versions=np.zeros(0, np.int32),
        metric_names=[],
        fleet={},
        metric_values=np.zeros(0, np.float32),
        stale_dropped=0,
    )
    assert zero_variance_groups(batch) == 2
