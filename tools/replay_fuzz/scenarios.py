"""Semantic cases: messages that decode, but whose meaning is hostile to the replay's state.

Each case is one or a few valid-looking messages: a trajectory with arrays of unequal length (for
a training group the fuzzer was leased, and for an evaluation group it submitted in the same
case), a sample index outside its group, a checkpoint path through a regular file or outside the
run directory, an evaluation job of 10**12 samples or thousands of prompts, a lease request for
2**63-1 groups, a version of 10**9, a batch of 2**63-1 groups, resends and duplicates, and now and
then plain valid work (a group completed and a batch asked for).

Every case is a function `(rng, ctx, case) -> (messages, description)`, each message a message
object or its frames; `SCENARIOS` lists them.
Paths written by checkpoint requests all lie under `ctx.scratch` (the campaign also refuses to
send any message that would write elsewhere: see `cases.writes_outside`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from asyncrl.wire import protocol as P
from asyncrl.wire import samples as S
from asyncrl.wire.codec import encode

from .examples import Context, eval_submit, prompt_item, trajectory

Case = tuple[list[Any], str]
HUGE = [2**63 - 1, -(2**63), 2**64 - 1, 10**12, 10**9, -1]


def _twists(r: int, rng: random.Random) -> dict[str, Callable[[], dict[str, Any]]]:
    """Field overrides that make a sample of `r` response tokens untrainable (or just odd),
    each made only when chosen."""
    response = [
        ("response_ids", np.int32),
        ("loss_mask", np.uint8),
        ("behaviour_logprobs", np.float32),
        ("versions", np.int32),
    ]
    return {
        "uneven versions": lambda: {"versions": np.zeros(r + 1, np.int32)},
        "uneven mask": lambda: {"loss_mask": np.ones(max(r - 1, 0), np.uint8)},
        "uneven logprobs": lambda: {"behaviour_logprobs": np.zeros(r + 2, np.float32)},
        # reshaped in the header below (codec.encode sends 1-D arrays only)
        "0-d arrays": lambda: {k: np.ones(1, dt) for k, dt in response},
        "2-D arrays": lambda: {k: np.ones(2 * (r + 1), dt) for k, dt in response},
        "empty arrays": lambda: {
            k: np.zeros(0, dt) for k, dt in [*response, ("prompt_ids", np.int32)]
        },
        "mask of 2s": lambda: {"loss_mask": np.full(r, 2, np.uint8)},
        "negative versions": lambda: {"versions": np.full(r, -7, np.int32)},
        "NaN log-probs": lambda: {"behaviour_logprobs": np.full(r, np.nan, np.float32)},
        "NaN reward": lambda: {"reward": float("nan")},
        "infinite reward": lambda: {"reward": float("-inf")},
        "empty ids": lambda: {"traj_id": "", "group_id": ""},
        "huge metrics": lambda: {"metrics": {f"m{i}": float(i) for i in range(5000)}},
        "huge traj_id": lambda: {"traj_id": "t" * 100_000},
        "huge attempt": lambda: {"attempt": rng.choice(HUGE)},
        "odd server": lambda: {"server_id": rng.choice(HUGE)},
    }


def _target(rng: random.Random, ctx: Context, case: str) -> tuple[list[Any], tuple[str, int]]:
    """A group to send a sample to: a training group leased to the fuzzer, or an evaluation
    group submitted in this very case (so the case reproduces on a fresh replay)."""
    picked = ctx.pick_group(rng)
    if picked and rng.random() < 0.5:
        return [], (picked[0], picked[2])
    submit = eval_submit(rng, ctx, f"job-{case}", prompts=1)
    return [submit], (submit.prompts[0].group_id, 0)


def bad_sample(rng: random.Random, ctx: Context, case: str) -> Case:
    before, group = _target(rng, ctx, case)
    base = trajectory(rng, ctx, group)
    name, override = rng.choice(list(_twists(len(base.response_ids), rng).items()))
    where = "evaluation" if before else "training"
    sample: Any = dataclasses.replace(base, **override())
    if name in ("0-d arrays", "2-D arrays"):  # codec.encode sends 1-D only: edit the header
        sample = [bytes(f) for f in encode(sample)]
        header = msgpack.unpackb(sample[0])
        for spec in header["arrays"]:
            if spec[0] != "prompt_ids":
                spec[2] = [] if name == "0-d arrays" else [spec[2][0] // 2, 2]
        sample[0] = msgpack.packb(header)
    return [*before, sample], f"{where} sample with {name}"


def index_out_of_range(rng: random.Random, ctx: Context, case: str) -> Case:
    before, group = _target(rng, ctx, case)
    index = rng.choice([*HUGE, ctx.n, 1024])
    traj = trajectory(rng, ctx, group, sample_index=index)
    return [*before, traj], f"sample_index {index} ({'evaluation' if before else 'training'})"


def resend(rng: random.Random, ctx: Context, case: str) -> Case:
    before, group = _target(rng, ctx, case)
    traj = trajectory(rng, ctx, group)
    again = dataclasses.replace(traj, attempt=1, reward=rng.choice([0.0, float("nan")]))
    other = dataclasses.replace(traj, traj_id=traj.traj_id + "-other")  # same slot, new id
    return [*before, traj, again, other], "a sample, its resend, and another id for its slot"


def checkpoint_paths(ctx: Context) -> list[str]:
    s, run = ctx.scratch, ctx.run_dir
    return [
        str(s / "a-file" / "replay.json"),  # through a regular file
        str(s / "a-file" / "deeper" / "replay.json"),
        str(s / "outside-run" / "replay.json"),  # outside the run directory
        str(run / ".." / "escaped.json"),
        str(run),  # a directory
        str(run) + "/",
        str(run / "x\x00y.json"),
        str(run / ("n" * 300 + ".json")),  # a name longer than NAME_MAX
        str(run / "/".join(["d"] * 2100)),  # a path longer than PATH_MAX
        "",
        ".",
        "relative.json",
        "deep/relative/dir/replay.json",
        str(s / "a-file"),
    ]


def checkpoint(rng: random.Random, ctx: Context, case: str) -> Case:
    path = rng.choice(checkpoint_paths(ctx))
    version = rng.choice([ctx.version, *HUGE])
    msg = P.CheckpointRequest(request_id=rng.randrange(1 << 20), path=path, version=version)
    return [msg], f"checkpoint to {path[:80]!r} at version {version}"


def hostile_eval_job(rng: random.Random, ctx: Context, case: str) -> Case:
    job = f"job-{case}"
    submit = eval_submit(rng, ctx, job)
    variant = rng.choice(
        ["n", "n", "overflow", "many", "duplicate", "mismatch", "collide", "empty"]
    )
    prompts = submit.prompts
    if variant == "n":
        n = rng.choice([*HUGE, 0])
        prompts = [dataclasses.replace(p, n=n) for p in prompts]
    elif variant == "overflow":  # the job's expected sample count leaves int64 and uint64
        n = rng.choice([2**63 - 1, -(2**63)])
        prompts = [dataclasses.replace(prompts[0], n=n, group_id=f"{job}/{k}") for k in range(3)]
    elif variant == "many":  # packed here: encoding thousands of PromptItems is slow
        many = dataclasses.replace(submit, prompts=[prompt_item(rng, "", 1, job)])
        header = msgpack.unpackb(encode(many)[0])
        one = header["fields"]["prompts"][0]
        k = rng.choice([300, 2_000])
        header["fields"]["prompts"] = [{**one, "group_id": f"{job}/{j}"} for j in range(k)]
        poll = P.EvalPoll(request_id=rng.randrange(1 << 20), job_id=job)
        return [[msgpack.packb(header)], poll], f"evaluation job: {k} prompts, then a poll"
    elif variant == "duplicate" and ctx.eval_jobs:
        job = rng.choice(list(ctx.eval_jobs))
        prompts = [dataclasses.replace(p, eval_job=job) for p in prompts]
    elif variant == "mismatch":
        prompts = [*prompts, dataclasses.replace(prompts[0], eval_job="", group_id=f"{job}/x")]
    elif variant == "collide" and ctx.groups:  # an evaluation group named like a training one
        prompts = [dataclasses.replace(prompts[0], group_id=next(reversed(ctx.groups)))]
    elif variant == "empty":
        prompts = []
    ctx.remember_eval_job(job, prompts)
    msgs: list[Any] = [dataclasses.replace(submit, job_id=job, prompts=prompts)]
    msgs.append(P.EvalPoll(request_id=rng.randrange(1 << 20), job_id=job))
    return msgs, f"evaluation job: {variant} ({len(prompts)} prompts), then a poll"


def hostile_request(rng: random.Random, ctx: Context, case: str) -> Case:
    """A lease, batch or version request with an extreme value."""
    value = rng.choice(HUGE)
    kind = rng.choice(
        ["max_groups", "server_version", "floats", "num_groups", "learner", "version"]
    )
    rid = rng.randrange(1 << 20)
    if kind in ("max_groups", "server_version", "floats"):
        nan, inf = float("nan"), float("inf")
        floats = (nan, inf, -inf) if kind == "floats" else (1.0, 1.0, 2.0)
        msg: Any = P.LeaseRequest(
            rid,
            server_id=rng.choice([0, *HUGE]),
            server_version=value if kind == "server_version" else ctx.version,
            max_groups=value if kind == "max_groups" else 2,
            engine_busy_s=floats[0],
            weight_apply_s=floats[1],
            uptime_s=floats[2],
        )
    elif kind == "num_groups":
        msg = S.BatchRequest(rid, ctx.version, rng.choice([*HUGE, 0, ctx.capacity_groups + 1]))
    elif kind == "learner":
        msg = S.BatchRequest(rid, value, ctx.batch_groups)
    else:  # a version far ahead (or behind), then the fuzzer's own version again
        back = P.VersionUpdate(rid + 1, ctx.version)
        return [P.VersionUpdate(rid, value), back], f"version {value}, then back"
    return [msg], f"{type(msg).__name__} with extreme {kind} ({value})"


def valid_work(rng: random.Random, ctx: Context, case: str) -> Case:
    """Complete a leased group with valid samples, ask for leases and a batch (valid traffic)."""
    msgs: list[Any] = []
    picked = ctx.pick_group(rng)
    if picked:
        group_id, n, index = picked
        msgs += [trajectory(rng, ctx, (group_id, i)) for i in range(index, n)]
        ctx.groups.pop(group_id, None)
    msgs.append(P.LeaseRequest(rng.randrange(1 << 20), 0, ctx.version, ctx.batch_groups))
    msgs.append(S.BatchRequest(rng.randrange(1 << 20), ctx.version, ctx.batch_groups))
    return msgs, f"valid work ({len(msgs)} messages)"


SCENARIOS: dict[str, tuple[float, Callable[[random.Random, Context, str], Case]]] = {
    "bad_sample": (5, bad_sample),
    "index_out_of_range": (2, index_out_of_range),
    "resend": (1, resend),
    "checkpoint": (2, checkpoint),
    "hostile_eval_job": (2, hostile_eval_job),
    "hostile_request": (3, hostile_request),
    "valid_work": (4, valid_work),
}
"""name -> (weight, case function)"""
