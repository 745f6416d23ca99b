"""Fleet metrics per batch: every step carries the servers' idle ratio, even when a server sent
no report since the previous batch (busy with all its slots, or its lease request held)."""

from __future__ import annotations

import pytest

from replay.fleet_stats import FleetStats


def test_idle_ratio_over_each_interval():
    fleet = FleetStats()
    fleet.report(0, busy_s=3.0, paused_s=0.5, uptime_s=4.0, now=4.0)
    fleet.report(1, busy_s=1.0, paused_s=0.0, uptime_s=4.0, now=4.0)
    first = fleet.for_batch([0.1, 0.2], 1, 2)
    assert first["server_idle_ratio"] == pytest.approx((0.25 + 0.75) / 2)
    assert first["generation_pause_s"] == pytest.approx(0.5)
    fleet.report(0, busy_s=5.0, paused_s=0.5, uptime_s=6.0, now=6.0)  # busy all of 2 s
    fleet.report(1, busy_s=1.0, paused_s=1.0, uptime_s=6.0, now=6.0)  # idle all of 2 s
    second = fleet.for_batch([], 0, 0)
    assert second["server_idle_ratio"] == pytest.approx(0.5)
    assert second["generation_pause_s"] == pytest.approx(1.0)


def test_a_server_silent_since_the_last_batch_keeps_its_interval_open():
    fleet = FleetStats()
    fleet.report(0, busy_s=2.0, paused_s=0.0, uptime_s=4.0, now=4.0)
    assert fleet.for_batch([], 0, 0)["server_idle_ratio"] == pytest.approx(0.5)
    # no report between these two batches: the last measured ratio stands in
    assert fleet.for_batch([], 0, 0)["server_idle_ratio"] == pytest.approx(0.5)
    # the next report covers both intervals (4 s, all idle), not only the latest
    fleet.report(0, busy_s=2.0, paused_s=0.0, uptime_s=8.0, now=8.0)
    assert fleet.for_batch([], 0, 0)["server_idle_ratio"] == pytest.approx(1.0)


def test_a_forgotten_server_no_longer_counts():
    fleet = FleetStats()
    fleet.report(0, busy_s=0.0, paused_s=0.0, uptime_s=1.0, now=1.0)
    fleet.report(1, busy_s=1.0, paused_s=0.0, uptime_s=1.0, now=5.0)
    fleet.for_batch([], 0, 0)
    fleet.forget_silent(now=6.0, silent_s=3.0)
    assert fleet.forgotten == 1
    assert fleet.for_batch([], 0, 0)["server_idle_ratio"] == pytest.approx(0.0)


def test_a_restarted_server_counts_from_its_new_start():
    """A new epoch's counters start from 0: without `forget`, its uptime (2 s) is below the
    old epoch's (100 s) and its idle ratio would stay frozen at the old one."""
    fleet = FleetStats()
    fleet.report(0, busy_s=10.0, paused_s=0.0, uptime_s=100.0, now=100.0)
    assert fleet.for_batch([], 0, 0)["server_idle_ratio"] == pytest.approx(0.9)
    fleet.forget(0)  # the replay declared epoch 0 dead, or epoch 1 replaced it
    fleet.report(0, busy_s=2.0, paused_s=0.0, uptime_s=2.0, now=104.0)
    assert fleet.for_batch([], 0, 0)["server_idle_ratio"] == pytest.approx(0.0)
