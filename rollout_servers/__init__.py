"""The rollout fleet: M servers, each one engine and many agent loops on one asyncio event loop.

Components, wired by `factories.setup_rollout_server` and driven by `server.RolloutServer.run`:
- `engines/`: the `Engine` interface (`base`) and its implementations, `hf` (transformers, runs
  anywhere), `vllm` (vLLM's async engine; `vllm_worker` runs inside its worker process) and
  `sglang` (SGLang's offline engine), the last two behind the version gate of `gated`.
  An engine samples with behaviour log-probs and follows the learner's weight versions.
- `agents/`: the `AgentLoop` interface (`base`), `single_turn`, the multi-turn `tool_agent`
  with its `tools` and `interactions` (simulated users), and the `registry` that picks a loop
  per row.
- `rewards`: reward functions by data_source (`REWARD_FNS`); `reward_computer`: runs them in
  worker processes (`reward_workers`) beside the loops; `code_reward`: the code reward, a
  program run against the row's tests in the sandbox and judged by trusted code (`code_formats`
  reads the datasets' test formats, `code_plan` splits them into sandbox and judge programs,
  `code_harness` runs in the sandbox, `code_judge` decides, `code_values` carries the values
  between them); `sandbox/`: isolation for model code.
- `replay_client`: leases prompts and sends trajectories until the replay acknowledges them.
- `trajectory_log`: `rollout_metrics.jsonl`, one line per finished trajectory.
- `server`: the main loop (leases in, groups of samples out, weights applied as they come).
"""
