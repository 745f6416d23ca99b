"""A rollout server: one engine, many agent loops, one asyncio event loop.

Components (built in `setup_rollout_server`, driven by `RolloutServer.run`):
- engine (`engine.py`): batched sampling shared by every agent loop; applies a weight version
  atomically between batches and tags each sampled token with the version that produced it.
- weight receiver (a thread over `asyncrl.weight_sync.WeightReceiver`): joins the learner's
  weight sync as this server's epoch (`ASYNCRL_SERVER_EPOCH`, 0 at the first start, one more
  per restart: a restarted server rejoins without stopping the others) and hands each complete
  version to the engine.
- replay client (`replay_client.py`): asks for prompt leases, sends trajectories and keeps them
  until the replay acknowledges them.
- agent loops (`agent_loop.py`): one per sample, `n` per leased prompt, all concurrent.
- reward computer (`rewards.py`): scores each response right after its loop, off the loop.

The main loop keeps up to `rollout.max_concurrent_groups` leases in flight. It asks for more
whenever it has room or its engine moved to a new version (so admission control sees the new
version at once), and each iteration it checks every background task and re-raises failures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from asyncrl.advantages import ESTIMATORS
from asyncrl.auth import key_from_env
from asyncrl.config import Config, RolloutConfig
from asyncrl.learner_config import LoraConfig
from asyncrl.metrics import JsonlWriter, peak_rss_mb, write_json_atomic
from asyncrl.protocol import PromptItem, Trajectory
from asyncrl.run_spec import RunSpec
from asyncrl.trace import SpanWriter
from rollout_servers.agents.base import AgentLoop
from rollout_servers.agents.interactions import load_interaction_config
from rollout_servers.agents.registry import AgentLoopRouter
from rollout_servers.agents.tool_agent import ToolAgentLimits
from rollout_servers.agents.tools import load_tool_config
from rollout_servers.engines.base import Engine, SamplingParams, SyncTarget
from rollout_servers.engines.hf import HFEngine
from rollout_servers.replay_client import AsyncReplayClient
from rollout_servers.reward_computer import RewardComputer
from rollout_servers.rewards import REWARD_FNS
from rollout_servers.sandbox import SharedSandbox
from rollout_servers.trajectory_log import TrajectoryMetricsLog

log = logging.getLogger("asyncrl.rollout")

PROBES = 3  # one-token requests that must all fail before a failed group stops the server
PROBE_PAUSE_S = 1.0  # between two of them
PROBE_TIMEOUT_S = 120.0  # one probe's wait (a busy engine queues it behind a full batch)


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
    ):
        self.cfg, self.spec, self.server_id = cfg, spec, server_id
        self.epoch = int(os.environ.get("ASYNCRL_SERVER_EPOCH", "0"))
        """Which start of this server this is (the launcher counts restarts)."""
        self.engine, self.agent_loop, self.client, self.rewards = (
            engine,
            agent_loop,
            client,
            rewards,
        )
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
                torch.device("cuda" if _uses_cuda(self.cfg.rollout.device) else "cpu"),
                server_id=self.server_id,
                epoch=self.epoch,
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
        await self._probe_engine(prompt, error)
        await self.client.group_failed(prompt.group_id, f"{type(error).__name__}: {error}")

    async def _probe_engine(self, prompt: PromptItem, error: Exception) -> None:
        """Whether the engine still samples, before a failed group is blamed on its row: a
        one-token request (token 0 is in every vocabulary), tried PROBES times a second apart
        (a probe admitted together with the failing prompt can fail with it: a prefill that
        ran out of device memory); RuntimeError when every try fails."""
        params = dataclasses.replace(self.greedy_params, max_new_tokens=1)
        for attempt in range(1, PROBES + 1):
            try:
                await asyncio.wait_for(self.engine.generate([0], params), PROBE_TIMEOUT_S)
                return
            except Exception as probe_error:
                if attempt == PROBES:
                    raise RuntimeError(
                        f"the engine failed {PROBES} one-token probes after group "
                        f"{prompt.group_id} failed ({type(error).__name__}: {error}): stopping"
                    ) from probe_error
                await asyncio.sleep(PROBE_PAUSE_S)

    async def _greedy_baseline(self, prompt: PromptItem) -> float:
        greedy = await self.agent_loop.run(prompt, self.greedy_params)
        return (await self._score(prompt, greedy.response_text))[0]

    async def _score(self, prompt: PromptItem, text: str) -> tuple[float, dict[str, float]]:
        return await self.rewards.score(
            prompt.data_source, text, prompt.ground_truth, prompt.extra_info
        )

    async def run_sample(self, prompt: PromptItem, index: int, baseline: asyncio.Future) -> None:
        params = None
        if prompt.temperature is not None:  # evaluation prompts may set their own temperature
            params = dataclasses.replace(self.sampling_params, temperature=prompt.temperature)
        result = await self.agent_loop.run(prompt, params)
        reward, extras = await self._score(prompt, result.response_text)
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
            metrics={**result.metrics, **extras},
        )
        await self.client.put(traj)
        self._progress_at = time.monotonic()
        self.counters["trajectories"] += 1
        self.trajectory_log.add(prompt, traj)

    # ---- main loop ------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        background = self.client.start()
        self.start_weight_receiver(loop)
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
            if free > 0 and (not leases or asked_at_version != self.engine.version):
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
        left = await self.client.drain(timeout_s=5.0)
        if left:
            log.warning("%d trajectories were not acknowledged before shutdown", left)

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
            "engine_version": self.engine.version,
            "weight_syncs": len(self.sync_times),
            "weight_apply_mean_s": sum(times) / len(times),
            "peak_rss_mb": peak_rss_mb(),
            "unacked_at_exit": len(self.client.outbox),
        }


def setup_rewards(cfg: Config, sandbox: SharedSandbox | None = None) -> RewardComputer:
    r = cfg.reward
    return RewardComputer(
        r.timeout_s,
        num_workers=r.workers,
        custom_path=r.custom.path,
        custom_name=r.custom.name,
        reward_kwargs=r.kwargs,
        sandbox=sandbox,
    )


def setup_sandbox(cfg: Config) -> SharedSandbox:
    """The server's one sandbox for model code (the python tool, the code reward). Built now
    when the run's data needs it, so a missing backend fails at start-up naming what to
    install, and when a weaker backend is named, so the warning is in the start-up log; tools
    that need it build it while their config loads; else on first use."""
    shared = SharedSandbox(cfg.rollout.sandbox)
    if cfg.rollout.sandbox.backend != "bwrap" or sandboxed_sources(cfg):
        shared.get()
    return shared


def sandboxed_sources(cfg: Config) -> list[str]:
    """The data sources of `data.train_files` and `data.val_files` whose reward runs model code
    (none when a custom reward function scores every row)."""
    if cfg.reward.custom.path is not None:
        return []
    import pyarrow.parquet as pq

    sources: set[str] = set()
    for path in [*cfg.data.train_files, *cfg.data.val_files]:
        sources.update(map(str, pq.read_table(path, columns=["data_source"]).column(0).to_pylist()))
    return sorted(s for s in sources if getattr(REWARD_FNS.get(s), "needs_sandbox", False))


def sampling_params(rc: RolloutConfig) -> SamplingParams:
    return SamplingParams(
        temperature=rc.temperature, top_p=rc.top_p, max_new_tokens=rc.max_new_tokens
    )


def _uses_cuda(device: str) -> bool:
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def setup_engine(
    rc: RolloutConfig, model_path: str, seed: int, lora: LoraConfig | None = None
) -> Engine:
    """The configured inference engine on the model at `model_path` (version 0); `lora`: the
    learner's adapters (`learner.lora`), which versions then carry."""
    device = "cuda" if _uses_cuda(rc.device) else "cpu"
    if rc.engine == "vllm":
        from rollout_servers.engines.vllm import VLLMEngine

        return VLLMEngine(
            model_path,
            rc.vllm,
            device=device,
            seed=seed,
            dtype=rc.dtype,
            lora=lora,
            weight_update_mode=rc.weight_update_mode,
        )
    if rc.engine == "sglang":  # (LoRA is refused for it by the config)
        from rollout_servers.engines.sglang import SGLangEngine

        return SGLangEngine(
            model_path,
            rc.sglang,
            device=device,
            seed=seed,
            dtype=rc.dtype,
            weight_update_mode=rc.weight_update_mode,
        )
    return HFEngine(
        model_path,
        device=device,
        max_batch_size=rc.max_batch_size,
        seed=seed,
        dtype=rc.dtype,
        lora=lora,
        weight_update_mode=rc.weight_update_mode,
        inflight_kv=rc.inflight_kv,
    )


def setup_rollout_server(cfg: Config, spec: RunSpec, server_id: int) -> RolloutServer:
    """Build the engine, agent loop, replay client and reward computer of one server."""
    from transformers import AutoTokenizer

    rc = cfg.rollout
    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    seed = cfg.trainer.seed + 1000 * (server_id + 1)
    engine = setup_engine(rc, spec.model_path, seed, cfg.learner.lora)
    sandbox = setup_sandbox(cfg)
    tools = load_tool_config(rc.tool_config, sandbox) if rc.tool_config else None
    limits = ToolAgentLimits(
        rc.max_assistant_turns,
        rc.max_user_turns,
        rc.max_tool_calls,
        rc.max_parallel_calls,
        rc.tool_timeout_s,
        rc.max_response_tokens,
    )
    agent = AgentLoopRouter(
        rc.agent_loop,
        engine=engine,
        tokenizer=tokenizer,
        params=sampling_params(rc),
        tools=tools,
        interactions=load_interaction_config(rc.interaction_config or None),
        limits=limits,
    )
    client = AsyncReplayClient(
        spec.replay_address,
        key_from_env(f"server_{server_id}"),
        ack_timeout_s=rc.ack_timeout_s,
        max_message_bytes=int(cfg.replay.max_message_mb * 2**20),
    )
    rewards = setup_rewards(cfg, sandbox)
    return RolloutServer(cfg, spec, server_id, engine, agent, client, rewards, sandbox)


def run_server(spec: RunSpec, cfg: Config, server_id: int) -> None:
    """Entry point of one rollout server process; SIGTERM stops it cleanly."""
    torch.set_num_threads(spec.threads)
    server = setup_rollout_server(cfg, spec, server_id)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await server.run(stop)
        finally:
            write_json_atomic(
                Path(spec.run_dir) / "stats" / f"server_{server_id}.json", server.stats()
            )
            server.client.close()
            server.rewards.close()
            if server.sandbox is not None:
                server.sandbox.close()
            server.trace.flush()
            await server.engine.close()

    asyncio.run(main())
