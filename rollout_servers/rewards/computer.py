"""`RewardComputer`: scores responses next to the agent loops, never on the event loop.

Each call runs in a small pool of worker processes (plain `python -c` subprocesses speaking JSON
over a socketpair; `workers`). Whatever goes wrong scores 0.0 and is counted in `failures` by kind:
`exception`, `timeout`, `crash` (the worker died), `non_number`, `non_finite`,
`unknown_data_source`, `not_importable` (a lambda in the registry), `closed`,
`sandbox_unavailable`. A call past its timeout has its worker killed and replaced, so a hanging
reward function costs one timeout, never the pool, and a bad reward function never takes down a
rollout server.

Calls made in the same turn of the event loop (a group's samples finish together) travel as one
batch: one thread hand-off and one message to a worker, which answers item by item as each is
scored. Each item still has its own timeout and its own failure: a batch whose item k hangs or
crashes gets k's failure for k alone, and the items after it run again on the replacement.

A reward that runs model code (`needs_sandbox`, the code reward) takes another path: the server
runs its `SandboxJob` in the one sandbox it shares with the python tool, and the verdict comes
from the reward's trusted `judge` in a worker, as above. A verdict that hit one of the reward's
limits (`truncated`, `judge_limit` in its metrics) is a score, not a failure: it is counted in
`limits` by kind and logged with its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import inspect
import logging
import numbers
import queue
import signal
import sys
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from asyncrl.registry import import_object
from asyncrl.wire.bounds import finite32, plausible_reward
from rollout_servers.rewards.functions import REWARD_FNS, RewardFn, load_custom_reward
from rollout_servers.rewards.workers import _recv, _send, _Worker

log = logging.getLogger("asyncrl.rewards")

FnRef = tuple[str, str, str]
"""How a worker finds a function: ("module", module, qualname) or ("path", file, name)."""
_PR_SET_PDEATHSIG = 1


class SandboxSource(Protocol):
    """Gives the server's one sandbox (built on first use; raises RuntimeError naming what to
    install when its backend is missing)."""

    def get(self) -> Any: ...


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere a no-op).

    For processes that run untrusted or possibly hung code: if whoever supervises them is
    killed, they must not live on."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _fn_ref(fn: RewardFn) -> FnRef:
    qualname = getattr(fn, "__qualname__", "")
    if "<" in qualname or not getattr(fn, "__module__", None):
        raise ValueError(
            f"reward function {fn!r} cannot be imported by a worker process (a lambda or nested "
            "function); define it at module level, or load it with custom_path"
        )
    return ("module", fn.__module__, qualname)


def _resolve(ref: FnRef) -> RewardFn:
    kind, where, name = ref
    if kind == "path":
        return load_custom_reward(where, name)
    return import_object(f"{where}:{name}")


def _plain_result(result: Any) -> tuple[float | None, dict[str, float]]:
    """A reward function's return value -> (score or None when not a number, numeric extras)."""
    extras: dict[str, float] = {}
    if isinstance(result, Mapping):
        extras = {
            str(k): float(v)
            for k, v in result.items()
            if k != "score" and isinstance(v, numbers.Real)
        }
        result = result.get("score")
    return (float(result) if isinstance(result, numbers.Real) else None), extras


def worker_main(fd: int) -> None:
    """A reward worker process: receive a batch of (function ref, kwargs) on socket `fd`, reply
    to each item in order, as soon as it is scored: ("ok", score, extras) or ("exception",
    message, {}). Functions are resolved once and cached. The socket is a private socketpair
    with the parent that started us, never a network socket."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    conn = Connection(fd)
    _send(conn, "ready")
    cache: dict[FnRef, RewardFn] = {}
    while True:
        try:
            batch = _recv(conn)
        except (EOFError, OSError):
            return
        for ref, kwargs in batch:
            ref = tuple(ref)
            try:
                if ref not in cache:
                    cache[ref] = _resolve(ref)
                _send(conn, ("ok", *_plain_result(cache[ref](**kwargs))))
            except (Exception, SystemExit) as e:
                _send(conn, ("exception", f"{type(e).__name__}: {e}", {}))


def _answer(calls: list[tuple[Any, Any, asyncio.Future]], batch: asyncio.Future) -> None:
    """Hand each caller its item of a finished batch (a caller that gave up is skipped)."""
    error = batch.exception() if not batch.cancelled() else RuntimeError("cancelled")
    results = batch.result() if error is None else [("closed", str(error), {})] * len(calls)
    for (_, _, answer), result in zip(calls, results, strict=True):
        if not answer.done():
            answer.set_result(result)


class RewardComputer:
    """Scores responses in worker processes with a timeout; failures score 0 and are counted.

    `custom_path`/`custom_name`: a user's function (verl's custom_reward_function) that scores
    every data_source. `reward_kwargs`: options passed to whichever reward function declares
    them by name (or takes **kwargs), e.g. `format_score`, `partial_credit`, `case_timeout_s`.
    """

    def __init__(
        self,
        timeout_s: float,
        num_workers: int = 2,
        custom_path: str | None = None,
        custom_name: str = "compute_score",
        reward_kwargs: Mapping[str, Any] | None = None,
        sandbox: SandboxSource | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.timeout_s = timeout_s
        self.sandbox = sandbox
        self.failures: Counter[str] = Counter()
        self.limits: Counter[str] = Counter()
        """Verdicts that hit a limit, by kind (`truncated`, `judge_limit`)."""
        self._reward_kwargs = dict(reward_kwargs or {})
        self._custom: tuple[RewardFn, FnRef] | None = None
        if custom_path is not None:
            fn = load_custom_reward(custom_path, custom_name)  # fail at start-up, not per call
            self._custom = (fn, ("path", str(Path(custom_path).resolve()), custom_name))
        self._kwargs_cache: dict[RewardFn, dict[str, Any]] = {}
        self._workers = [_Worker() for _ in range(num_workers)]
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for worker in self._workers:
            worker.start()
            self._idle.put(worker)
        self._threads = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="reward")
        self._pending: list[tuple[FnRef, dict[str, Any], asyncio.Future]] = []

    async def score(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: str,
        extra_info: dict[str, Any] | None,
    ) -> tuple[float, dict[str, float]]:
        """(score, extra metrics) of one response; 0.0 and a counted failure when anything
        about the reward function goes wrong. The timeout bounds the function's run in a
        worker, not the wait for a free worker (that wait is back-pressure, not a failure)."""
        fn = self._custom[0] if self._custom is not None else REWARD_FNS.get(data_source)
        if fn is None:
            self._count("unknown_data_source", f"no reward function for {data_source!r}")
            return 0.0, {}
        if getattr(fn, "needs_sandbox", False):
            return await self._score_in_sandbox(
                fn, data_source, solution_str, ground_truth, extra_info
            )
        try:
            ref = self._custom[1] if self._custom is not None else _fn_ref(fn)
        except ValueError as e:
            self._count("not_importable", str(e))
            return 0.0, {}
        kwargs = {
            "data_source": data_source,
            "solution_str": solution_str,
            "ground_truth": ground_truth,
            "extra_info": extra_info,
            **self._options_for(fn),
        }
        return await self._in_worker(ref, kwargs, data_source)

    async def _score_in_sandbox(
        self, fn: Any, data_source: str, solution_str: str, ground_truth: str, extra_info: Any
    ) -> tuple[float, dict[str, float]]:
        """A reward that runs model code: its job in the server's sandbox, its verdict from its
        trusted judge in a worker. Within `timeout_s` for the run (plus the judge's own)."""
        where = f"reward function for {data_source!r}"
        try:
            job = fn.prepare(
                solution_str, ground_truth, extra_info, **self._options_for(fn.prepare)
            )
        except Exception as e:  # a malformed row: the dataset's bug, counted, scored 0
            self._count("exception", f"{where}: {type(e).__name__}: {e}")
            return 0.0, {}
        if isinstance(job, Mapping):  # nothing to run (no code in the response)
            score, extras = _plain_result(job)
            return (score if score is not None else 0.0), extras
        try:
            if self.sandbox is None:
                raise RuntimeError("this RewardComputer was given no sandbox")
            sandbox = self.sandbox.get()
        except RuntimeError as e:
            self._count("sandbox_unavailable", f"{where}: {e}")
            return 0.0, {}
        try:
            run = await asyncio.wait_for(
                sandbox.run(job.code, job.stdin, job.wall_timeout_s, job.stdout_limit_bytes),
                self.timeout_s,
            )
        except asyncio.TimeoutError:
            self._count("timeout", f"{where}: the sandbox run took over {self.timeout_s}s")
            return 0.0, {}
        score, extras = await self._in_worker(
            fn.judge_ref, {**job.judge_kwargs, "stdout": run.stdout}, data_source
        )
        extras = {**extras, f"sandbox_{run.status}": 1.0, "sandbox_wall_s": run.wall_s}
        if run.peak_memory_mb is not None:
            extras["sandbox_peak_mb"] = run.peak_memory_mb
        if run.stdout_dropped:
            extras["truncated"] = 1.0
            self._count_limit("truncated", f"{where}: the run's claims passed "
                              f"max_run_output_bytes={job.stdout_limit_bytes}")  # fmt: skip
        elif extras.get("truncated"):
            self._count_limit("truncated", f"{where}: a case's output or value passed "
                              "max_output_bytes / max_value_bytes")  # fmt: skip
        if extras.get("judge_limit"):
            self._count_limit("judge_limit", f"{where}: the judge passed judge_memory_mb or "
                              "judge_cpu_s on values the candidate chose")  # fmt: skip
        return score, extras

    async def _in_worker(
        self, ref: FnRef, kwargs: dict[str, Any], data_source: str
    ) -> tuple[float, dict[str, float]]:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()
        self._pending.append((ref, kwargs, answer))
        if len(self._pending) == 1:  # the first call of this turn sends the turn's batch
            loop.call_soon(self._flush, loop)
        kind, score, extras = await answer
        if kind != "ok":
            self._count(kind, f"reward function for {data_source!r}: {score}")
            return 0.0, {}
        if score is None:
            self._count("non_number", f"reward function for {data_source!r} returned no number")
            return 0.0, extras
        if not plausible_reward(score):  # NaN, inf, 1e39 (inf in float32), or beyond ±1e6
            self._count("non_finite", f"reward function for {data_source!r} returned {score}")
            return 0.0, extras
        bad = [k for k, v in extras.items() if not finite32(v)]
        if bad:
            self._count("non_finite", f"reward function for {data_source!r}: extras {bad[:5]}")
            extras = {k: v for k, v in extras.items() if k not in bad}
        return score, extras

    def _options_for(self, fn: RewardFn) -> dict[str, Any]:
        """The `reward_kwargs` that `fn` declares (all of them when it takes **kwargs)."""
        if fn not in self._kwargs_cache:
            params: list[inspect.Parameter] = []
            # no introspectable signature: pass no options
            with contextlib.suppress(TypeError, ValueError):
                params = list(inspect.signature(fn).parameters.values())
            if any(p.kind is p.VAR_KEYWORD for p in params):
                wanted = dict(self._reward_kwargs)
            else:
                names = {p.name for p in params}
                wanted = {k: v for k, v in self._reward_kwargs.items() if k in names}
            self._kwargs_cache[fn] = wanted
        return self._kwargs_cache[fn]

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        """Send the calls of this turn as at most one batch per worker."""
        calls, self._pending = self._pending, []
        ways = min(len(self._workers), len(calls))
        for part in (calls[i::ways] for i in range(ways)):
            items = [(ref, kwargs) for ref, kwargs, _ in part]
            try:
                batch = loop.run_in_executor(self._threads, self._call_batch, items)
            except RuntimeError as e:  # the pool was closed under us (shutdown)
                batch = loop.create_future()
                batch.set_exception(e)
            batch.add_done_callback(functools.partial(_answer, part))

    def _call_batch(self, items: list[tuple[FnRef, dict[str, Any]]]) -> list[tuple[Any, ...]]:
        """On a pool thread: borrow an idle worker (there is one per thread), call, give back."""
        worker = self._idle.get()
        try:
            results = worker.call_many(items, self.timeout_s)
            if any(r[0] in ("timeout", "crash") for r in results):
                worker.start()  # replace a killed worker now, off the event loop
            return results
        finally:
            self._idle.put(worker)

    def _count_limit(self, kind: str, detail: str) -> None:
        """A verdict that hit a limit (`truncated`, `judge_limit`): a score, not a failure of
        the reward function, but never silent: counted in `limits` and logged like failures."""
        self.limits[kind] += 1
        n = self.limits[kind]
        if n & (n - 1) == 0:
            log.warning("reward %s (%d so far), case scored 0: %s", kind, n, detail)

    def _count(self, kind: str, detail: str) -> None:
        self.failures[kind] += 1
        n = self.failures[kind]
        if n & (n - 1) == 0:  # 1st, 2nd, 4th, 8th, ...: visible without flooding the log
            log.warning("reward %s (%d so far), scored 0: %s", kind, n, detail)

    def close(self) -> None:
        """Stop the workers; a call still in flight scores 0 and counts as `closed`/`crash`."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        for worker in self._workers:
            worker.stop(retire=True)
