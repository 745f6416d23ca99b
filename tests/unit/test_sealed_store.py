"""The sealed view of the weight-sync store (`asyncrl.weights.sealed_store`) on torch's in-memory
HashStore: what a keyless writer or reader of the same store can and cannot do to a join.
The same over a real TCPStore with a learner and a server joining: tests/integration/
test_sync_store_keys.py."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from asyncrl.weights.group import answer, learner_member_store, member_store, read_place
from asyncrl.weights.sealed_store import MAX_VALUE, SealedStore
from asyncrl.weights.transports import SyncAnswer, pack_message, place_of, unpack_message
from asyncrl.wire.auth import role_key, server_role, sync_key

SECRET = bytes(range(32))
LEARNER = role_key(SECRET, "learner")
SHORT = datetime.timedelta(seconds=0.2)


def sealed(store: dist.Store, server: int = 1, epoch: int = 0) -> SealedStore:
    key = sync_key(LEARNER, server_role(server, epoch))
    return member_store(store, server, epoch, key, SHORT.total_seconds())


def test_a_value_round_trips_and_is_stored_unreadable() -> None:
    store = dist.HashStore()
    view = sealed(store)
    here = place_of(torch.device("cpu"))
    place = pack_message(here)
    assert here.host.encode() in place and b"shm_free" in place  # what a reader saw before
    view.set("ready", place)
    assert view.get("ready") == place
    raw = bytes(dist.PrefixStore("server_1/epoch_0", store).get("ready"))
    assert raw != place and here.host.encode() not in raw and b"shm_free" not in raw


def test_the_learner_and_the_server_derive_the_same_key() -> None:
    store = dist.HashStore()
    server_side = sealed(store, 2, 3)
    learner_side = learner_member_store(store, LEARNER, 2, 3, 0.2)
    server_side.set("ready", b"place")
    assert learner_side.get("ready") == b"place"


def test_a_forged_or_unsealed_value_is_absent() -> None:
    store = dist.HashStore()
    view = sealed(store)
    plain = dist.PrefixStore("server_1/epoch_0", store)
    plain.set("answer", pack_message(SyncAnswer(join=False, transport="gloo", reason="forged")))
    assert not view.check(["answer"])
    with pytest.raises(TimeoutError, match="forged"):
        view.get("answer")
    answer(view, True, "shm", "the learner's")  # the genuine write overwrites the forgery
    got = unpack_message(view.get("answer"), SyncAnswer)
    assert got.join and got.transport == "shm"


def test_a_value_sealed_with_another_key_or_for_another_name_does_not_open() -> None:
    store = dist.HashStore()
    mine, other_epoch = sealed(store, 1, 0), sealed(store, 1, 1)
    other_run = member_store(store, 1, 0, sync_key(role_key(b"x" * 32, "learner"), "server_1"), 0.2)
    for forger in (other_epoch, other_run):
        blob = forger.seal("answer", b"abandon")
        dist.PrefixStore("server_1/epoch_0", store).set("answer", blob)
        assert not mine.check(["answer"])
    moved = mine.seal("ready", b"x")  # sealed for `ready`, written under `answer`
    dist.PrefixStore("server_1/epoch_0", store).set("answer", moved)
    assert not mine.check(["answer"])


def test_any_flipped_bit_is_refused() -> None:
    view = sealed(dist.HashStore())
    blob = view.seal("ready", b"a place of some length")
    for i in range(len(blob)):
        flipped = bytearray(blob)
        flipped[i] ^= 1
        assert view.open("ready", bytes(flipped)) is None
    assert view.open("ready", blob[:-1]) is None
    assert view.open("ready", b"") is None


def test_two_seals_of_one_value_differ() -> None:
    view = sealed(dist.HashStore())
    assert view.seal("ready", b"same") != view.seal("ready", b"same")


def test_read_place_takes_only_a_sealed_place() -> None:
    store = dist.HashStore()
    view = sealed(store)
    dist.PrefixStore("server_1/epoch_0", store).set("ready", b"garbage")
    with pytest.raises(TimeoutError):
        read_place(view)
    view.set("ready", pack_message(place_of(torch.device("cpu"))))
    assert read_place(view).device == "cpu"


def test_counters_pass_through_and_a_huge_value_is_not_hashed() -> None:
    store = dist.HashStore()
    view = sealed(store)
    assert view.add("n", 2) == 2 and view.add("n", 3) == 5  # no content of a join in a count
    huge = view.seal("ready", b"x" * (MAX_VALUE + 1))
    assert view.open("ready", huge) is None
    assert view.open("ready", view.seal("ready", b"x" * MAX_VALUE)) == b"x" * MAX_VALUE


def test_get_within_bounds_its_wait() -> None:
    view = sealed(dist.HashStore())
    with pytest.raises(TimeoutError, match="after 0.05 s"):
        view.get_within("answer", 0.05)
    view.set("answer", b"yes")
    assert view.get_within("answer", 0.05) == b"yes"


def test_sync_keys_are_the_learners_for_servers_only() -> None:
    assert sync_key(LEARNER, "server_1") != sync_key(LEARNER, "server_1@1")
    with pytest.raises(ValueError):
        sync_key(role_key(SECRET, "server_1"), "server_1")
    with pytest.raises(ValueError):
        sync_key(LEARNER, "client")
