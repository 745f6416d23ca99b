"""The reward-model server on a real loopback socket with a tiny classifier built here: signed
requests from a rollout server (any epoch) and from the client get their items' scores, in
order, equal to the scorer's; every other message is rejected, counted once and answered, and
the server keeps serving; requests that wait together are scored in one batch; the entry point
serves until SIGTERM and writes its counters."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import zmq
from transformers import LlamaForCausalLM

from asyncrl.config import config_to_yaml, load_config
from asyncrl.config.reward import RewardModelConfig
from asyncrl.demo.reward_model import RewardModelSpec, build_reward_model
from asyncrl.demo.tiny_model import build_tokenizer
from asyncrl.run_spec import RunSpec
from asyncrl.wire.auth import SECRET_ENV, Keyring, role_key
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.protocol import ChatMessage, Error, StatsRequest
from asyncrl.wire.reward_protocol import ScoreItem, ScoreRequest, Scores
from asyncrl.wire.router import accounted
from asyncrl.wire.sockets import decode_signed, free_port, tcp_address
from reward_models.scorers import ClassifierScorer, JudgeScorer, Scored
from reward_models.server import RewardModelServer

pytestmark = pytest.mark.integration

SECRET = bytes(range(32))
KEYRING = Keyring(SECRET, num_servers=2)
LIMIT = 2**16  # the server's message limit in these tests (64 KB)


class CountingScorer:
    """The tiny classifier, recording the size of each batch it is given."""

    def __init__(self) -> None:
        tokenizer = build_tokenizer()
        model = build_reward_model(tokenizer, RewardModelSpec(hidden_size=32), seed=0).eval()
        self.inner = ClassifierScorer(model, tokenizer, max_length=256, max_batch=8)
        self.batches: list[int] = []

    def score(self, items: list[ScoreItem]) -> list[Scored]:
        self.batches.append(len(items))
        return self.inner.score(items)


@pytest.fixture(scope="module")
def scorer() -> CountingScorer:
    return CountingScorer()


@contextmanager
def serving(scorer: CountingScorer, threaded: bool = True) -> Iterator[RewardModelServer]:
    """A server on a free loopback port, its loop in a thread (or driven by the test)."""
    address = tcp_address("127.0.0.1", free_port())
    server = RewardModelServer(scorer, 8, address, SECRET, num_servers=2, max_message_bytes=LIMIT)
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop,), daemon=True)
    if threaded:
        thread.start()
    try:
        yield server
    finally:
        stop.set()
        if threaded:
            thread.join(timeout=5)
            assert not thread.is_alive(), "the server's loop did not stop"
        server.close()


@contextmanager
def dealer(address: str) -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()


def send(sock: zmq.Socket, msg: object, role: str | None, secret: bytes = SECRET) -> None:
    """`msg` (or raw frames) behind `role`'s authentication frame (None: an empty one)."""
    frames = msg if isinstance(msg, list) else [bytes(f) for f in encode(msg)]
    auth = b"" if role is None else role_key(secret, role).sign(frames)
    sock.send_multipart([auth, *frames])


def recv(sock: zmq.Socket) -> object:
    assert sock.poll(5000), "the server did not answer"
    frames = sock.recv_multipart()
    if frames[0] == b"":  # it could not authenticate us: an unsigned Error
        return decode(frames[1:])
    return decode_signed(frames, KEYRING.key(KEYRING.verify(frames[0], frames[1:])))


def ask(sock: zmq.Socket, msg: object, role: str | None) -> object:
    send(sock, msg, role)
    return recv(sock)


def _items(n: int, tag: str) -> list[ScoreItem]:
    return [
        ScoreItem(
            messages=[ChatMessage("user", f"{tag} question {i}?")], response=f"answer {i}" * i
        )
        for i in range(n)
    ]


def test_signed_requests_get_the_scorers_scores_in_order(scorer):
    with serving(scorer) as server, dealer(server.address) as sock:
        for role, n in [("server_0", 3), ("client", 1), ("server_1@2", 11)]:
            items = _items(n, role)
            reply = ask(sock, ScoreRequest(request_id=7, items=items), role)
            assert isinstance(reply, Scores) and reply.request_id == 7
            expected = scorer.inner.score(items)
            assert reply.errors == [e for _, e in expected] == [""] * n
            assert reply.scores == pytest.approx([s for s, _ in expected], abs=1e-5)
    stats = server.stats()
    assert stats["handled"] == stats["requests"] == 3 and stats["items"] == 15
    assert stats["batches"] == 4 and accounted(stats)  # 11 items: a batch of 8 and one of 3


def test_every_other_message_is_rejected_counted_and_answered(scorer):
    ok = ScoreRequest(request_id=1, items=_items(2, "ok"))
    big = ScoreRequest(request_id=2, items=[ScoreItem(messages=[], response="x" * LIMIT)])
    with serving(scorer) as server, dealer(server.address) as sock:
        cases = [
            (ok, None, "rejected_unauthenticated"),  # unsigned
            (ok, "server_5", "rejected_unauthenticated"),  # no such server in this run
            (ok, "learner", "rejected_forbidden"),
            (StatsRequest(request_id=3), "server_0", "rejected_unexpected"),
            ([b"\x93not a header"], "client", "rejected_malformed"),
            (big, "server_0", "rejected_oversized"),
        ]
        for msg, role, counter in cases:
            before = server.stats()[counter]
            reply = ask(sock, msg, role)
            assert isinstance(reply, Error), (counter, reply)
            assert server.stats()[counter] == before + 1, counter
        send(sock, ok, "server_0", secret=bytes(32))  # signed with another run's secret
        assert isinstance(recv(sock), Error)
        reply = ask(sock, ok, "server_0")  # and it still serves
        assert isinstance(reply, Scores) and len(reply.scores) == 2
    stats = server.stats()
    assert stats["rejected_unauthenticated"] == 3 and stats["handled"] == 1
    assert stats["received"] == 8 and stats["handler_errors"] == 0 and accounted(stats)


def test_requests_waiting_together_are_scored_in_one_batch(scorer):
    scorer.batches.clear()
    with (
        serving(scorer, threaded=False) as server,
        dealer(server.address) as a,
        dealer(server.address) as b,
    ):
        send(a, ScoreRequest(request_id=1, items=_items(3, "a")), "server_0")
        send(b, ScoreRequest(request_id=2, items=_items(2, "b")), "client")
        time.sleep(0.5)  # both arrive before the server looks
        server.poll_once(1.0)
        first, second = recv(a), recv(b)
    assert isinstance(first, Scores) and isinstance(second, Scores)
    assert (first.request_id, len(first.scores)) == (1, 3)
    assert (second.request_id, len(second.scores)) == (2, 2)
    assert scorer.batches == [5] and server.stats()["batches"] == 1
    together = scorer.inner.score(_items(3, "a") + _items(2, "b"))
    assert first.scores + second.scores == pytest.approx([s for s, _ in together], abs=1e-5)


def test_a_scorer_that_raises_fails_its_batch_not_the_server(scorer):
    class Broken:
        def __init__(self) -> None:
            self.calls = 0

        def score(self, items: list[ScoreItem]) -> list[Scored]:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("out of memory")
            return scorer.score(items)

    with serving(Broken()) as server, dealer(server.address) as sock:  # type: ignore[arg-type]
        reply = ask(sock, ScoreRequest(request_id=1, items=_items(1, "x")), "server_0")
        assert isinstance(reply, Error) and "out of memory" in reply.reason
        reply = ask(sock, ScoreRequest(request_id=2, items=_items(1, "x")), "server_0")
        assert isinstance(reply, Scores) and reply.errors == [""]
    assert server.stats()["batch_failures"] == 1 and accounted(server.stats())


def test_the_entry_point_serves_until_sigterm_then_writes_its_stats(tmp_path, scorer):
    """`python -m asyncrl.launch.worker reward_model SPEC --index 1`, as the local launcher
    starts it (config.yaml and launch.json in the run directory, the run secret in its
    environment)."""
    model_dir = tmp_path / "rm"
    scorer.inner.model.save_pretrained(model_dir)
    scorer.inner.tokenizer.save_pretrained(model_dir)
    address = tcp_address("127.0.0.1", free_port())
    spec = RunSpec(
        run_dir=str(tmp_path),
        model_path=str(model_dir),
        replay_address="tcp://127.0.0.1:1",
        sync_host="127.0.0.1",
        sync_port=0,
        learner_master_port=0,
        threads=1,
        reward_model_addresses=("tcp://127.0.0.1:1", address),
    )
    spec.save(tmp_path / "launch.json")
    cfg = load_config(None, [f"reward.model.path={model_dir}", "reward.model.device=auto"])
    (tmp_path / "config.yaml").write_text(config_to_yaml(cfg))
    env = {**os.environ, SECRET_ENV: SECRET.hex()}
    worker = [sys.executable, "-m", "asyncrl.launch.worker", "reward_model"]
    argv = [*worker, str(tmp_path / "launch.json"), "--index", "1"]
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with dealer(address) as sock:
            items = _items(2, "entry")
            send(sock, ScoreRequest(request_id=9, items=items), "server_0")
            assert sock.poll(60_000), "the server did not start and answer"
            reply = recv(sock)
        assert isinstance(reply, Scores) and reply.request_id == 9
        assert reply.scores == pytest.approx([s for s, _ in scorer.inner.score(items)], abs=1e-5)
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0, out.decode()[-2000:]
    stats = json.loads((tmp_path / "stats" / "reward_model_1.json").read_text())
    assert stats["requests"] == 1 and stats["items"] == 2 and accounted(stats)
    assert b"reward-model server 1 done: 1 requests, 2 items" in out


def test_a_judge_without_a_score_in_its_answer_is_counted_and_scored_zero(scorer):
    """A tiny random judge never writes 'Score: N': each item is an error, scored 0 and
    counted (`score_errors`), and the request is still answered in full."""
    torch.manual_seed(0)
    tokenizer = scorer.inner.tokenizer
    judge_model = LlamaForCausalLM(copy.deepcopy(scorer.inner.model.config))
    cfg = RewardModelConfig(kind="judge", max_new_tokens=2, max_length=64, answer_prefix="")
    judge = JudgeScorer(judge_model.eval(), tokenizer, cfg)
    with serving(judge) as server, dealer(server.address) as sock:  # type: ignore[arg-type]
        reply = ask(sock, ScoreRequest(request_id=4, items=_items(2, "judge")), "client")
    assert isinstance(reply, Scores) and reply.scores == [0.0, 0.0]
    assert all(e.startswith("no score in the judge's answer") for e in reply.errors)
    assert server.stats()["score_errors"] == 2
