"""Valid messages of every type the codec knows: the fuzzer's starting points.

Every registered type gets a valid example built from its annotations (ints, floats, strings,
literals, lists, maps, nested structs such as `PromptItem` and `ChatMessage`, free-form JSON
objects, arrays of the declared dtype), so a type added to `asyncrl.wire.protocol` is fuzzed without
touching this file. The requests the replay accepts get builders that know what the fuzzer has
learned of the live replay (`Context`: the groups it was leased, the evaluation jobs it
submitted, the version it published), so valid traffic does real work: leases are granted,
groups complete, batches are served, evaluation jobs collect samples.

Invariant: `valid_message` returns a message that `asyncrl.wire.codec.decode(encode(msg))` accepts
(tests/unit/test_fuzz_messages.py checks it for every registered type and many seeds).
"""

from __future__ import annotations

import functools
import math
import random
import types
import typing
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

import numpy as np

from asyncrl.wire import protocol as P
from asyncrl.wire import samples as S
from asyncrl.wire.validation import ProtocolError
from replay.buffer import to_batch

MAX_KNOWN = 256  # groups and jobs remembered (oldest forgotten first)


@dataclass
class Context:
    """What the fuzzer knows of the live replay, from what it sent and what it was answered."""

    scratch: Path  # everything the replay may write lies under it
    run_dir: Path  # where valid checkpoints go (inside scratch)
    n: int  # rollout.n: samples per training group
    batch_groups: int  # data.train_batch_size: groups per batch
    capacity_groups: int  # replay.capacity_groups
    servers: int = 8  # rollout.num_servers: valid traffic uses ids 0..servers-2, the round trip
    # the last one (so that no quota of a server the fuzzing used applies to it)
    version: int = 0  # the last version the fuzzer's valid traffic published
    groups: OrderedDict[str, list[int]] = field(default_factory=OrderedDict)
    """training group id -> [n, next sample index to send], from the LeaseGrants seen"""
    eval_groups: OrderedDict[str, int] = field(default_factory=OrderedDict)  # group -> n
    eval_jobs: OrderedDict[str, None] = field(default_factory=OrderedDict)  # jobs submitted

    def forget_replay(self) -> None:
        """A new replay process knows none of the old one's groups or jobs."""
        self.version = 0
        self.groups.clear()
        self.eval_groups.clear()
        self.eval_jobs.clear()

    def remember_grant(self, prompts: list[P.PromptItem]) -> None:
        for p in prompts:
            if p.eval_job:
                _remember(self.eval_groups, p.group_id, p.n)
            elif 0 < p.n <= 1024:
                _remember(self.groups, p.group_id, [p.n, 0])

    def remember_eval_job(self, job_id: str, prompts: list[P.PromptItem]) -> None:
        _remember(self.eval_jobs, job_id, None)
        for p in prompts:
            _remember(self.eval_groups, p.group_id, p.n)

    def pick_group(self, rng: random.Random) -> tuple[str, int, int] | None:
        """A training group leased to the fuzzer: (group id, n, next sample index)."""
        if not self.groups:
            return None
        group_id = rng.choice(list(self.groups)[-32:])
        n, index = self.groups[group_id]
        self.groups[group_id][1] = index + 1
        if index + 1 >= n:
            del self.groups[group_id]
        return group_id, n, index


def _remember(store: OrderedDict, key: str, value: Any) -> None:
    store[key] = value
    while len(store) > MAX_KNOWN:
        store.popitem(last=False)


# ---- generic: any type, from its annotations -----------------------------------------------
@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The wire fields of a message or struct and their annotations (ClassVars left out)."""
    hints = get_type_hints(cls, include_extras=True)
    return {k: v for k, v in hints.items() if get_origin(v) is not typing.ClassVar}


def array_dtype(tp: Any) -> str | None:
    """The dtype of an array annotation (`asyncrl.wire.codec.Int32Array`, ...), None for any other annotation."""
    if get_origin(tp) is Annotated:
        meta = get_args(tp)[1]
        if isinstance(meta, tuple) and meta and meta[0] == "array":
            return meta[1]
    return None


def _is_json(tp: Any) -> bool:
    return get_origin(tp) is Annotated and get_args(tp)[1:] == (("json",),)


def random_json(rng: random.Random, depth: int = 0) -> Any:
    """A small JSON value (objects and lists nested a few levels)."""
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-1000, 1000)
    if kind == 3:
        return rng.choice([0.5, -2.25, 1e300, 3.0])
    if kind == 4:
        return rng.choice(["", "x", "ground truth", "ünïcødé", "a" * 40])
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    return {f"k{i}": random_json(rng, depth + 1) for i in range(rng.randint(0, 3))}


def random_array(dtype: str, rng: random.Random, length: int | None = None) -> np.ndarray:
    length = rng.randint(0, 8) if length is None else length
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return np.asarray([rng.uniform(-5, 0) for _ in range(length)], dt)
    high = 2 if dt == np.uint8 else 50_000
    return np.asarray([rng.randrange(high) for _ in range(length)], dt)


def valid_value(tp: Any, rng: random.Random) -> Any:
    """A valid value of annotation `tp`."""
    dtype = array_dtype(tp)
    if dtype is not None:
        return random_array(dtype, rng)
    if _is_json(tp):
        return random_object(rng)
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return rng.choice(args)
    if origin in (typing.Union, types.UnionType):  # an optional field: either of its types
        return valid_value(rng.choice(args), rng)
    if origin is list:
        return [valid_value(args[0], rng) for _ in range(rng.randint(0, 3))]
    if origin is dict:
        return {valid_value(args[0], rng): valid_value(args[1], rng) for _ in range(3)}
    if isinstance(tp, type) and is_dataclass(tp):
        return tp(**{k: valid_value(v, rng) for k, v in field_types(tp).items()})
    simple: dict[Any, Callable[[], Any]] = {  # small, positive, non-empty: inside any bound
        type(None): lambda: None,
        bool: lambda: rng.random() < 0.5,
        int: lambda: rng.randint(1, 100),
        float: lambda: rng.choice([0.0, 1.0, 0.5, 3.25]),
        str: lambda: rng.choice(["a", "stop", "user", "x" * 30]),
        bytes: lambda: rng.randbytes(rng.randint(1, 64)),
    }
    if tp in simple:
        return simple[tp]()
    raise TypeError(f"no valid value known for annotation {tp!r}")


def generic_message(cls: type, rng: random.Random) -> Any:
    """A valid instance of any registered message type, from its annotations (drawn again, a
    few times, while the type's own `validate()`, where it has one, refuses it)."""
    for _ in range(20):
        msg = cls(**{k: valid_value(tp, rng) for k, tp in field_types(cls).items()})
        try:
            getattr(msg, "validate", lambda: None)()
        except ProtocolError:
            continue
        return msg
    return msg


def _eval_results(rng: random.Random, ctx: Context, case: str) -> Any:
    s = rng.randint(0, 3)
    return P.EvalResults(
        request_id=_request_id(rng),
        job_id=f"job-{case}",
        expected=s + rng.randint(0, 3),
        group_ids=[f"job-{case}/g{i}" for i in range(s)],
        data_sources=["fuzz"] * s,
        scores=random_array("float32", rng, s),
        response_lengths=random_array("int32", rng, s),
        versions=random_array("int32", rng, s),
    )


# ---- the replay's requests, valid and meaningful --------------------------------------------
def prompt_item(rng: random.Random, group_id: str, n: int, eval_job: str = "") -> P.PromptItem:
    roles = ["system", "user", "assistant", "tool"]
    return P.PromptItem(
        group_id=group_id,
        n=n,
        data_source=rng.choice(["asyncrl/arith", "openai/gsm8k", "fuzz"]),
        messages=[
            P.ChatMessage(role=rng.choice(roles), content=f"{rng.randint(0, 99)}+1=")
            for _ in range(rng.randint(1, 3))
        ],
        ground_truth=str(rng.randint(0, 100)),
        extra_info=random_object(rng),
        agent_name=rng.choice(["", "single_turn", "tool"]),
        tools_kwargs=random_object(rng),
        interaction_kwargs=random_object(rng),
        eval_job=eval_job,
        temperature=rng.choice([None, 0.0, 0.7]),
    )


def trajectory(
    rng: random.Random, ctx: Context, group: tuple[str, int] | None = None, **override: Any
) -> S.Trajectory:
    """A trainable sample of `group` (id, sample index), else of a group leased to the fuzzer,
    else of an unknown group (answered `late`); `override` replaces fields."""
    picked = ctx.pick_group(rng) if group is None else (group[0], 0, group[1])
    group_id, index = (picked[0], picked[2]) if picked else (f"unknown-{rng.randrange(99)}", 0)
    r = rng.randint(0, 12)
    mask = np.asarray([rng.random() < 0.8 for _ in range(r)], np.uint8)
    fields: dict[str, Any] = dict(
        traj_id=f"{group_id}/{index}/{rng.randrange(1 << 30)}",
        attempt=0,
        group_id=group_id,
        sample_index=index,
        server_id=rng.randrange(ctx.servers - 1),
        prompt_ids=random_array("int32", rng),
        response_ids=random_array("int32", rng, r),
        loss_mask=mask,
        behaviour_logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
        versions=np.where(mask == 1, ctx.version, -1).astype(np.int32),
        reward=rng.choice([0.0, 1.0, -1.0, 0.5]),
        baseline_reward=rng.choice([math.nan, 0.0, 1.0]),
        finish_reason=rng.choice(["stop", "length", "tool"]),
        metrics={f"m{i}": rng.random() for i in range(rng.randint(0, 3))},
    )
    fields.update(override)
    return S.Trajectory(**fields)


def trajectories(rng: random.Random, ctx: Context) -> S.Trajectories:
    """One to four samples of one server in one message (as a server sends a turn's samples)."""
    server = rng.randrange(ctx.servers - 1)
    return S.Trajectories.pack(
        [trajectory(rng, ctx, server_id=server) for _ in range(rng.randint(1, 4))]
    )


def eval_submit(rng: random.Random, ctx: Context, job_id: str, prompts: int = 0) -> P.EvalSubmit:
    """A valid evaluation job (remembered in `ctx`: its groups get samples later)."""
    k = prompts or rng.randint(1, 3)
    items = [prompt_item(rng, f"{job_id}/g{j}", rng.randint(1, 3), job_id) for j in range(k)]
    ctx.remember_eval_job(job_id, items)
    return P.EvalSubmit(request_id=rng.randrange(1 << 20), job_id=job_id, prompts=items)


def _request_id(rng: random.Random) -> int:
    return rng.randrange(1 << 31)


def _lease_request(rng: random.Random, ctx: Context, case: str) -> Any:
    return P.LeaseRequest(
        request_id=_request_id(rng),
        server_id=rng.randrange(ctx.servers - 1),
        server_version=ctx.version,
        max_groups=rng.randint(0, 4),
        engine_busy_s=rng.uniform(0, 100),
        weight_apply_s=rng.uniform(0, 10),
        uptime_s=rng.uniform(100, 200),
    )


def _version_update(rng: random.Random, ctx: Context, case: str) -> Any:
    ctx.version += int(rng.random() < 0.3)
    return P.VersionUpdate(request_id=_request_id(rng), version=ctx.version)


def _eval_poll(rng: random.Random, ctx: Context, case: str) -> Any:
    jobs = list(ctx.eval_jobs)
    job = rng.choice(jobs) if jobs and rng.random() < 0.8 else f"no-such-job-{rng.randrange(9)}"
    return P.EvalPoll(request_id=_request_id(rng), job_id=job)


def _group_failed(rng: random.Random, ctx: Context, case: str) -> Any:
    known = list(ctx.groups)[-32:] + list(ctx.eval_groups)[-8:]
    group = rng.choice(known) if known and rng.random() < 0.8 else f"unknown-{rng.randrange(99)}"
    server_id = rng.randrange(ctx.servers - 1)
    return P.GroupFailed(_request_id(rng), server_id, group, f"fuzzed failure {case}")


BUILDERS: dict[type, Callable[[random.Random, Context, str], Any]] = {
    P.LeaseRequest: _lease_request,
    S.Trajectory: lambda rng, ctx, case: trajectory(rng, ctx),
    S.Trajectories: lambda rng, ctx, case: trajectories(rng, ctx),
    S.BatchRequest: lambda rng, ctx, case: S.BatchRequest(
        _request_id(rng), ctx.version, rng.randint(1, ctx.batch_groups)
    ),
    P.VersionUpdate: _version_update,
    P.StatsRequest: lambda rng, ctx, case: P.StatsRequest(_request_id(rng)),
    P.EvalSubmit: lambda rng, ctx, case: eval_submit(rng, ctx, f"job-{case}"),
    P.EvalPoll: _eval_poll,
    P.GroupFailed: _group_failed,
    P.CheckpointRequest: lambda rng, ctx, case: P.CheckpointRequest(
        _request_id(rng), str(ctx.run_dir / f"replay-{rng.randrange(4)}.json"), ctx.version
    ),
    # answers, which the replay must refuse: consistent lengths, as their senders make them
    S.Batch: lambda rng, ctx, case: to_batch(_request_id(rng), [], 0),
    S.Acks: lambda rng, ctx, case: S.Acks(["a", "b"], ["accepted", "late"]),
    P.EvalResults: _eval_results,
}
"""The replay's requests and the answers whose fields must agree; `case` names the case
(unique job ids are made from it)."""


def valid_message(cls: type, rng: random.Random, ctx: Context, case: str) -> Any:
    """A valid message of type `cls`: meaningful for the replay's requests, else generic."""
    builder = BUILDERS.get(cls)
    return builder(rng, ctx, case) if builder else generic_message(cls, rng)
