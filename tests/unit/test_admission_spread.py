"""Admission spreads leases across the servers that ask (replay.admission, "Spread"): a fair
share of the window each while several ask, the whole budget for a server alone, staleness and
capacity never loosened; and with in-flight weight updates a group leased at version s is still
judged at a version >= s (its oldest sampled token)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from asyncrl.config import Config
from asyncrl.wire.protocol import ChatMessage, LeaseRequest, PromptItem
from asyncrl.wire.samples import Trajectory
from replay.admission import AdmissionController
from replay.buffer import GroupBuffer
from replay.eval_jobs import EvalJobs
from replay.leases import LeaseDesk, LeaseRules, lease_spread
from replay.prompts import setup_prompt_source


def test_two_servers_asking_split_the_window():
    # S = 0, B = 8: the window is one batch; two servers asking get 4 each, not 8 and 0
    adm = AdmissionController(max_staleness=0, groups_per_batch=8, capacity_groups=100)
    assert adm.window == 8 and adm.fair_share(2) == 4
    assert adm.grantable(0, wanted=16, held=0, in_flight=0, asking=2) == 4
    adm.on_issued(4)
    assert adm.grantable(0, 16, held=4, in_flight=4, asking=2) == 0  # its share is spent
    assert adm.grantable(0, 16, held=4, in_flight=0, asking=2) == 4  # the other's is not
    assert adm.grantable(0, 3, held=4, in_flight=0, asking=2) == 3  # never more than asked


def test_shares_round_up_so_every_asker_gets_work():
    adm = AdmissionController(max_staleness=0, groups_per_batch=8, capacity_groups=100)
    assert [adm.fair_share(m) for m in (1, 3, 8, 20)] == [8, 3, 1, 1]


def test_a_server_alone_uses_the_whole_budget():
    adm = AdmissionController(max_staleness=1, groups_per_batch=8, capacity_groups=100)
    assert adm.grantable(0, 100, held=0, in_flight=0, asking=1) == 16
    assert adm.grantable(0, 100, held=0) == 16  # the defaults: a caller that counts no one
    # alone, a server holding more than any share is still limited by staleness only
    adm.on_issued(10)
    assert adm.grantable(0, 100, held=10, in_flight=10, asking=1) == 6


def test_a_server_that_stops_asking_releases_its_share():
    adm = AdmissionController(max_staleness=1, groups_per_batch=8, capacity_groups=100)
    adm.on_issued(8)  # server A holds 8 = its share of 16 while B asks
    assert adm.grantable(0, 100, held=8, in_flight=8, asking=2) == 0
    # B is at its own concurrency limit (or gone): A asks alone and takes what is left
    assert adm.grantable(0, 100, held=8, in_flight=8, asking=1) == 8


def test_a_server_over_its_share_waits_until_its_work_drains():
    adm = AdmissionController(max_staleness=1, groups_per_batch=8, capacity_groups=100)
    adm.on_issued(14)  # A took 14 while alone; then B asks too
    assert adm.grantable(0, 100, held=14, in_flight=14, asking=2) == 0  # never negative
    assert adm.grantable(0, 100, held=14, in_flight=0, asking=2) == 2  # B: what staleness left
    # A's groups complete (ready, not in flight: ready groups do not count against a share)
    assert adm.grantable(0, 100, held=14, in_flight=7, asking=2) == 1
    assert adm.grantable(0, 100, held=14, in_flight=8, asking=2) == 0


def test_returned_and_expired_leases_free_their_place_in_the_share():
    adm = AdmissionController(max_staleness=0, groups_per_batch=4, capacity_groups=100)
    adm.on_issued(2)  # server A holds its share (2 of 4) while B asks
    assert adm.grantable(0, 10, held=2, in_flight=2, asking=2) == 0
    # one of A's leases expires: its slot and its place in A's share are free again
    adm.on_never_trained(1)
    assert adm.grantable(0, 10, held=1, in_flight=1, asking=2) == 1


def test_the_share_never_loosens_staleness_or_capacity():
    adm = AdmissionController(max_staleness=3, groups_per_batch=4, capacity_groups=6)
    assert adm.window == 6  # capacity, not (S + 1) * B = 16, is what can be in play
    assert adm.fair_share(2) == 3
    assert adm.grantable(0, 10, held=5, in_flight=0, asking=2) == 1  # capacity binds
    adm.on_issued(15)
    assert adm.grantable(0, 10, held=0, in_flight=0, asking=2) == 1  # staleness binds
    assert adm.grantable(-1, 10, held=0, in_flight=0, asking=2) == 0


def _simulate(max_staleness: int, capacity: int, seed: int) -> None:
    """M servers with different concurrency limits; each round some of them ask (the rest are
    full or not asking), one by one, each with a version between its last and the learner's.
    Groups complete out of order, possibly across a version update (their oldest token is then
    anywhere from the lease version up); the learner trains batch k = issued groups kB..kB+B-1
    at version k once they are all ready."""
    b, m = 4, 3
    rng = random.Random(seed)
    adm = AdmissionController(max_staleness, b, capacity)
    limit = [3, 16, 32]
    in_flight: list[list[int]] = [[] for _ in range(m)]  # issue indices per server
    versions = [0] * m
    lease_version: list[int] = []  # by issue index
    oldest: dict[int, int] = {}  # issue index -> oldest sampled token's version, once ready
    consumed = 0
    for _ in range(3000):
        learner_version = consumed // b
        held = len(lease_version) - consumed
        assert held <= capacity
        r = rng.random()
        if r < 0.4:
            asking = [i for i in range(m) if len(in_flight[i]) < limit[i] and rng.random() < 0.8]
            for i in asking:
                versions[i] = rng.randint(versions[i], learner_version)  # only moves up
                mine = len(in_flight[i])
                held = len(lease_version) - consumed
                k = adm.grantable(versions[i], limit[i] - mine, held, mine, len(asking))
                if k and len(asking) > 1:
                    assert mine + k <= adm.fair_share(len(asking))
                adm.on_issued(k)
                assert k == 0 or adm.issued <= (versions[i] + max_staleness + 1) * b
                in_flight[i] += range(len(lease_version), len(lease_version) + k)
                lease_version += [versions[i]] * k
            held = len(lease_version) - consumed
            share = adm.fair_share(len(asking))
            if asking and all(len(in_flight[i]) >= share for i in asking):
                # every asker at its share: the window is full, the share held nothing back
                assert all(
                    min(adm.staleness_budget(versions[i]), capacity - held) <= 0 for i in asking
                )
        elif r < 0.8:
            busy = [i for i in range(m) if in_flight[i]]
            if busy:
                i = rng.choice(busy)
                g = in_flight[i].pop(rng.randrange(len(in_flight[i])))
                oldest[g] = rng.randint(lease_version[g], max(lease_version[g], learner_version))
        elif all(g in oldest for g in range(consumed, consumed + b)):
            consumed += b
    assert consumed >= 20 * b, "the simulation must make progress"
    for i in range(consumed):
        assert oldest[i] >= lease_version[i]
        assert i // b - oldest[i] <= max_staleness  # trained within the bound


@pytest.mark.parametrize(("max_staleness", "capacity"), [(0, 1000), (1, 1000), (3, 1000), (3, 10)])
def test_spread_keeps_staleness_and_capacity_and_never_idles_the_window(max_staleness, capacity):
    for seed in range(3):
        _simulate(max_staleness, capacity, seed)


# ---- in-flight weight updates: a group is judged by its oldest sampled token ---------------------


def _traj(group_id: str, index: int, versions: list[int]) -> Trajectory:
    r = len(versions)
    return Trajectory(
        traj_id=f"{group_id}/{index}",
        attempt=0,
        group_id=group_id,
        sample_index=index,
        server_id=0,
        prompt_ids=np.array([1, 2, 3], np.int32),
        response_ids=np.arange(r, dtype=np.int32),
        loss_mask=np.ones(r, np.uint8),
        behaviour_logprobs=np.full(r, -0.5, np.float32),
        versions=np.array(versions, np.int32),
        reward=1.0,
        finish_reason="stop",
        baseline_reward=float("nan"),
        metrics={},
    )


def _item(group_id: str, n: int = 2) -> PromptItem:
    return PromptItem(group_id, n, "src", [ChatMessage("user", "1+1=")], "2", "{}")


@pytest.mark.parametrize(("learner_version", "kept"), [(3, True), (4, False)])
def test_a_group_spanning_versions_is_judged_at_its_lease_version_or_later(learner_version, kept):
    """Leased at s = 2 with S = 1; versions 3 and 4 landed in flight. The group's version is its
    oldest token's, 2 (>= s, so admission's prediction holds), not the newest's."""
    buf = GroupBuffer()
    buf.open_group(_item("g"), now=0.0, lease_version=2)
    assert buf.add(_traj("g", 0, [2, 2, 3, 4])) == "accepted"
    assert buf.add(_traj("g", 1, [3, 3, 4])) == "accepted"  # sampled only after an update
    groups, stale = buf.pop_batch(learner_version, num_groups=1, max_staleness=1)
    assert (len(groups), stale) == ((1, 0) if kept else (0, 1))


def test_a_group_sampled_wholly_after_an_update_is_fresher_than_its_lease():
    buf = GroupBuffer()
    buf.open_group(_item("g"), now=0.0, lease_version=2)
    buf.add(_traj("g", 0, [3, 3]))
    buf.add(_traj("g", 1, [3, 4]))
    groups, stale = buf.pop_batch(learner_version=3, num_groups=1, max_staleness=0)
    assert (len(groups), stale) == (1, 0)  # judged at 3, not at the lease version 2


# ---- the lease desk: the rule through `grant`, and the batch's spread metric ---------------------


def _desk(**rollout) -> LeaseDesk:
    cfg = Config.model_validate(
        {
            "rollout": {"n": 2, "max_concurrent_groups": 16, **rollout},
            "data": {"train_batch_size": 8},
            "replay": {"max_staleness": 0},
        }
    )
    buffer = GroupBuffer()
    rules, admission = LeaseRules.from_config(cfg), AdmissionController.from_config(cfg)
    return LeaseDesk(rules, admission, setup_prompt_source(cfg), buffer, EvalJobs(60.0), Counter())


def test_the_desk_grants_each_asking_server_its_share():
    desk = _desk()
    assert len(desk.grant(LeaseRequest(1, 0, 0, 16), asking=2)) == 4
    assert len(desk.grant(LeaseRequest(2, 1, 0, 16), asking=2)) == 4
    assert desk.buffer.in_flight_of(0) == desk.buffer.in_flight_of(1) == 4
    assert desk.counters["leases_granted"] == 8
    assert desk.grant(LeaseRequest(3, 0, 1, 16), asking=2) == []  # both at their share...
    assert len(desk.grant(LeaseRequest(4, 0, 1, 16), asking=1)) == 8  # ...unless alone


def test_a_desk_alone_grants_the_whole_window():
    desk = _desk()
    assert len(desk.grant(LeaseRequest(1, 0, 0, 16))) == 8


def test_a_server_at_its_concurrency_limit_wants_nothing():
    desk = _desk(max_concurrent_groups=3)
    assert len(desk.grant(LeaseRequest(1, 0, 0, 16), asking=1)) == 3
    assert desk.wanted(LeaseRequest(2, 0, 0, 16)) == 0  # the service does not count it asking
    assert desk.wanted(LeaseRequest(3, 1, 0, 16)) == 3


def test_the_desk_state_round_trips():
    desk = _desk()
    leased = desk.grant(LeaseRequest(1, 0, 0, 3))
    state = desk.data_state(version=5)
    again = _desk()
    assert again.restore(state) == 5
    assert again.admission.issued == 5 * 8
    reissued = again.grant(LeaseRequest(2, 0, 5, 3))
    assert [p.messages for p in reissued] == [p.messages for p in leased]
    assert again.counters["leases_reissued"] == 3


def test_lease_spread_of_a_batch():
    assert lease_spread([0, 0, 0, 0]) == {"batch_servers": 1.0, "batch_top_server_frac": 1.0}
    assert lease_spread([0, 1, 1, 0]) == {"batch_servers": 2.0, "batch_top_server_frac": 0.5}
    assert lease_spread([2, 0, 1, 1]) == {"batch_servers": 3.0, "batch_top_server_frac": 0.5}
    assert lease_spread([]) == {}
