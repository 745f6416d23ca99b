import dataclasses

import msgpack
import numpy as np
import pytest

from asyncrl.wire.codec import WIRE_VERSION, decode, encode
from asyncrl.wire.protocol import ChatMessage, LeaseGrant, PromptItem, Stats
from asyncrl.wire.samples import Batch, Trajectories, Trajectory
from asyncrl.wire.validation import MAX_JSON_DEPTH, ProtocolError
from replay.buffer import to_batch


def _traj(**kw):
    base = dict(
        traj_id="t1",
        attempt=0,
        group_id="g",
        sample_index=0,
        server_id=0,
        prompt_ids=np.array([1, 2, 3]),
        response_ids=np.array([4, 5]),
        loss_mask=np.array([1, 1], np.uint8),
        behaviour_logprobs=np.array([-0.5, -1.0]),
        versions=np.array([3, 3]),
        reward=1.0,
        finish_reason="stop",
        baseline_reward=float("nan"),
        metrics={"k": 2.0},
    )
    base.update(kw)
    return Trajectory(**base)


def _wire(msg):
    return [bytes(f) for f in encode(msg)]


def test_round_trip_keeps_values_and_dtypes():
    back = decode(_wire(_traj()))
    assert back.traj_id == "t1" and back.metrics == {"k": 2.0}
    assert back.prompt_ids.dtype == np.int32 and back.prompt_ids.tolist() == [1, 2, 3]
    assert back.behaviour_logprobs.dtype == np.float32
    np.testing.assert_allclose(back.behaviour_logprobs, [-0.5, -1.0])


def test_arrays_travel_as_raw_frames_not_lists():
    frames = _wire(_traj())
    header = msgpack.unpackb(frames[0])
    assert "prompt_ids" not in header["fields"] and len(frames) == 1 + 5
    assert frames[1] == np.array([1, 2, 3], np.int32).tobytes()


def test_nested_structs_round_trip():
    grant = LeaseGrant(7, [PromptItem("g", 4, "src", [ChatMessage("user", "1+1=")], "2", {})])
    assert decode(_wire(grant)) == grant
    assert decode(_wire(Stats(1, {"a": 1.5}))).counters == {"a": 1.5}
    assert isinstance(decode(_wire(to_batch(3, [], 0))), Batch)


def test_a_prompt_temperature_is_optional_and_travels_as_sent():
    """None (the server's default) and a number both come back as they were sent; a negative,
    non-finite or non-number temperature is refused on decode."""
    item = PromptItem("g", 4, "src", [ChatMessage("user", "1+1=")], "2", {})
    assert item.temperature is None
    for temperature in (None, 0.0, 0.7):
        sent = LeaseGrant(7, [dataclasses.replace(item, temperature=temperature)])
        back = decode(_wire(sent))
        assert back == sent and back.prompts[0].temperature == temperature
    header = msgpack.unpackb(_wire(LeaseGrant(7, [item]))[0])
    for bad in (-1.0, -0.5, float("nan"), float("inf"), "0.7", True, [0.7]):
        header["fields"]["prompts"][0]["temperature"] = bad
        with pytest.raises(ProtocolError, match="temperature"):
            decode([msgpack.packb(header)])


def test_json_fields_round_trip_typed_and_bounded():
    """A row's extra_info travels as a typed JSON object (no JSON string inside a message):
    nested values come back as they went, and anything that is not plain JSON, or nested deeper
    than MAX_JSON_DEPTH, is refused on decode."""
    extra = {"index": 3, "tests": [{"in": "1 2", "out": "3"}], "score": 0.5, "ok": True, "n": None}
    item = PromptItem("g", 1, "src", [ChatMessage("user", "q")], "a", extra, tools_kwargs={"t": {}})
    got = decode(_wire(LeaseGrant(1, [item]))).prompts[0]
    assert (got.extra_info, got.tools_kwargs, got.interaction_kwargs) == (extra, {"t": {}}, {})

    def with_extra(value) -> list[bytes]:
        header = msgpack.unpackb(_wire(LeaseGrant(1, [item]))[0])
        header["fields"]["prompts"][0]["extra_info"] = value
        return [msgpack.packb(header)]

    deep: dict = {}
    node = deep
    for _ in range(MAX_JSON_DEPTH + 1):
        node["x"] = {}
        node = node["x"]
    for bad, reason in [
        ("{}", "expected a JSON object"),
        ({1: "int key"}, "strict_map_key|keys must be strings"),
        ({"b": b"bytes"}, "not a JSON value"),
        (deep, "nested deeper"),
    ]:
        with pytest.raises(ProtocolError, match=reason):
            decode(with_extra(bad))


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda f: [b"\xc1garbage"], "MessagePack"),
        (lambda f: [], "empty"),
        (lambda f: [msgpack.packb([1, 2])] + f[1:], "map"),
        (
            lambda f: [msgpack.packb({**msgpack.unpackb(f[0]), "v": WIRE_VERSION + 1})] + f[1:],
            "wire version",
        ),
        (
            lambda f: [msgpack.packb({**msgpack.unpackb(f[0]), "type": "nope"})] + f[1:],
            "unknown message type",
        ),
        (lambda f: f[:-1], "arrays"),
        (lambda f: f[:1] + [f[1][:-1]] + f[2:], "do not fit"),
    ],
)
def test_malformed_messages_raise_protocol_error(mutate, reason):
    with pytest.raises(ProtocolError, match=reason):
        decode(mutate(_wire(_traj())))


def test_wrong_field_type_and_extra_field_are_rejected():
    frames = _wire(_traj())
    header = msgpack.unpackb(frames[0])
    bad = {**header, "fields": {**header["fields"], "reward": "high"}}
    with pytest.raises(ProtocolError, match="Trajectory.reward|trajectory.reward"):
        decode([msgpack.packb(bad)] + frames[1:])
    extra = {**header, "fields": {**header["fields"], "evil": 1}}
    with pytest.raises(ProtocolError, match="unexpected fields"):
        decode([msgpack.packb(extra)] + frames[1:])


def test_wrong_array_dtype_is_rejected():
    frames = _wire(_traj())
    header = msgpack.unpackb(frames[0])
    header["arrays"][0][1] = np.dtype("float64").str
    with pytest.raises(ProtocolError, match="dtype"):
        decode([msgpack.packb(header)] + frames[1:])


def test_oversized_message_is_rejected_before_parsing():
    frames = _wire(_traj(prompt_ids=np.zeros(10_000, np.int32)))
    with pytest.raises(ProtocolError, match="oversized"):
        decode(frames, max_bytes=1000)


def _header_mutated(msg, change) -> list[bytes]:
    frames = _wire(msg)
    header = msgpack.unpackb(frames[0])
    change(header)
    return [msgpack.packb(header)] + frames[1:]


def _nested(depth: int, leaf=1):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "change, reason",
    [
        # seen crashing the replay (issue 13): an unhashable array name
        (lambda h: h["arrays"][0].__setitem__(0, ["prompt_ids"]), "bad array descriptor"),
        (lambda h: h["arrays"][0].__setitem__(0, {"a": 1}), "bad array descriptor"),
        (lambda h: h["arrays"][0].__setitem__(1, ["<i4"]), "dtype"),
        # element counts that overflow int64, and more dimensions than numpy has
        (lambda h: h["arrays"][0].__setitem__(2, [2**62, 2**62, 0]), "bad shape"),
        (lambda h: h["arrays"][0].__setitem__(2, [2**63 - 1]), "do not fit"),
        # found by tools/fuzz_replay.py: a 0-d array broke Batch.validate's len()
        (lambda h: h["arrays"][0].__setitem__(2, []), "bad shape"),
        (lambda h: h["arrays"][0].__setitem__(2, [1, 3]), "bad shape"),
        (lambda h: h["arrays"][0].__setitem__(2, [1] * 65), "bad shape"),
        (lambda h: h["arrays"][0].__setitem__(2, [True, 3]), "bad shape"),
        # `type` and `v` nested ~1000 deep: a RecursionError while writing the error text
        (lambda h: h.__setitem__("type", _nested(1000)), "nested deeper"),
        (lambda h: h.__setitem__("v", _nested(1000)), "nested deeper"),
        (lambda h: h["fields"].__setitem__("metrics", _nested(100, {})), "nested deeper"),
        # ints beyond int64 (msgpack carries up to 2**64 - 1) and out-of-range fields
        (lambda h: h["fields"].__setitem__("sample_index", 2**64 - 1), "int64"),
        (lambda h: h["fields"].__setitem__("sample_index", -1), "sample_index"),
        (lambda h: h["fields"].__setitem__("traj_id", "x" * 10_000), "traj_id"),
        (lambda h: h["fields"].__setitem__("group_id", ""), "group_id"),
        (
            lambda h: h["fields"].__setitem__("metrics", {f"m{i}": 1.0 for i in range(300)}),
            "metrics",
        ),
        (lambda h: h["fields"].__setitem__(b"bytes key", 1), "unexpected fields"),
    ],
)
def test_hostile_headers_raise_protocol_error_only(change, reason):
    with pytest.raises(ProtocolError, match=reason):
        decode(_header_mutated(_traj(), change))


def test_error_texts_quote_sender_input_bounded():
    frames = _header_mutated(_traj(), lambda h: h.__setitem__("type", "x" * 100_000))
    with pytest.raises(ProtocolError) as e:
        decode(frames)
    assert len(str(e.value)) < 200


def test_prompt_items_and_eval_submits_are_bounded():
    from asyncrl.wire.protocol import EvalSubmit

    item = PromptItem("g", 1, "src", [ChatMessage("user", "q")], "1", {}, eval_job="job")
    for change, reason in [
        (lambda p: p.__setitem__("n", 10**12), "PromptItem.n"),
        (lambda p: p.__setitem__("n", 0), "PromptItem.n"),
        (lambda p: p.__setitem__("temperature", float("nan")), "temperature"),
        (lambda p: p.__setitem__("eval_job", "other"), "not marked for this job"),
    ]:
        frames = _wire(EvalSubmit(1, "job", [item]))
        header = msgpack.unpackb(frames[0])
        change(header["fields"]["prompts"][0])
        with pytest.raises(ProtocolError, match=reason):
            decode([msgpack.packb(header)])


def test_a_batch_that_indexes_outside_its_arrays_or_carries_inf_is_rejected_at_the_learner():
    good = _wire(to_batch(1, [], 0))
    assert isinstance(decode(good), Batch)
    one = dict(
        request_id=1, traj_ids=["t"], group_ids=["g"], data_sources=["s"], finish_reasons=["stop"],
        rewards=np.ones(1, np.float32), baseline_rewards=np.full(1, np.nan, np.float32),
        prompt_offsets=np.array([0, 2]), response_offsets=np.array([0, 2]),
        prompt_ids=np.ones(2, np.int32), response_ids=np.ones(2, np.int32),
        loss_mask=np.ones(2, np.uint8), behaviour_logprobs=np.full(2, -1.0, np.float32),
        versions=np.zeros(2, np.int32), metric_names=[], metric_values=np.zeros(0, np.float32),
        fleet={}, stale_dropped=0,
    )  # fmt: skip
    assert decode(_wire(Batch(**one))).traj_ids == ["t"]
    for change, reason in [
        ({"response_offsets": np.array([0, 5])}, "response_offsets"),
        ({"prompt_offsets": np.array([1, 2])}, "prompt_offsets"),
        ({"rewards": np.array([np.inf], np.float32)}, "rewards"),
        ({"behaviour_logprobs": np.array([-1.0, np.nan], np.float32)}, "log-prob"),
        ({"group_ids": []}, "group_ids"),
    ]:
        with pytest.raises(ProtocolError, match=reason):
            decode(_wire(Batch(**{**one, **change})))


def test_trajectories_sent_together_come_back_as_they_were_sent():
    sent = [
        _traj(),
        _traj(traj_id="t2", sample_index=1, prompt_ids=np.arange(5), reward=0.25),
        _traj(
            traj_id="t3", response_ids=np.array([], np.int64), loss_mask=np.array([], np.uint8),
            behaviour_logprobs=np.array([]), versions=np.array([], np.int64), metrics={},
            baseline_reward=0.5, finish_reason="length", attempt=2,
        ),
    ]  # fmt: skip
    back = decode(_wire(Trajectories.pack(sent))).unpack()
    assert len(back) == len(sent)
    assert all(t.prompt_ids.base is None for t in back)  # its own memory, not the message's
    for a, b in zip(sent, back, strict=True):
        for name in ("traj_id", "attempt", "group_id", "sample_index", "server_id", "reward"):
            assert getattr(a, name) == getattr(b, name)
        assert (a.finish_reason, a.metrics) == (b.finish_reason, b.metrics)
        assert b.baseline_reward == a.baseline_reward or np.isnan(a.baseline_reward)
        for name in ("prompt_ids", "response_ids", "loss_mask", "behaviour_logprobs", "versions"):
            assert np.array_equal(getattr(a, name), getattr(b, name))


def test_trajectories_that_do_not_add_up_or_carry_a_bad_sample_are_rejected():
    good = Trajectories.pack([_traj(), _traj(traj_id="t2")])
    for change, reason in [
        ({"response_offsets": np.array([0, 2, 5])}, "response_offsets"),
        ({"prompt_offsets": np.array([0, 4, 3])}, "prompt_offsets"),
        ({"versions": np.zeros(3, np.int32)}, "versions"),
        ({"rewards": np.zeros(1)}, "rewards"),
        ({"group_ids": ["g"]}, "group_ids"),
        (
            {k: [] if isinstance(v, list) else v[:1] for k, v in vars(good).items()
             if k != "server_id"},
            "samples outside",
        ),
    ]:  # fmt: skip
        fields = {**vars(good), **change}
        with pytest.raises(ProtocolError, match=reason):
            decode(_wire(Trajectories(**fields)))
    # a sample's own checks are left to the receiver, so that a bad one fails alone
    for change, reason in [
        ({"traj_ids": ["t1", "x" * 300]}, "traj_id"),
        ({"attempts": np.array([0, -1], np.int32)}, "attempt"),
        ({"metrics": [{}, {f"m{i}": 0.0 for i in range(300)}]}, "metrics"),
    ]:
        good_one, bad_one = decode(_wire(Trajectories(**{**vars(good), **change}))).unpack()
        good_one.validate()
        with pytest.raises(ProtocolError, match=reason):
            bad_one.validate()
    with pytest.raises(ValueError, match="one server"):
        Trajectories.pack([_traj(), _traj(traj_id="t2", server_id=1)])
    with pytest.raises(ValueError, match="equal-length"):
        Trajectories.pack([_traj(versions=np.array([3]))])
