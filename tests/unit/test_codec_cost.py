"""What one header may cost a receiver (red-team finding 2 of issue 30): a 128 KiB header of
~130k empty lists took ~0.6 s to decode and held ~70x what its bytes were charged. The header's
values are counted in the one depth pass and bounded per role (`BYTES_PER_NODE`), decoding
runs no garbage collection, and the JSON check builds an error path only for an error."""

from __future__ import annotations

import gc

import msgpack
import pytest

from asyncrl.wire.codec import BYTES_PER_NODE, count_nodes, decode, encode
from asyncrl.wire.protocol import ChatMessage, EvalSubmit, PromptItem
from asyncrl.wire.replay_client import eval_parts
from asyncrl.wire.sockets import decode_frames
from asyncrl.wire.validation import ProtocolError

CLIENT_LIMIT = 128 * 1024  # replay.max_client_message_mb's default


def _lists_part(n: int, job: str = "j", group: str = "j/g0") -> list[bytes]:
    """One evaluation part whose prompt's extra_info is `n` empty lists (1 wire byte each)."""
    p = PromptItem(group, 1, "", [], "", {"a": [[] for _ in range(n)]}, eval_job=job)
    return [bytes(f) for f in encode(EvalSubmit(1, job, [p], more=True))]


def test_count_nodes_counts_every_value_and_key_and_bounds_depth_and_count() -> None:
    # the map, "a", the list, 1, [], the inner map, "b", None
    assert count_nodes({"a": [1, [], {"b": None}]}, 3) == 8
    with pytest.raises(ProtocolError, match="nested deeper than 2"):
        count_nodes([[[]]], 2)
    with pytest.raises(ProtocolError, match="more than 6 values"):
        count_nodes({"a": [1, [], {"b": None}]}, 3, max_nodes=6)


def test_a_client_header_of_empty_lists_is_refused_on_its_value_count() -> None:
    frames = _lists_part(120_000)
    assert sum(map(len, frames)) < CLIENT_LIMIT  # its size alone lets it through
    budget = CLIENT_LIMIT // BYTES_PER_NODE
    with pytest.raises(ProtocolError, match=f"more than {budget} values"):
        decode_frames(frames, max_bytes=CLIENT_LIMIT)
    assert decode_frames(_lists_part(budget - 100), max_bytes=CLIENT_LIMIT).prompts[0].extra_info


def test_decoding_runs_no_garbage_collection() -> None:
    """MessagePack builds every container of a header; with the collector on, a header of
    30k small containers triggered ~40 collections (~10x the unpacking). Now at most the one
    due once it is back on."""
    frames = _lists_part(30_000)
    runs: list[str] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(phase)

    gc.collect()
    gc.callbacks.append(note)
    try:
        decode(frames)
    finally:
        gc.callbacks.remove(note)
    assert len(runs) <= 1
    assert gc.isenabled()


def test_a_json_error_still_names_where_it_is() -> None:
    item = PromptItem("g", 1, "", [ChatMessage("user", "q")], "", {}, eval_job="j")
    header = msgpack.unpackb(encode(EvalSubmit(1, "j", [item]))[0])
    header["fields"]["prompts"][0]["extra_info"] = {"a": [1, {"b": b"x"}]}
    with pytest.raises(ProtocolError, match=r"extra_info\.'a'\[1\]\.'b': bytes is not a JSON"):
        decode([msgpack.packb(header, use_bin_type=True)])


def test_eval_parts_keep_each_part_under_the_value_bound() -> None:
    """A client splits a job so that no part holds more values than the replay accepts."""
    part_bytes = 120 * 1024
    prompts = [
        PromptItem(f"j/g{i}", 1, "", [], "", {"a": [[] for _ in range(4000)]}, eval_job="j")
        for i in range(20)
    ]
    parts = eval_parts("j", prompts, part_bytes)
    assert [q for p in parts for q in p.prompts] == prompts
    for p in parts:
        nodes = count_nodes(msgpack.unpackb(encode(p)[0]), 64)
        assert nodes <= part_bytes // BYTES_PER_NODE
        decode_frames([bytes(f) for f in encode(p)], max_bytes=CLIENT_LIMIT)
