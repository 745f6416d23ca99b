"""Rollout server health: the replay declares a silent server dead after server_timeout_s (not
before), a newer epoch replaces an older one, an over epoch is refused, and the leases of a
dead or replaced epoch are re-issued at once (its late samples are never trained); the
launcher restarts a dead server after the doubling backoff with its next epoch, drops it once
its restarts are used up, and fails the run only when no server is left."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from fake_fleets import Clock, FakeFleet, FakeMember, restart_records

from asyncrl.config import Config
from asyncrl.launch.fleet import LaunchError, raise_on_failure
from asyncrl.launch.restarts import ServerRestarts
from asyncrl.wire.protocol import LeaseRequest, ServerHealth
from asyncrl.wire.samples import Trajectory
from replay.admission import AdmissionController
from replay.buffer import GroupBuffer
from replay.eval_jobs import EvalJobs
from replay.health import HEALTH_COUNTERS, FleetHealth
from replay.leases import LeaseDesk, LeaseRules
from replay.prompts import setup_prompt_source


# ---- replay side: FleetHealth -----------------------------------------------------------------
def test_a_silent_server_is_declared_dead_after_the_timeout_and_not_before():
    counters: Counter[str] = Counter()
    health = FleetHealth(timeout_s=3.0, counters=counters)
    assert set(HEALTH_COUNTERS) <= set(counters)  # present from the start
    assert health.observe(0, 0, now=100.0) == ("alive", "")
    assert health.observe(1, 0, now=100.0) == ("alive", "")
    assert health.observe(1, 0, now=102.0)[0] == "alive"
    assert health.declare_silent(now=103.0) == []  # server 0 silent 3.0 s: not longer
    assert health.declare_silent(now=103.5) == [0]
    assert health.declare_silent(now=104.0) == []  # declared once
    assert health.epochs() == {1: 0}
    assert health.declare_silent(now=105.1) == [1]
    assert health.epochs() == {}
    assert health.report(now=106.0, in_flight={0: 2, 1: 0}.__getitem__) == [
        ServerHealth(0, 0, False, 6.0, 2),
        ServerHealth(1, 0, False, 4.0, 0),
    ]
    assert (counters["servers_declared_dead"], counters["heartbeats"]) == (2, 3)


def test_a_dead_epoch_stays_dead_and_only_a_newer_one_brings_the_server_back():
    counters: Counter[str] = Counter()
    health = FleetHealth(timeout_s=3.0, counters=counters)
    health.observe(2, 0, now=0.0)
    assert health.declare_silent(now=5.0) == [2]
    verdict, why = health.observe(2, 0, now=6.0)  # stopped, then continued: still over
    assert verdict == "refused" and "declared dead" in why
    assert health.epochs() == {}
    verdict, why = health.observe(2, 1, now=7.0)
    assert (verdict, why) == ("replaced", "server_2 epoch 0 was replaced by epoch 1")
    assert health.epochs() == {2: 1}
    assert health.observe(2, 0, now=7.5)[0] == "refused"  # the old one, later: refused
    assert health.observe(2, 1, now=8.0)[0] == "alive"
    assert counters["server_epochs_replaced"] == 1


def test_a_newer_epoch_replaces_a_live_one_without_waiting_for_the_timeout():
    health = FleetHealth(timeout_s=30.0, counters=Counter())
    health.observe(0, 0, now=0.0)
    assert health.observe(0, 3, now=1.0)[0] == "replaced"  # restarted before being missed
    assert health.epochs() == {0: 3}
    assert health.observe(0, 2, now=1.5)[0] == "refused"


def test_any_message_of_the_epoch_believed_alive_is_a_sign_of_life():
    health = FleetHealth(timeout_s=3.0, counters=Counter())
    health.touch(0, now=1.0)  # never heard from: no entry (its epoch is unknown)
    assert health.report(now=1.0, in_flight=lambda sid: 0) == []
    health.observe(0, 2, now=10.0)
    health.observe(1, 0, now=10.0)
    health.touch(0, now=12.5)  # heartbeats delayed, samples and lease requests still come
    health.touch(0, now=12.0)  # out of order: never moves the time back
    assert health.declare_silent(now=15.0) == [1]
    assert health.report(now=15.0, in_flight=lambda sid: 0)[0] == ServerHealth(0, 2, True, 2.5, 0)
    health.touch(1, now=15.2)  # a declared-dead epoch's straggler brings nothing back
    assert health.declare_silent(now=15.4) == [] and health.epochs() == {0: 2}
    assert health.declare_silent(now=16.0) == [0]  # 3.5 s after its latest message


class FakeTime:
    """What `replay.service` reads of `time`: a clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_the_replay_refreshes_a_server_on_its_lease_requests_and_samples(monkeypatch):
    """Wired in `ReplayService`: a server whose heartbeats stop but whose lease requests and
    samples keep coming is not declared dead; once everything stops, it is."""
    import replay.service
    from asyncrl.wire.auth import new_secret
    from asyncrl.wire.protocol import Heartbeat
    from asyncrl.wire.router import Peer
    from asyncrl.wire.samples import Trajectories

    clock = FakeTime()
    monkeypatch.setattr(replay.service, "time", clock)
    cfg = Config.model_validate(
        {
            "rollout": {"n": 2, "num_servers": 2},
            "data": {"train_batch_size": 2},
            "launch": {"heartbeat_s": 1.0, "server_timeout_s": 3.0},
        }
    )
    service = replay.service.setup_replay_service(
        cfg, "inproc://test-health-refresh", None, secret=new_secret()
    )
    try:
        peers = [Peer(f"s{i}".encode(), f"server_{i}") for i in range(2)]
        for i, peer in enumerate(peers):
            service._on_heartbeat(peer, Heartbeat(1, i, 0))
        messages = [  # no heartbeat from here on; server 0 keeps working, 2.5 s apart
            lambda: service._on_lease_request(peers[0], LeaseRequest(2, 0, 0, 1)),
            lambda: service._on_trajectory(peers[0], _sample("g", 0, 0)),
            lambda: service._on_trajectories(
                peers[0], Trajectories.pack([_sample("g", i, 0) for i in (0, 1)])
            ),
        ]
        clock.now += 2.5
        for send in messages:
            send()
            clock.now += 2.5  # 5 s after the message before it: this one kept server 0 alive
            service._maybe_expire(clock.now)
            assert service.health.epochs() == {0: 0}  # server 1, silent all along, is dead
        clock.now += 1.0  # 3.5 s after the last message: server 0 is silent too
        service._maybe_expire(clock.now)
        assert service.health.epochs() == {}
    finally:
        service.close()


# ---- replay side: leases of a dead server ----------------------------------------------------
def _desk() -> tuple[LeaseDesk, GroupBuffer, Counter[str]]:
    cfg = Config.model_validate(
        {
            "rollout": {"n": 2, "max_concurrent_groups": 4},
            "data": {"train_batch_size": 2},
            "replay": {"max_staleness": 4},
        }
    )
    buffer, counters = GroupBuffer(), Counter()
    rules, admission = LeaseRules.from_config(cfg), AdmissionController.from_config(cfg)
    desk = LeaseDesk(rules, admission, setup_prompt_source(cfg), buffer, EvalJobs(60.0), counters)
    return desk, buffer, counters


def _sample(group_id: str, index: int, server_id: int) -> Trajectory:
    return Trajectory(
        traj_id=f"{group_id}/{index}",
        attempt=0,
        group_id=group_id,
        sample_index=index,
        server_id=server_id,
        prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.array([3], np.int32),
        loss_mask=np.ones(1, np.uint8),
        behaviour_logprobs=np.full(1, -0.5, np.float32),
        versions=np.zeros(1, np.int32),
        reward=1.0,
        baseline_reward=float("nan"),
        finish_reason="stop",
        metrics={},
    )


def test_a_dead_servers_incomplete_leases_are_reissued_first_and_its_late_samples_not_trained():
    desk, buffer, counters = _desk()
    dead = desk.grant(LeaseRequest(1, server_id=0, server_version=0, max_groups=3))
    alive = desk.grant(LeaseRequest(2, server_id=1, server_version=0, max_groups=1))
    assert (len(dead), len(alive)) == (3, 1)
    for i in range(2):  # one of the dead server's groups is complete: it stays, to be trained
        assert buffer.add(_sample(dead[0].group_id, i, 0)) == "accepted"
    assert buffer.add(_sample(dead[1].group_id, 0, 0)) == "accepted"  # half done: re-issued
    issued = desk.admission.issued

    assert desk.reissue_server(0, "server_0 declared dead") == 2
    assert buffer.in_flight_of(0) == 0 and buffer.in_flight_of(1) == 1
    assert buffer.num_ready == 1
    assert desk.admission.issued == issued - 2  # their admission slots are free again
    assert counters["dead_server_leases"] == 2

    # its samples arriving later are answered late: their groups are gone, nothing is trained
    assert buffer.add(_sample(dead[1].group_id, 1, 0)) == "late"
    assert buffer.add(_sample(dead[2].group_id, 0, 0)) == "late"

    # the next grant, to any server, leases the same prompts first, under new group ids
    again = desk.grant(LeaseRequest(3, server_id=1, server_version=0, max_groups=2))
    assert [p.messages for p in again] == [dead[1].messages, dead[2].messages]
    assert {p.group_id for p in again}.isdisjoint({p.group_id for p in dead})
    assert counters["leases_reissued"] == 2


# ---- launcher side: ServerRestarts ---------------------------------------------------------
def _restarts(tmp_path, health=(), servers=2, grace_s=0.0, **launch):
    cfg = Config.model_validate(
        {"rollout": {"num_servers": servers}, "launch": {"restart_backoff_s": 2.0, **launch}}
    )
    clock, said = Clock(), []
    fleet = FakeFleet([FakeMember("replay"), *(FakeMember(f"server_{i}") for i in range(servers))])
    restarts = ServerRestarts(cfg, tmp_path, lambda: list(health), clock, said.append, grace_s)
    return restarts, fleet, clock, said


def test_a_dead_server_is_restarted_after_a_doubling_backoff_with_its_next_epoch(tmp_path):
    restarts, fleet, clock, said = _restarts(tmp_path, max_restarts=3)
    fleet.end("server_1")
    assert restarts.failures(fleet) == []  # taken for a restart: not a failure of the run
    assert fleet.retired == ["server_1"]
    assert said == ["asyncrl: server_1 was killed by signal SIGKILL; restart 1/3 in 2.0s"]
    clock.now += 1.9
    restarts.check(fleet)
    assert fleet.started == []
    clock.now += 0.2
    restarts.check(fleet)
    assert fleet.started == [(1, 1)]
    fleet.end("server_1", "exited with code 1")
    restarts.failures(fleet)
    assert said[-1] == "asyncrl: server_1 exited with code 1; restart 2/3 in 4.0s"
    clock.now += 4.1
    restarts.check(fleet)
    assert fleet.started == [(1, 1), (1, 2)]
    records = restart_records(tmp_path)
    assert [(r["server"], r["epoch"], r["event"]) for r in records] == [
        ("server_1", 1, "restart"),
        ("server_1", 2, "restart"),
    ]
    assert records[0]["why"] == "was killed by signal SIGKILL"


def test_a_server_out_of_restarts_is_dropped_and_the_run_fails_only_with_none_left(tmp_path):
    restarts, fleet, clock, said = _restarts(tmp_path, max_restarts=1)
    fleet.end("server_0")
    restarts.failures(fleet)
    clock.now += 2.0
    restarts.check(fleet)
    fleet.end("server_0", "exited with code 1")
    assert restarts.failures(fleet) == []
    assert said[-1] == "asyncrl: server_0 dropped after 1 restarts: exited with code 1"
    assert restart_records(tmp_path)[-1]["event"] == "dropped"
    clock.now += 100
    restarts.check(fleet)
    assert fleet.started == [(0, 1)]  # never again
    fleet.end("server_1")
    restarts.failures(fleet)
    clock.now += 2.0
    restarts.check(fleet)
    fleet.end("server_1")
    with pytest.raises(LaunchError) as e:
        restarts.failures(fleet)
    assert str(e.value).startswith("no rollout server is left")
    assert e.value.failed == ("server_0", "server_1")


def test_a_death_of_another_member_still_ends_the_run_naming_the_server_deaths_before_it(
    tmp_path,
):
    restarts, fleet, clock, _ = _restarts(tmp_path, max_restarts=3)
    fleet.members.append(FakeMember("learner_0"))
    fleet.end("server_1")
    fleet.end("learner_0", "exited with code 1")
    with pytest.raises(LaunchError) as e:
        raise_on_failure(fleet, window_s=0.0, restarts=restarts)
    lines = str(e.value).splitlines()
    assert lines[0] == "process learner_0 exited with code 1"
    assert lines[1].startswith("earlier (not fatal): server_1 was killed by signal SIGKILL (")
    assert e.value.failed == ("learner_0",)


def test_with_max_restarts_0_a_server_death_ends_the_run_as_before(tmp_path):
    restarts, fleet, _, said = _restarts(tmp_path, max_restarts=0)
    fleet.end("server_1")
    with pytest.raises(LaunchError) as e:
        raise_on_failure(fleet, window_s=0.0, restarts=restarts)
    assert str(e.value).splitlines()[0] == "process server_1 was killed by signal SIGKILL"
    assert e.value.failed == ("server_1",) and fleet.retired == [] and said == []


def test_a_server_the_replay_declares_dead_is_killed_and_restarted(tmp_path):
    health = [ServerHealth(0, 0, True, 0.5, 1), ServerHealth(1, 0, False, 3.2, 2)]
    restarts, fleet, clock, said = _restarts(tmp_path, health, max_restarts=2)
    restarts.check(fleet)
    assert fleet.retired == ["server_1"]  # killed while its process still ran
    assert said == [
        "asyncrl: server_1 was declared dead by the replay (silent for 3.2 s); restart 1/2 in 2.0s"
    ]
    clock.now += 2.0
    restarts.check(fleet)  # the report still names epoch 0 dead: that one is gone already
    assert fleet.started == [(1, 1)] and fleet.retired == ["server_1"]
    health[1] = ServerHealth(1, 1, False, 3.1, 0)  # the restarted one hung too
    clock.now += 1.0
    restarts.check(fleet)
    assert fleet.retired == ["server_1", "server_1"]
    assert said[-1].endswith("restart 2/2 in 4.0s")


def test_with_max_restarts_0_a_declared_death_ends_the_run_naming_it(tmp_path):
    health = [ServerHealth(1, 0, False, 31.0, 0)]
    restarts, fleet, _, _ = _restarts(tmp_path, health, max_restarts=0)
    with pytest.raises(LaunchError) as e:
        restarts.check(fleet)
    assert str(e.value).startswith(
        "process server_1 was declared dead by the replay (silent for 31.0 s)"
    )
    assert e.value.failed == ("server_1",)


def test_a_server_declared_dead_whose_process_ends_in_the_grace_is_named_by_its_end(tmp_path):
    """The stop-37 CI failure (Ray): server_0 was SIGKILLed, learner rank 0 had it declared
    dead after a failed weight sync, and the launcher named that before Ray reported the
    actor's death. Given the backend's lag as a grace, the report names how the process
    ended; a server still declared dead when the grace is over is killed as before."""
    health = [ServerHealth(1, 0, False, 0.8, 0)]
    restarts, fleet, clock, said = _restarts(tmp_path, health, grace_s=10.0, max_restarts=0)
    restarts.check(fleet)
    clock.now += 9.0
    restarts.check(fleet)  # still within the grace: nothing is killed, nothing fails
    fleet.end("server_1")  # the backend reports the death now
    with pytest.raises(LaunchError) as e:
        raise_on_failure(fleet, window_s=0.0, restarts=restarts)
    assert str(e.value).splitlines()[0] == "process server_1 was killed by signal SIGKILL"
    assert fleet.retired == [] and said == []

    hung = [ServerHealth(1, 0, False, 31.0, 0)]
    restarts, fleet, clock, said = _restarts(tmp_path, hung, grace_s=10.0, max_restarts=0)
    restarts.check(fleet)
    clock.now += 10.0
    with pytest.raises(LaunchError, match="declared dead by the replay"):
        restarts.check(fleet)


def test_a_server_declared_dead_that_ends_in_the_grace_is_restarted_once(tmp_path):
    health = [ServerHealth(1, 0, False, 0.8, 0)]
    restarts, fleet, clock, said = _restarts(tmp_path, health, grace_s=10.0, max_restarts=2)
    restarts.check(fleet)
    fleet.end("server_1")
    restarts.failures(fleet)
    assert said == ["asyncrl: server_1 was killed by signal SIGKILL; restart 1/2 in 2.0s"]
    clock.now += 10.0  # the report still names epoch 0 dead: that one is gone already
    restarts.check(fleet)
    assert fleet.started == [(1, 1)] and len(said) == 1


def test_a_dead_servers_validation_prompts_are_leased_again():
    """Validation groups leased to a server that dies go back to the front of the queue (they
    would otherwise wait for it forever and the learner's validation would time out); slots it
    already filled stay filled, and its late samples are answered `late`, not taken."""
    from asyncrl.wire.protocol import ChatMessage, PromptItem

    jobs = EvalJobs(60.0)
    prompts = [
        PromptItem(g, 2, "src", [ChatMessage("user", "q")], "a", {}, eval_job="job")
        for g in ("e0", "e1", "e2")
    ]
    jobs.submit("job", prompts, now=0.0)
    assert [p.group_id for p in jobs.take(2, server_id=1)] == ["e0", "e1"]
    assert jobs.add(_sample("e0", 0, 1), now=1.0) == "accepted"
    assert jobs.reissue_server(1) == 2
    assert jobs.reissue_server(1) == 0
    assert [p.group_id for p in jobs.take(3, server_id=0)] == ["e0", "e1", "e2"]
    assert jobs.add(_sample("e1", 0, 1), now=2.0) == "late"  # the dead server's late sample
    assert jobs.add(_sample("e0", 0, 0), now=2.0) == "duplicate"  # filled before the death
    for g, i in (("e0", 1), ("e1", 0), ("e1", 1), ("e2", 0), ("e2", 1)):
        assert jobs.add(_sample(g, i, 0), now=3.0) == "accepted"
    assert jobs.reissue_server(0) == 0  # every group complete: nothing left to re-issue


def test_the_restart_backoff_is_capped(tmp_path):
    restarts, fleet, clock, said = _restarts(tmp_path, max_restarts=3, restart_backoff_s=200.0)
    fleet.end("server_1")
    restarts.failures(fleet)
    clock.now += 201
    restarts.check(fleet)
    fleet.end("server_1", "exited with code 1")
    restarts.failures(fleet)
    assert said[-1] == "asyncrl: server_1 exited with code 1; restart 2/3 in 300.0s"  # not 400
