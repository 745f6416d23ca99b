"""Throughput of one reward-model server (`reward_models/`) at 1, 8 and 32 concurrent clients.

    python tools/reward_model_bench.py [--model DIR] [--seconds 10] [--concurrency 1 8 32]
                                       [--device cpu|cuda|auto] [--max-batch 32] [--threads 2]

The server runs in a child process, as the local launcher starts it: `python -m
asyncrl.launch.worker reward_model RUN_DIR/launch.json --index 0`, with a RunSpec and a
config.yaml written here (one loopback address in `reward_model_addresses`) and the run secret in
its environment, stopped by SIGTERM. Each client is one asyncio DEALER signed with the run's
`client` key that sends a `ScoreRequest` of one item, waits for its `Scores`, checks it (signed
by the server, same request id, no error) and sends the next; every level runs `--seconds`
after a warm-up request. Requests of concurrent clients that wait together are scored in one
batch, so items/s should rise with concurrency until a batch fills (`reward.model.max_batch`).
Printed: a table of requests/s, items/s and the latency p50/p99 per level.

Without `--model`, the embedded reward model (`asyncrl.demo.reward_model`) is built in the
cache directory (`--cache`); the items are `arith` prompts with right and wrong answers.

Measured (issue 33; the embedded reward model of `python -m asyncrl.demo.reward_model
--seed 0`, CPU, `--seconds 8`, default `--threads 2`, three runs on the 2-core machine, the
clients on the same cores): 1 client 171, 215, 183 requests/s (p50 4-6 ms); 8 clients 550,
616, 537/s; 32 clients 894, 1083, 1593/s (p99 41-64 ms). One item per request, so items/s is
the same; over one run's three levels the server scored 12,949 items in 2,590 batches.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

from asyncrl.config import config_to_yaml, load_config
from asyncrl.demo.tasks import ARITH_SOURCE, ArithmeticTask
from asyncrl.run_spec import RunSpec
from asyncrl.wire.auth import SECRET_ENV, RoleKey, new_secret, role_key
from asyncrl.wire.protocol import ChatMessage
from asyncrl.wire.reward_protocol import ScoreItem, ScoreRequest, Scores
from asyncrl.wire.sockets import decode_signed, free_port, send_msg, setup_socket, tcp_address

REPLY_TIMEOUT_S = 120.0
"""A reply slower than this (the first one includes loading the model) fails the bench."""


@dataclass
class Level:
    """What one concurrency level measured."""

    concurrency: int
    seconds: float
    requests: int
    items: int
    latencies_s: list[float]


def start_server(
    model: Path, run_dir: Path, secret: bytes, args: argparse.Namespace
) -> tuple[subprocess.Popen[bytes], str]:
    """The reward-model server as a child process, and its address."""
    address = tcp_address("127.0.0.1", free_port())
    spec = RunSpec(
        run_dir=str(run_dir),
        model_path=str(model),
        replay_address="",
        sync_host="127.0.0.1",
        sync_port=0,
        learner_master_port=0,
        threads=args.threads,
        reward_model_addresses=(address,),
    )
    spec.save(run_dir / "launch.json")
    overrides = [
        f"reward.model.path={model}",
        f"reward.model.device={args.device}",
        f"reward.model.max_batch={args.max_batch}",
    ]
    (run_dir / "config.yaml").write_text(config_to_yaml(load_config(None, overrides)))
    log = (run_dir / "reward_model_0.log").open("wb")
    worker = [sys.executable, "-m", "asyncrl.launch.worker", "reward_model"]
    child = subprocess.Popen(  # as the local launcher starts it
        [*worker, str(run_dir / "launch.json"), "--index", "0"],
        env={**os.environ, SECRET_ENV: secret.hex()},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return child, address


def arith_items(seed: int) -> list[ScoreItem]:
    """Every `arith` question with its right answer and with a wrong one, shuffled."""
    task, rng = ArithmeticTask(), random.Random(seed)
    items = []
    for row in task.val_rows():
        truth = row["reward_model"]["ground_truth"]
        prompt = [ChatMessage(m["role"], m["content"]) for m in row["prompt"]]
        for answer in (truth, str(int(truth) + rng.choice([-1, 1, 2]))):
            items.append(ScoreItem(prompt, answer, ARITH_SOURCE, truth))
    rng.shuffle(items)
    return items


async def one_client(
    ctx: zmq.asyncio.Context,
    address: str,
    key: RoleKey,
    items: list[ScoreItem],
    ids: itertools.count[int],
    deadline: float,
    latencies: list[float],
    max_requests: int | None = None,
) -> None:
    """Request, await, check, repeat until `deadline` or `max_requests` (each request of one
    item)."""
    sock = setup_socket(ctx, zmq.DEALER, connect=address)
    try:
        for n, item in enumerate(itertools.cycle(items)):
            if time.perf_counter() >= deadline or n == max_requests:
                return
            request_id = next(ids)
            start = time.perf_counter()
            await send_msg(sock, ScoreRequest(request_id, [item]), auth=key)
            frames = await asyncio.wait_for(sock.recv_multipart(), REPLY_TIMEOUT_S)
            reply = decode_signed(frames, key)
            if not isinstance(reply, Scores) or reply.request_id != request_id:
                raise RuntimeError(f"request {request_id} got {reply!r}")
            if reply.errors[0]:
                raise RuntimeError(f"request {request_id} was not scored: {reply.errors[0]}")
            latencies.append(time.perf_counter() - start)
    finally:
        sock.close()


async def run_level(
    address: str,
    key: RoleKey,
    items: list[ScoreItem],
    ids: itertools.count[int],
    concurrency: int,
    seconds: float,
) -> Level:
    """`concurrency` clients for `seconds`, drawing request ids from `ids` (one counter for
    the whole bench: ids stay unique and within the wire's int32 bound)."""
    ctx = zmq.asyncio.Context()
    try:
        latencies: list[float] = []
        start = time.perf_counter()
        deadline = start + seconds
        await asyncio.gather(
            *(
                one_client(ctx, address, key, items[i:] + items[:i], ids, deadline, latencies)
                for i in range(concurrency)
            )
        )
        elapsed = time.perf_counter() - start
    finally:
        ctx.destroy(linger=0)  # closes the sockets of clients a failure left waiting
    return Level(concurrency, elapsed, len(latencies), len(latencies), latencies)


async def wait_ready(
    address: str, key: RoleKey, items: list[ScoreItem], ids: itertools.count[int]
) -> None:
    """One request answered: the server has loaded its model and serves."""
    ctx = zmq.asyncio.Context()
    try:
        await one_client(ctx, address, key, items, ids, float("inf"), [], 1)
    finally:
        ctx.destroy(linger=0)  # closes the sockets of clients a failure left waiting


def table(levels: list[Level]) -> str:
    """The printed table: one row per concurrency level."""
    lines = [f"{'clients':>8} {'requests/s':>11} {'items/s':>9} {'p50 ms':>8} {'p99 ms':>8}"]
    for lv in levels:
        lat = np.array(lv.latencies_s) * 1e3 if lv.latencies_s else np.zeros(1)
        lines.append(
            f"{lv.concurrency:>8} {lv.requests / lv.seconds:>11.1f} {lv.items / lv.seconds:>9.1f}"
            f" {np.percentile(lat, 50):>8.1f} {np.percentile(lat, 99):>8.1f}"
        )
    return "\n".join(lines)


def embedded_reward_model(cache: Path) -> Path:
    """The embedded reward model (built on a cache miss: about half a minute on 2 cores)."""
    from asyncrl.demo.reward_model import prepare_reward_model

    return prepare_reward_model(cache, ArithmeticTask(), steps=600, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="classifier directory (default: embedded)")
    parser.add_argument("--cache", type=Path, default=Path(".cache/asyncrl-models"))
    parser.add_argument("--seconds", type=float, default=10.0, help="per concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    args = parser.parse_args()
    model = args.model or embedded_reward_model(args.cache)
    secret = new_secret()
    key = role_key(secret, "client")
    items = arith_items(seed=0)
    ids = itertools.count()
    with tempfile.TemporaryDirectory(prefix="rm-bench-") as tmp:
        child, address = start_server(model, Path(tmp), secret, args)
        try:
            asyncio.run(asyncio.wait_for(wait_ready(address, key, items, ids), REPLY_TIMEOUT_S))
            levels = [
                asyncio.run(run_level(address, key, items, ids, c, args.seconds))
                for c in args.concurrency
            ]
        except BaseException:
            print((Path(tmp) / "reward_model_0.log").read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            child.send_signal(signal.SIGTERM)
            child.wait(timeout=30)
        stats = Path(tmp) / "stats" / "reward_model_0.json"
        server_stats = json.loads(stats.read_text()) if stats.is_file() else {}
    print(f"reward-model server: {model} on {args.device}, max_batch {args.max_batch}")
    print(table(levels))
    if server_stats:
        print("server counters:", json.dumps(server_stats, sort_keys=True))


if __name__ == "__main__":
    main()
