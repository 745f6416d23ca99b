"""The replay fuzzer's generator (tools/replay_fuzz/): it starts from valid messages of every
registered type, it is reproducible by seed, it mutates in every family, it never asks the
replay to write outside its scratch directory, and its accounting check adds up."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from asyncrl.wire.codec import decode, encode, registered_types
from asyncrl.wire.protocol import CheckpointRequest
from asyncrl.wire.validation import ProtocolError


@pytest.fixture
def ctx(replay_fuzz, tmp_path):
    scratch = tmp_path.resolve()
    return replay_fuzz.Context(
        scratch=scratch, run_dir=scratch / "run", n=2, batch_groups=2, capacity_groups=64
    )


def test_every_registered_type_has_valid_examples(replay_fuzz, ctx):
    """Every message of the core's wire (what the replay may receive). The vLLM engine's private
    messages to and from its worker (`rollout_servers.engines.vllm_join`, `vllm_notices`)
    register too when their tests are collected; `tests/unit/test_vllm_join.py` covers them."""
    for name, cls in registered_types().items():
        if not cls.__module__.startswith("asyncrl."):
            continue
        for seed in range(10):
            msg = replay_fuzz.valid_message(cls, random.Random(seed), ctx, f"case-{seed}")
            assert type(decode([bytes(f) for f in encode(msg)])) is cls, name


def test_cases_are_reproducible_by_seed_and_cover_every_family(replay_fuzz, tmp_path):
    def frames(seed):
        scratch = tmp_path.resolve()
        ctx = replay_fuzz.Context(scratch, scratch / "run", n=2, batch_groups=2, capacity_groups=64)
        return [replay_fuzz.generate_case(seed, i, ctx) for i in range(400)]

    first, again, other = frames(7), frames(7), frames(8)
    assert [c.messages for c in first] == [c.messages for c in again]
    assert [c.messages for c in first] != [c.messages for c in other]
    families = Counter(c.family for c in first)
    assert set(families) == {"valid", "bytes", "frames", "header", "arrays", "semantic"}
    outcomes = Counter()
    for case in first:
        for message in case.messages:
            try:
                decode(message)
                outcomes["decodes"] += 1
            except ProtocolError:
                outcomes["rejected"] += 1
            except Exception:  # a decoder bug the replay must survive (reported by the fuzzer)
                outcomes["decoder error"] += 1
    assert outcomes["decodes"] > 50 and outcomes["rejected"] > 150


@pytest.mark.parametrize(
    ("path", "outside"),
    [
        ("relative.json", False),
        ("run/replay.json", False),
        ("../escaped.json", False),  # cwd's parent is the scratch directory itself
        ("../../escaped.json", True),
        ("..", True),
        ("/etc/passwd", True),
        ("/tmp/../etc/x.json", True),
        ("x\x00y", False),  # refused by the OS before anything is written
    ],
)
def test_no_checkpoint_is_sent_that_would_write_outside_the_scratch_directory(
    replay_fuzz, tmp_path, path, outside
):
    scratch = tmp_path.resolve()
    frames = [bytes(f) for f in encode(CheckpointRequest(1, path, 0))]
    assert replay_fuzz.writes_outside(frames, scratch / "cwd", scratch) is outside
    inside = [bytes(f) for f in encode(CheckpointRequest(1, str(scratch / "run/a.json"), 0))]
    assert not replay_fuzz.writes_outside(inside, scratch / "cwd", scratch)


def test_accounting_adds_up(replay_fuzz):
    from asyncrl.wire.router import OUTCOMES

    check = replay_fuzz.check_accounting
    counters = dict.fromkeys(OUTCOMES, 0.0) | {"handled": 6.0, "rejected_malformed": 3.0}
    counters["received"] = 9.0
    assert check(counters, sent=10) == []  # the reading StatsRequest is not counted yet
    assert check(counters, sent=11) == ["received 9 != 10 messages sent before the stats"]
    crashed = counters | {"handled": 5.0, "handler_errors": 1.0}
    assert check(crashed, sent=10) == ["1 handler errors (crashes)"]
    lost = counters | {"handled": 5.0}
    assert "the sum of its outcomes" in check(lost, sent=10)[0]
