"""The rollout fleet: M servers, each one engine and many agent loops on one asyncio event loop.

Components, wired by `factories.setup_rollout_server` and driven by `server.RolloutServer.run`:
- `engines/`: the `Engine` interface (`base`) and its implementations, `hf` (transformers, runs
  anywhere), `vllm` (vLLM's async engine; `vllm_worker` runs inside its worker process) and
  `sglang` (SGLang's offline engine), the last two behind the version gate of `gated`.
  An engine samples with behaviour log-probs and follows the learner's weight versions.
- `agents/`: the `AgentLoop` interface (`base`), `single_turn`, the multi-turn `tool_agent`
  with its `tools` and `interactions` (simulated users), and the `registry` that picks a loop
  per row.
- `rewards/`: reward functions by data_source (`rewards.functions`, `REWARD_FNS`);
  `rewards.computer` runs them in worker processes (`rewards.workers`) beside the loops, with
  `rewards.overlong`, `rewards.model_client` and `rewards.combination`; `rewards.code.reward`: the
  code reward, a program run against the row's tests in the sandbox and judged by trusted code
  (`rewards.code.formats` reads the datasets' test formats, `rewards.code.plan` splits them into
  sandbox and judge programs, `rewards.code.harness` runs in the sandbox, `rewards.code.judge`
  decides, `rewards.code.values` carries the values between them).
- `sandbox/`: isolation for model code.
- `replay_client`: leases prompts and sends trajectories until the replay acknowledges them.
- `trajectory_log`: `rollout_metrics.jsonl`, one line per finished trajectory.
- `server`: the main loop (leases in, groups of samples out, weights applied as they come).
"""
