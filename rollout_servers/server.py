"""A rollout server: one engine, many agent loops, one asyncio event loop.

Components (built by `rollout_servers.factories.setup_rollout_server`, driven by
`RolloutServer.run`):
- engine (`engines/`, behind `engines/base.py`'s `Engine`): batched sampling shared by every
  agent loop; applies a weight version atomically and tags each sampled token with the version
  that produced it.
- weight receiver (a thread over `asyncrl.weights.receiver.WeightReceiver`): joins the learner's
  weight sync as this server's epoch (its start count, handed by the launcher: 0 at the first
  start, one more per restart; a restarted server rejoins without stopping the others) and
  hands each complete version to the engine.
- replay client (`replay_client.py`): asks for prompt leases, sends trajectories and keeps them
  until the replay acknowledges them.
- agent loops (`agents/`): one per sample, `n` per leased prompt, all concurrent.
- reward computer (`rewards/computer.py`, with the reward functions of `rewards/functions.py`):
  scores each response right after its loop, off the loop; `rewards/overlong.py` adds DAPO's
  overlong penalty to the score when `reward.overlong_buffer` is on.
- reward model (with `reward.model.path`): `rewards/model_client.py` sends each response to the
  reward-model fleet and `rewards/combination.py` combines its score with the rule reward.

The main loop keeps up to `rollout.max_concurrent_groups` leases in flight. It asks for more
whenever it has room or its engine moved to a new version (so admission control sees the new
version at once), and each iteration it checks every background task and re-raises failures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from asyncrl.algorithms.estimators import ESTIMATORS
from asyncrl.config import Config, RolloutConfig
from asyncrl.metrics import JsonlWriter, peak_rss_mb
from asyncrl.run_spec import RunSpec
from asyncrl.trace import SpanWriter
from asyncrl.wire.auth import sync_key_from_env
from asyncrl.wire.protocol import PromptItem
from asyncrl.wire.samples import Trajectory
from rollout_servers.agents.base import AgentLoop
from rollout_servers.engine_probe import probe_engine
from rollout_servers.engines.base import Engine, SamplingParams, SyncTarget
from rollout_servers.replay_client import AsyncReplayClient
from rollout_servers.rewards.combination import CombinedReward
from rollout_servers.rewards.computer import RewardComputer
from rollout_servers.rewards.overlong import OverlongShaping
from rollout_servers.sandbox import SharedSandbox
from rollout_servers.trajectory_log import TrajectoryMetricsLog

log = logging.getLogger("asyncrl.rollout")

RECEIVER_FINISH_S = 4.0  # at stop, for the version being applied (the launcher's grace is 10 s)


class RolloutServer:
    def __init__(
        self,
        cfg: Config,
        spec: RunSpec,
        server_id: int,
        engine: Engine,
        agent_loop: AgentLoop,
        client: AsyncReplayClient,
        rewards: RewardComputer,
        sandbox: SharedSandbox | None = None,
        reward_model: CombinedReward | None = None,
        epoch: int = 0,
    ):
        self.cfg, self.spec, self.server_id = cfg, spec, server_id
        self.epoch = epoch
        """Which start of this server this is (the launcher counts restarts)."""
        self.engine, self.agent_loop, self.client, self.rewards = (
            engine,
            agent_loop,
            client,
            rewards,
        )
        self.reward_model = reward_model  # the rule reward combined with a reward model's
        self.overlong = OverlongShaping(cfg)  # DAPO's penalty on responses near their budget
        self.counters: Counter[str] = Counter()
        self._failed_in_a_row = 0  # groups that raised since the last one that did not
        self.stall_timeout_s = cfg.rollout.stall_timeout_s or cfg.replay.lease_timeout_s
        self._progress_at = time.monotonic()  # a sample done, or no group in flight
        self.sampling_params = sampling_params(cfg.rollout)
        self.greedy_params = dataclasses.replace(self.sampling_params, temperature=0.0, top_p=1.0)
        self.sync_times: list[float] = []
        self.trace = SpanWriter(Path(spec.run_dir) / "trace" / f"server_{server_id}.jsonl")
        engine.on_batch = lambda start, dur, n, v: self.trace.record(
            "generate", "rollout", start, dur, batch=n, version=v
        )
        self._wake = asyncio.Event()
        self._receiver_error: BaseException | None = None
        self._has_weights = self.epoch == 0 or spec.sync_port == 0  # may lease (`_may_lease`)
        run_dir = Path(spec.run_dir)
        self._weight_log = (
            JsonlWriter(run_dir / f"weights_server_{server_id}.jsonl")
            if cfg.learner.weight_checksum
            else None
        )
        self.trajectory_log = TrajectoryMetricsLog(run_dir / "rollout_metrics.jsonl", server_id)
        self.sandbox = sandbox  # the one sandbox of model code, closed with the server

    # ---- weight sync (a thread: the broadcast is a blocking collective) -----------------
    def start_weight_receiver(self, loop: asyncio.AbstractEventLoop) -> threading.Thread | None:
        """Join the learner's broadcast group (none when serving without a learner)."""
        if self.spec.sync_port == 0:
            log.info("no learner: serving the weights of %s as they are", self.spec.model_path)
            return None
        self._log_weights(self.engine.version)
        thread = threading.Thread(
            target=self._receive_weights, args=(loop,), daemon=True, name="weight-receiver"
        )
        thread.start()
        return thread

    def _receive_weights(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            target = SyncTarget(
                self.spec.sync_host,
                self.spec.sync_port,
                1,
                2,
                torch.device(engine_device(self.cfg.rollout.device)),
                server_id=self.server_id,
                epoch=self.epoch,
                key=sync_key_from_env(),
            )
            for applied in self.engine.follow_learner(target):
                self.sync_times.append(applied.apply_s)
                self.trace.record(
                    "apply_weights",
                    "sync",
                    time.time() - applied.apply_s,
                    applied.apply_s,
                    version=applied.version,
                )
                self._log_weights(applied.version)
                self._has_weights = True
                loop.call_soon_threadsafe(self._wake.set)
            log.info("learner closed the weight-sync group")
        except BaseException as e:  # surfaced by the main loop, which re-raises it
            self._receiver_error = e
            loop.call_soon_threadsafe(self._wake.set)

    def _log_weights(self, version: int) -> None:
        """weights_server_<id>.jsonl (with `learner.weight_checksum`): the checksum of the live
        weights at each version, and the epoch (a restarted server appends to the same file)."""
        if self._weight_log is not None:
            checksum = self.engine.weights_checksum()
            self._weight_log.write({"version": version, "checksum": checksum, "epoch": self.epoch})

    # ---- one group, one sample ------------------------------------------------------------
    async def run_group(self, prompt: PromptItem) -> None:
        """The group's n samples, concurrently (and, for ReMax, its greedy baseline too). A
        group that raises (a prompt naming an agent loop this server lacks, one too long for the
        model, ...) is logged, counted (`groups_failed`) and reported to the replay, which leases
        the row again or gives it up (`replay.max_group_failures`), and the server goes on; a
        report only leaves once the engine answers a one-token probe, so an engine that cannot
        sample even that stops the server instead of blaming rows. Many failures in a row stop
        it too."""
        running: list[asyncio.Future] = []
        try:
            baseline: asyncio.Future[float]
            if ESTIMATORS[self.cfg.algorithm.adv_estimator].greedy_baseline:
                baseline = asyncio.ensure_future(self._greedy_baseline(prompt))
            else:
                baseline = asyncio.get_running_loop().create_future()
                baseline.set_result(float("nan"))
            running = [baseline]
            running += [
                asyncio.ensure_future(self.run_sample(prompt, i, baseline)) for i in range(prompt.n)
            ]
            await asyncio.gather(*running[1:])
        except Exception as e:
            for task in running:  # the group failed: its other samples would be wasted work
                task.cancel()
            await self._group_failed(prompt, e)
            return
        self._failed_in_a_row = 0
        self.counters["groups"] += 1

    async def _group_failed(self, prompt: PromptItem, error: Exception) -> None:
        self.counters["groups_failed"] += 1
        self._failed_in_a_row += 1
        # each bad row fails up to max_group_failures times
        limit = 3 * self.cfg.rollout.max_concurrent_groups * self.cfg.replay.max_group_failures
        if self._failed_in_a_row > limit:
            raise RuntimeError(f"{self._failed_in_a_row} groups failed in a row") from error
        if self.counters["groups_failed"] <= 10:
            log.error(
                "group %s (%s%s) failed, the server goes on: %s: %s",
                prompt.group_id,
                prompt.data_source,
                f", evaluation job {prompt.eval_job}" if prompt.eval_job else "",
                type(error).__name__,
                error,
                exc_info=error,
            )
        await probe_engine(self.engine, self.greedy_params, f"group {prompt.group_id}", error)
        await self.client.group_failed(prompt.group_id, f"{type(error).__name__}: {error}")

    async def _greedy_baseline(self, prompt: PromptItem) -> float:
        greedy = await self.agent_loop.run(prompt, self.greedy_params)
        if greedy.reward is not None:
            reward = greedy.reward
        else:
            reward = (await self._score(prompt, greedy.response_text))[0]
        return self.overlong.shape(reward, len(greedy.response_ids), prompt)[0]

    async def _score(self, prompt: PromptItem, text: str) -> tuple[float, dict[str, float]]:
        if self.reward_model is not None:
            return await self.reward_model.score(prompt, text)
        return await self.rewards.score(
            prompt.data_source, text, prompt.ground_truth, prompt.extra_info
        )

    async def run_sample(self, prompt: PromptItem, index: int, baseline: asyncio.Future) -> None:
        params = None
        if prompt.temperature is not None:  # evaluation prompts may set their own temperature
            params = dataclasses.replace(self.sampling_params, temperature=prompt.temperature)
        result = await self.agent_loop.run(prompt, params)
        if result.reward is None:
            reward, extras = await self._score(prompt, result.response_text)
        else:
            reward, extras = result.reward, {}
        reward, shaping = self.overlong.shape(reward, len(result.response_ids), prompt)
        traj = Trajectory(
            traj_id=uuid.uuid4().hex,
            attempt=0,
            group_id=prompt.group_id,
            sample_index=index,
            server_id=self.server_id,
            prompt_ids=np.asarray(result.prompt_ids, np.int32),
            response_ids=np.asarray(result.response_ids, np.int32),
            loss_mask=np.asarray(result.loss_mask, np.uint8),
            behaviour_logprobs=np.asarray(result.logprobs, np.float32),
            versions=np.asarray(result.versions, np.int32),
            reward=reward,
            baseline_reward=await baseline,
            finish_reason=result.finish_reason,
            metrics={**result.metrics, **extras, **shaping},
        )
        await self.client.put(traj)
        self._progress_at = time.monotonic()
        self.counters["trajectories"] += 1
        self.trajectory_log.add(prompt, traj)

    # ---- main loop ------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        background = self.client.start()
        if self.reward_model is not None:
            background += self.reward_model.model.start()
        receiver = self.start_weight_receiver(loop)
        started = time.monotonic()
        groups: set[asyncio.Task] = set()
        leases: set[asyncio.Task] = set()  # outstanding lease requests; every grant is used
        asked_at_version = -1
        capacity = self.cfg.rollout.max_concurrent_groups
        while not stop.is_set():
            self._wake.clear()  # anything that happens from here on wakes the sleep below
            self._raise_if_failed(background)
            for done in [t for t in leases if t.done()]:
                leases.discard(done)
                for prompt in done.result():
                    groups.add(self._spawn(self.run_group(prompt)))
                    self.counters["leases"] += 1
            for done in [t for t in groups if t.done()]:
                groups.discard(done)
                done.result()
            self._raise_if_stalled(len(groups))
            free = capacity - len(groups)
            # ask again at once when the engine moved on: admission control judges by version
            fresh = not leases or asked_at_version != self.engine.version
            if free > 0 and fresh and self._may_lease(started):
                asked_at_version = self.engine.version
                leases.add(
                    self._spawn(
                        self.client.lease(
                            self.server_id,
                            asked_at_version,
                            free,
                            self.engine.busy_s,
                            sum(self.sync_times),
                            time.monotonic() - started,
                        )
                    )
                )
            self.trajectory_log.maybe_flush()
            await self._sleep_until_woken(stop, timeout_s=0.5)
        self.trajectory_log.flush()
        for t in leases | groups:
            t.cancel()
        # both at once: a learner still alive never closes the group, and the launcher's
        # grace (10 s) must cover the drain too
        _, left = await asyncio.gather(
            self._let_receiver_finish(receiver, RECEIVER_FINISH_S),
            self.client.drain(timeout_s=5.0),
        )
        if left:
            log.warning("%d trajectories were not acknowledged before shutdown", left)

    async def _let_receiver_finish(self, thread: threading.Thread | None, timeout_s: float) -> None:
        """At stop, give the weight receiver up to `timeout_s` to end: a learner that finished
        has closed the group, so the receiver ends as soon as the version it holds is applied
        and logged, instead of this process dying in the middle of that (its last version would
        be applied by no one and missing from weights_server_<id>.jsonl). Waited for on this
        loop, which the engine's apply runs on."""
        deadline = time.monotonic() + timeout_s
        while thread is not None and thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        task.add_done_callback(lambda _: self._wake.set())
        return task

    async def _sleep_until_woken(self, stop: asyncio.Event, timeout_s: float) -> None:
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()

    def _raise_if_failed(self, background: list[asyncio.Task]) -> None:
        if self._receiver_error is not None:
            raise RuntimeError(
                f"weight receiver failed: {self._receiver_error!r}"
            ) from self._receiver_error
        for t in background:
            if t.done():
                t.result()
                raise RuntimeError(f"background task {t.get_name()} ended unexpectedly")

    def _may_lease(self, started: float) -> bool:
        """Whether to ask for leases: a restarted epoch has the initial weights, which no lease
        should sample, until its first version (`learner.sync_fleet`: the learner joins it at
        once). After `launch.startup_timeout_s` without one, RuntimeError: the launcher
        restarts it, or drops it and, with no server left, fails the run naming why."""
        if self._has_weights:
            return True
        waited = time.monotonic() - started
        if waited > self.cfg.launch.startup_timeout_s:
            raise RuntimeError(
                f"server {self.server_id} epoch {self.epoch} received no weights from the "
                f"learner within launch.startup_timeout_s={self.cfg.launch.startup_timeout_s:g}"
                " s of its start (learner_0's log and sync_members.jsonl say whether it "
                "joined the weight sync): stopping"
            )
        return False

    def _raise_if_stalled(self, groups_in_flight: int) -> None:
        """Stop when groups are in flight and no sample was done for `stall_timeout_s`: an engine
        wedged while this event loop (and its heartbeat) runs on, which the replay's silence
        rule cannot see. The launcher restarts the server; the replay takes its leases back."""
        now = time.monotonic()
        if groups_in_flight == 0:
            self._progress_at = now
        elif now - self._progress_at > self.stall_timeout_s:
            raise RuntimeError(
                f"{groups_in_flight} group(s) in flight and no sample done for "
                f"{now - self._progress_at:.0f} s (rollout.stall_timeout_s="
                f"{self.stall_timeout_s:g}): the engine is wedged; stopping"
            )

    def stats(self) -> dict[str, float]:
        times = self.sync_times or [0.0]
        return {
            **self.counters,
            **{f"client_{k}": v for k, v in self.client.counters.items()},
            **{f"reward_{k}": v for k, v in self.rewards.failures.items()},
            **{f"reward_limit_{k}": v for k, v in self.rewards.limits.items()},  # truncated...
            **getattr(self.agent_loop, "stats", dict)(),  # the openai endpoint's counts
            **(self.reward_model.stats() if self.reward_model is not None else {}),
            "engine_version": self.engine.version,
            "responses_capped_by_context": self.engine.responses_capped_by_context,
            "weight_syncs": len(self.sync_times),
            "weight_apply_mean_s": sum(times) / len(times),
            "peak_rss_mb": peak_rss_mb(),
            "unacked_at_exit": len(self.client.outbox),
        }


def sampling_params(rc: RolloutConfig) -> SamplingParams:
    return SamplingParams(
        temperature=rc.temperature, top_p=rc.top_p, max_new_tokens=rc.max_new_tokens
    )


def engine_device(device: str) -> str:
    """`rollout.device` resolved: `auto` is CUDA when present."""
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"
