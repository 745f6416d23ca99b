"""The rollout server's factories: each `setup_*` builds one component from the config, and
`setup_rollout_server` wires them into a `rollout_servers.server.RolloutServer`; `run_server`
is a server process's entry point (build, run until SIGTERM, clean up).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import torch

from asyncrl.config import Config, RolloutConfig
from asyncrl.config.learner import LoraConfig
from asyncrl.metrics import write_json_atomic
from asyncrl.placement import OWN_GPU_FRACTION, Placement, maybe_limit_gpu_memory
from asyncrl.run_spec import RunSpec
from asyncrl.wire.auth import RoleKey, key_from_env, server_role
from rollout_servers.agents.base import AgentLoop
from rollout_servers.agents.interactions import load_interaction_config
from rollout_servers.agents.registry import AgentLoopRouter
from rollout_servers.agents.tools import load_tool_config
from rollout_servers.engines.base import Engine
from rollout_servers.engines.hf import HFEngine
from rollout_servers.replay_client import AsyncReplayClient
from rollout_servers.rewards.combination import CombinedReward
from rollout_servers.rewards.computer import RewardComputer
from rollout_servers.rewards.functions import REWARD_FNS
from rollout_servers.rewards.model_client import RewardModelClient
from rollout_servers.sandbox import SharedSandbox
from rollout_servers.server import RolloutServer, engine_device, sampling_params


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


def setup_engine(
    rc: RolloutConfig,
    model_path: str,
    seed: int,
    lora: LoraConfig | None = None,
    place: Placement | None = None,
) -> Engine:
    """The configured inference engine on the model at `model_path` (version 0); `lora`: the
    learner's adapters (`learner.lora`), which versions then carry; `place`: the server's
    placement, whose memory fraction vLLM and SGLang take as their own option and an HF engine
    on a shared GPU is capped at (`asyncrl.placement.maybe_limit_gpu_memory`)."""
    device = engine_device(rc.device)
    fraction = OWN_GPU_FRACTION
    if place is not None and place.memory_fraction is not None:
        fraction = place.memory_fraction
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
            gpu_memory_fraction=fraction,
            tensor_parallel=rc.gpus_per_server,
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
            gpu_memory_fraction=fraction,
            tensor_parallel=rc.gpus_per_server,
        )
    if device == "cuda":
        maybe_limit_gpu_memory(place, torch.device("cuda", 0))
    return HFEngine(
        model_path,
        device=device,
        max_batch_size=rc.hf.max_batch_size,
        seed=seed,
        dtype=rc.dtype,
        lora=lora,
        weight_update_mode=rc.weight_update_mode,
        inflight_kv=rc.inflight_kv,
    )


def setup_rollout_server(
    cfg: Config, spec: RunSpec, server_id: int, epoch: int = 0
) -> RolloutServer:
    """Build the engine, agent loop, replay client and reward computer of server `server_id`
    at its `epoch` (its start count, `asyncrl.launch.worker.ProcessRole`): the epoch names the
    key it expects (`server_<i>@<e>`) and so what its heartbeats carry."""
    from transformers import AutoTokenizer

    rc = cfg.rollout
    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    seed = cfg.trainer.seed + 1000 * (server_id + 1)
    place = spec.own_place(f"server_{server_id}")
    engine = setup_engine(rc, spec.model_path, seed, cfg.learner.lora, place)
    sandbox = setup_sandbox(cfg)
    ta = rc.tool_agent
    tools = load_tool_config(ta.tool_config, sandbox) if ta.tool_config else None
    built: dict[str, AgentLoop] = {}
    if rc.openai.enabled:  # (aiohttp and openai, the `openai` extra: only when asked for)
        from rollout_servers.agents.openai_agent import OpenAIAgentLoop

        built["openai"] = OpenAIAgentLoop(engine, tokenizer, sampling_params(rc), rc.openai)
    agent = AgentLoopRouter(
        rc.agent_loop,
        engine=engine,
        tokenizer=tokenizer,
        params=sampling_params(rc),
        tools=tools,
        interactions=load_interaction_config(ta.interaction_config or None),
        limits=ta,
        loops=built,
    )
    key = key_from_env(server_role(server_id, epoch))
    client = AsyncReplayClient(
        spec.replay_address,
        key,
        ack_timeout_s=rc.ack_timeout_s,
        max_message_bytes=int(cfg.replay.max_message_mb * 2**20),
        heartbeat_s=cfg.launch.heartbeat_s,
    )
    rewards = setup_rewards(cfg, sandbox)
    reward_model = setup_reward_model(cfg, spec, key, rewards)
    return RolloutServer(
        cfg, spec, server_id, engine, agent, client, rewards, sandbox, reward_model, epoch=epoch
    )


def setup_reward_model(
    cfg: Config, spec: RunSpec, key: RoleKey, rules: RewardComputer
) -> CombinedReward | None:
    """The rule reward combined with the reward-model fleet's score (None without
    `reward.model.path`)."""
    mc = cfg.reward.model
    if mc.path is None:
        return None
    if not spec.reward_model_addresses:
        raise ValueError(
            "reward.model.path is set but the launcher started no reward-model server "
            "(run_dir/launch.json has no reward_model_addresses)"
        )
    client = RewardModelClient(
        list(spec.reward_model_addresses), key, timeout_s=mc.timeout_s, resend_s=mc.resend_s
    )
    return CombinedReward(cfg.reward, rules, client)


def run_server(spec: RunSpec, cfg: Config, server_id: int, epoch: int = 0) -> None:
    """Entry point of one rollout server process (`epoch`: its start count); SIGTERM stops it
    cleanly."""
    torch.set_num_threads(spec.threads)
    server = setup_rollout_server(cfg, spec, server_id, epoch)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await server.run(stop)
        finally:
            if server.reward_model is not None:  # first: what it cuts short is counted
                server.reward_model.model.close()
            write_json_atomic(
                Path(spec.run_dir) / "stats" / f"server_{server_id}.json", server.stats()
            )
            server.client.close()
            server.rewards.close()
            if server.sandbox is not None:
                server.sandbox.close()
            server.trace.flush()
            if isinstance(server.agent_loop, AgentLoopRouter):
                await server.agent_loop.close()
            await server.engine.close()

    asyncio.run(main())
