"""The rollout fleet: M servers, each one engine and many agent loops on one asyncio event loop.

Components, wired by `factories.setup_rollout_server` and driven by `server.RolloutServer.run`:
- `engines/`: the `Engine` interface (`base`) and its implementations, `hf` (transformers, runs
  anywhere) and `vllm` (vLLM's async engine; `vllm_worker` runs inside its worker process).
  An engine samples with behaviour log-probs and follows the learner's weight versions.
- `agents/`: the `AgentLoop` interface (`base`), `single_turn`, the multi-turn `tool_agent`
  with its `tools` and `interactions` (simulated users), and the `registry` that picks a loop
  per row.
- `rewards`: reward functions by data_source (`REWARD_FNS`), run in worker processes beside the
  loops; `reward_sandbox`: the code reward's test cases; `sandbox/`: isolation for model code.
- `replay_client`: leases prompts and sends trajectories until the replay acknowledges them.
- `server`: the main loop (leases in, groups of samples out, weights applied as they come).
"""
