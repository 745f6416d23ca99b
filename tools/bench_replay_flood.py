"""Heartbeat latency of the replay while a client floods it with maximal evaluation parts, and
the replay's memory with as many maximal jobs open as it allows (issue 30's acceptance).

    python tools/bench_replay_flood.py [--seconds 20] [--eval-jobs-mb 1024] [--junk-mb 59]
                                        [--part prompts|empty-lists|lists-in-bound]

The replay runs in a child process (as in a run). A flooding client sends, back to back, the
largest part a client may send (`replay.max_client_message_mb`) made of tiny prompts (the
costliest to decode per byte), each part of a new or a still-open job, and now and then a
`--junk-mb` message (refused on its size alone). `--part empty-lists` sends instead one prompt
whose extra_info is as many empty lists as the size limit lets through (1 byte each: refused on
its value count, `codec.BYTES_PER_NODE`, after it is unpacked); `lists-in-bound`, the most empty
lists a part may hold and be accepted (the costliest accepted part in memory per byte). A server's client sends a heartbeat every
0.1 s and times each answer. Printed: heartbeat latency p50/p99/max, how many parts were
accepted and refused, the memory charged to evaluation jobs and the replay's peak RSS before
and after (its `Stats`).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from asyncrl.config import Config
from asyncrl.wire.auth import MAX_AUTH_FRAME, Keyring
from asyncrl.wire.codec import BYTES_PER_NODE, encode
from asyncrl.wire.protocol import ChatMessage, EvalSubmit, Heartbeat, PromptItem, StatsRequest
from asyncrl.wire.replay_client import EVAL_PART_BYTES, eval_parts
from asyncrl.wire.sockets import decode_signed, free_port, tcp_address
from asyncrl.wire.validation import ProtocolError

if TYPE_CHECKING:
    from multiprocessing.synchronize import Event

SECRET = bytes(range(32))


def _serve(cfg: Config, address: str, stop: Event) -> None:
    from replay.service import setup_replay_service

    service = setup_replay_service(cfg, address, None, secret=SECRET)
    thread = threading.Thread(target=service.run, args=(stop,), daemon=True)
    thread.start()
    thread.join()
    service.close()


def _maximal_part(job: str, more: bool) -> list[bytes]:
    prompts = [
        PromptItem(f"{job}/p0000/{i}", 1, "", [ChatMessage("user", "")], "", {}, eval_job=job)
        for i in range(3000)
    ]
    part = eval_parts(job, prompts, EVAL_PART_BYTES)[0]
    return [bytes(f) for f in encode(EvalSubmit(1, job, part.prompts, more=more))]


def _lists_part(job: str, more: bool, in_bound: bool) -> list[bytes]:
    """One prompt of empty lists: as many as the client size limit (`in_bound`: the value
    bound, `BYTES_PER_NODE`) lets through."""
    limit = int(Config().replay.max_client_message_mb * 2**20)

    def frames(n: int) -> list[bytes]:
        p = PromptItem(f"{job}/p0000/0", 1, "", [], "", {"a": [[]] * n}, eval_job=job)
        return [bytes(f) for f in encode(EvalSubmit(1, job, [p], more=more))]

    n = limit // BYTES_PER_NODE - 100 if in_bound else limit - 300
    while sum(map(len, frames(n))) + MAX_AUTH_FRAME > limit:
        n -= 50
    return frames(n)


def _flood(
    address: str,
    keys: Keyring,
    base: dict[str, list[bytes]],
    stop: threading.Event,
    junk_mb: float,
    out: dict,
) -> None:
    """Maximal parts back to back, signed as a client, each of one of 64 jobs (the `base`
    parts renamed), and every 20th a `junk_mb` message; answers are read and counted."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(address)
    key = keys.key("client")
    jobs = [f"flood{j:02d}" for j in range(64)]
    junk = [b"\0" * int(junk_mb * 2**20)]
    for n in itertools.count():
        if stop.is_set():
            break
        if n % 20 == 19:
            frames = junk
        else:
            job = jobs[n % len(jobs)]
            frames = base[jobs[n % 4]]
            # this job's next part: the job and part named in the header's bytes (same lengths)
            header = frames[0].replace(jobs[n % 4].encode(), job.encode())
            frames = [header.replace(b"/p0000/", f"/p{n % 10000:04d}/".encode()), *frames[1:]]
        sock.send_multipart([key.sign(frames), *frames])
        try:
            reply = decode_signed(sock.recv_multipart(), key) if sock.poll(30000) else None
            kind = type(reply).__name__ if reply is not None else "timeout"
        except ProtocolError as e:  # the replay's unsigned answer to an oversized message
            kind = "oversized" if "oversized" in str(e) else "error"
        out[kind] = out.get(kind, 0) + 1
    sock.close(linger=0)


def _stats(sock: zmq.Socket, keys: Keyring) -> dict[str, float]:
    key = keys.key("client")
    frames = encode(StatsRequest(1))
    sock.send_multipart([key.sign(frames), *frames])
    return decode_signed(sock.recv_multipart(), key).counters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--eval-jobs-mb", type=float, default=1024.0)
    ap.add_argument("--junk-mb", type=float, default=59.0)
    ap.add_argument(
        "--part", choices=["prompts", "empty-lists", "lists-in-bound"], default="prompts"
    )
    args = ap.parse_args()
    cfg = Config.model_validate({"replay": {"eval_jobs_mb": args.eval_jobs_mb}})
    address = tcp_address("127.0.0.1", free_port())
    stop_replay = mp.get_context("spawn").Event()
    child = mp.get_context("spawn").Process(target=_serve, args=(cfg, address, stop_replay))
    child.start()
    keys = Keyring(SECRET, cfg.rollout.num_servers)
    server = keys.key("server_0")
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(address)
    before = _stats(sock, keys)
    if args.part == "prompts":
        base = {f"flood{j:02d}": _maximal_part(f"flood{j:02d}", more=True) for j in range(4)}
        what = f"{len(base['flood00'][0]) // 60} tiny prompts or so"
    else:
        in_bound = args.part == "lists-in-bound"
        base = {f"flood{j:02d}": _lists_part(f"flood{j:02d}", True, in_bound) for j in range(4)}
        what = "one prompt of empty lists"
    print(f"a maximal part: {sum(map(len, base['flood00']))} bytes, {what}")
    stop = threading.Event()
    replies: dict[str, Any] = {}
    flood_args = (address, keys, base, stop, args.junk_mb, replies)
    flood = threading.Thread(target=_flood, args=flood_args)
    flood.start()
    latencies = []
    end = time.monotonic() + args.seconds
    for i in itertools.count(1):
        if time.monotonic() > end:
            break
        frames = encode(Heartbeat(i, 0, 0))
        sent = time.monotonic()
        sock.send_multipart([server.sign(frames), *frames])
        assert sock.poll(60000), "no heartbeat answer within 60 s"
        decode_signed(sock.recv_multipart(), server)
        latencies.append(time.monotonic() - sent)
        time.sleep(0.1)
    stop.set()
    flood.join()
    after = _stats(sock, keys)
    stop_replay.set()
    child.join(10)
    ms = np.asarray(latencies) * 1000
    print(f"heartbeats answered: {len(ms)} under a flood of {replies} replies to the flood")
    print(
        f"heartbeat latency ms: p50 {np.percentile(ms, 50):.1f}  p99 "
        f"{np.percentile(ms, 99):.1f}  max {ms.max():.1f}"
    )
    print(
        f"parts accepted (eval_jobs) {after['eval_jobs']:.0f}, refused on quota "
        f"{after['rejected_quota']:.0f}, oversized {after['rejected_oversized']:.0f}, "
        f"malformed {after['rejected_malformed']:.0f}, invalid {after['rejected_invalid']:.0f}"
    )
    print(
        f"eval jobs charged {after['eval_jobs_held_mb']:.1f} MiB of replay.eval_jobs_mb="
        f"{args.eval_jobs_mb:g}; replay peak RSS {before['peak_rss_mb']:.0f} MiB before, "
        f"{after['peak_rss_mb']:.0f} MiB after (+{after['peak_rss_mb'] - before['peak_rss_mb']:.0f})"
    )


if __name__ == "__main__":
    main()
