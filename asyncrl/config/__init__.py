"""The typed configuration tree shared by every fleet.

One tree with eight sections (data, rollout, reward, replay, learner, algorithm, trainer, launch)
is loaded from a YAML file and overridden from the command line as ``section.key=value``. Every
field has a type, a default, a bound where one applies and a short docstring; unknown keys and
invalid values fail at start-up, before any process starts, naming the key and what is allowed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import Field, ValidationError

from asyncrl.checkpoints import missing_parts
from asyncrl.config.base import Section as _Section
from asyncrl.config.docs import annotated_yaml, format_errors
from asyncrl.config.engine import HFConfig, SGLangConfig, VLLMConfig, check_engine
from asyncrl.config.learner import AlgorithmConfig, LearnerConfig, check_algorithm
from asyncrl.config.migrate import migrate_algorithm
from asyncrl.config.overrides import apply_override
from asyncrl.config.renamed import RENAMED_KEYS as RENAMED_KEYS
from asyncrl.config.renamed import refuse_renamed_keys
from asyncrl.config.replay import FilterGroupsConfig, ReplayConfig
from asyncrl.config.reward import OverlongBufferConfig, RewardConfig, check_overlong_budget
from asyncrl.config.rollout import LOOPBACK_HOSTS, RolloutConfig, ToolAgentConfig, check_openai_bind
from asyncrl.config.weight_transport import TransportChoice, refusal

__all__ = [
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "FilterGroupsConfig",
    "HFConfig",
    "LaunchConfig",
    "LearnerConfig",
    "OverlongBufferConfig",
    "ReplayConfig",
    "RewardConfig",
    "RayLaunchConfig",
    "RolloutConfig",
    "SGLangConfig",
    "ToolAgentConfig",
    "TrainerConfig",
    "VLLMConfig",
    "apply_overrides",
    "config_to_yaml",
    "load_config",
    "parse_override",
]


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
    """Task whose rows are used when train_files is empty: a registered name
    (`asyncrl.data.prompts.TASKS`) or `package.module:factory`. Embedded: single-digit addition
    (`arith`), or two-digit times one-digit multiplication that the calculator tool solves
    (`arith_tool`, for `rollout.agent_loop=tool_agent`; task_max_operand does not apply)."""

    @pydantic.field_validator("task")
    @classmethod
    def _task_is_known(cls, name: str) -> str:
        from asyncrl.data.prompts import TASKS

        if name not in TASKS and ":" not in name:
            raise ValueError(
                f"unknown task {name!r}; registered: {TASKS.names()} (or package.module:factory)"
            )
        return name


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
    batch_wait_timeout_s: float = Field(3600.0, ge=0)
    """The learner fails, naming the replay's counters, when no batch came for this long with
    every process alive (a stuck run; 0: wait forever). It logs them every 5 minutes before."""
    save_final: bool = True
    """Save the final weights in Hugging Face format under run_dir/final."""
    save_every: int = Field(0, ge=0)
    """Checkpoint (learner weights and optimizer, the replay's state) every this many steps
    (0: never; an interrupt writes one all the same: checkpoint_on_interrupt); see
    `asyncrl.checkpoints`."""
    keep_checkpoints: int = Field(3, ge=0)
    """Keep the newest this many complete checkpoints, deleting older ones as each new one is
    written (0: all, as tools/chaos.py's audit needs; a checkpoint weighs about three times the
    model's weights: weights and two optimizer moments)."""
    checkpoint_on_interrupt: bool = True
    """Ctrl-C or SIGTERM to the launcher: the learner ends its step and writes a checkpoint of
    it before the fleets stop, whatever save_every says, unless it has taken no step since its
    newest checkpoint (or the start); `asyncrl launch --resume RUN_DIR` goes on from it."""
    interrupt_timeout_s: float = Field(300.0, gt=0)
    """How long the launcher waits for that checkpoint (the step in progress, then the write)
    before it stops every process anyway; a second Ctrl-C stops them at once."""
    resume_from: str | None = None
    """A complete checkpoint directory (run_dir/checkpoints/step_N) to continue training from.
    On the command line a run directory continues that run in place, with its own config
    (`asyncrl launch --resume RUN_DIR`)."""
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
    learner_num_cpus: float = Field(1.0, ge=0.0)
    """CPUs reserved for each learner rank."""
    learner_strategy: Literal["STRICT_PACK", "PACK", "SPREAD"] = "PACK"
    """Placement-group strategy of the learner ranks (STRICT_PACK: all on one node)."""


class LaunchConfig(_Section):
    gpus: int | None = Field(None, ge=0, le=4096)
    """GPUs of this machine the run uses (`asyncrl.placement` places every process on them);
    None: every GPU visible (through CUDA_VISIBLE_DEVICES when set); 0: CPU only."""
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
    weight_transport: TransportChoice = "auto"
    """How each version reaches each rollout server (docs/gpus.md). `auto` picks per server at
    its join: `cuda_ipc` when it shares learner rank 0's GPU, `shm` (a shared-memory staging
    buffer) when it shares the host otherwise, `nccl` between GPUs of different hosts, `gloo`
    otherwise. Naming one forces it for every server; one that cannot work for a server fails
    its join, naming this key."""
    threads_per_process: int = Field(0, ge=0)
    """Torch intra-op threads per compute process; 0 splits the cores between them."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """A fleet that is not up by then fails the launch; a rollout server (each restart too)
    that has sent no heartbeat by then after its start is killed and restarted, and a restarted
    one that has received no weights from the learner by then stops (and is restarted)."""
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
    10 x server_timeout_s in a row (`restarts.HEALTHY_RESET_TIMEOUTS`) gets them all back, and its
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

    @pydantic.model_validator(mode="before")
    @classmethod
    def _refuse_renamed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_renamed_keys(data)
        return data

    @pydantic.model_validator(mode="after")
    def _check_engine_options(self) -> Config:
        check_engine(self.rollout, self.learner.lora.rank)
        return self

    @pydantic.model_validator(mode="after")
    def _check_weight_transport(self) -> Config:
        """A forced transport that the config alone shows cannot work (an end on the CPU), with
        the refusal each join would give (`asyncrl.config.weight_transport`)."""
        ends = (("rollout", self.rollout.device), ("learner", self.learner.device))
        cpu = [f"{section}.device=cpu" for section, device in ends if device == "cpu"]
        why = refusal(self.launch.weight_transport, {"both_gpus": not cpu})
        if why is not None:
            raise ValueError(f"{why}; here {cpu[0]}")
        return self

    @pydantic.model_validator(mode="after")
    def _check_hosts_and_resume(self) -> Config:
        if self.launch.host not in LOOPBACK_HOSTS and not self.launch.allow_remote:
            raise ValueError(
                f"launch.host={self.launch.host!r} is not loopback; set launch.allow_remote=true "
                "to bind sockets beyond this machine"
            )
        check_openai_bind(self.rollout.openai, self.launch.allow_remote)
        resume = self.trainer.resume_from
        if resume is not None and missing_parts(resume):
            if (Path(resume) / "config.yaml").is_file():
                raise ValueError(
                    f"trainer.resume_from={resume!r} is a run directory, not a checkpoint: "
                    f"continue it with `asyncrl launch --resume {resume}` (Python: "
                    "asyncrl.run(resume=...))"
                )
            raise ValueError(
                f"trainer.resume_from={resume!r} is not a complete checkpoint: "
                f"{missing_parts(resume)[0]} is missing"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _check_timing_and_capacity(self) -> Config:
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
        check_overlong_budget(self.reward, self.rollout)
        custom = self.reward.custom.path
        if custom is not None and not Path(custom).is_file():
            raise ValueError(f"reward.custom.path={custom!r} is not a file")
        if self.replay.capacity_groups < self.data.train_batch_size:
            raise ValueError(
                f"replay.capacity_groups={self.replay.capacity_groups} is smaller than "
                f"data.train_batch_size={self.data.train_batch_size}: a batch could never fit"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _check_algorithm(self) -> Config:
        check_algorithm(
            self.algorithm,
            self.rollout.n,
            self.learner.ppo_mini_batch_size,
            self.data.train_batch_size,
        )
        return self


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
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


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    run_dir_config: bool = False,
) -> Config:
    """Load a YAML config (default: configs/default.yaml), apply overrides, validate.
    `run_dir_config`: `path` is a run directory's own config.yaml (resume, eval), whose flat
    algorithm keys from before the typed variants are migrated, saying so on stderr
    (`asyncrl.config.migrate`); anywhere else they are refused naming the new keys."""
    path = Path(path) if path is not None else CONFIG_DIR / "default.yaml"
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from e
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    if run_dir_config and migrate_algorithm(tree):
        print(
            f"asyncrl: {path}: its flat algorithm keys were migrated to variants", file=sys.stderr
        )
    return _validated(tree, overrides)


def apply_overrides(cfg: Config, overrides: Sequence[str] = ()) -> Config:
    """`cfg` with `section.key=value` overrides applied, validated as `load_config` does
    (ConfigError naming what is wrong); `cfg` itself is left as it was."""
    return _validated(cfg.model_dump(mode="json"), overrides)


def _validated(tree: dict[str, Any], overrides: Sequence[str]) -> Config:
    """The Config of `tree` with `overrides` applied; ConfigError naming what is wrong."""
    for text in overrides:
        key_path, value = parse_override(text)
        try:
            apply_override(tree, key_path, value, Config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_errors(e, Config)) from None


def config_to_yaml(cfg: Config, comments: bool = False) -> str:
    """The resolved config as YAML (what the run directory keeps); with `comments`, each key's
    docstring above it (what --dry-run prints; `asyncrl.config.docs`)."""
    if comments:
        return annotated_yaml(Config, cfg.model_dump(mode="json"))
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
