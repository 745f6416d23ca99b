"""DESIGN.md: a malformed message "is rejected and counted ... No message, however hostile,
stops a service". A few thousand mutated messages of every type (tools/replay_fuzz/) go to a
live replay in a process of its own, so that a crash is a crash; afterwards the replay is alive,
answered every message, accounted for every one in its counters, still does a real lease ->
samples -> batch round trip, and its memory grew by little. The long run of the same fuzzer is
`python tools/fuzz_replay.py --messages 100000`."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

MESSAGES = 5000
MAX_RSS_GROWTH_MB = 50.0


def test_fuzzed_messages_never_crash_the_replay(replay_fuzz, tmp_path):
    cfg = replay_fuzz.CampaignConfig(
        messages=MESSAGES,
        seed=0,
        workdir=tmp_path,
        max_crashes=3,  # enough kinds to act on; a crash costs a restart
        max_rss_growth_mb=MAX_RSS_GROWTH_MB,
    )
    report = replay_fuzz.run_campaign(cfg)
    summary = report.summary()  # (plain booleans below: pytest would print the whole report)
    crashed, sent = bool(report.crashes), report.fuzzed
    unanswered, accounting = len(report.unanswered), report.accounting
    assert not crashed, summary
    assert sent >= MESSAGES, summary
    assert unanswered == 0, summary
    assert accounting == [], summary
    assert report.round_trip == "ok", summary
    assert report.rss_growth_mb < MAX_RSS_GROWTH_MB, summary
    assert report.skipped_unsafe < MESSAGES // 100, summary  # the fuzzer sent what it made
