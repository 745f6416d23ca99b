"""Keys that moved: a config that still uses an old name is refused naming the new one."""

from __future__ import annotations

from typing import Any

from asyncrl.config.rollout import ToolAgentConfig

RENAMED_KEYS = {
    "rollout.vllm.dtype": "rollout.dtype",
    "rollout.max_batch_size": "rollout.hf.max_batch_size",
    "rollout.vllm.gpu_memory_utilization": "rollout.gpu_memory_fraction",
    "rollout.sglang.mem_fraction_static": "rollout.gpu_memory_fraction",
    "launch.ray.server_num_gpus": "launch.gpus",
    "launch.ray.learner_num_gpus": "launch.gpus",
    **{f"rollout.{key}": f"rollout.tool_agent.{key}" for key in ToolAgentConfig.model_fields},
    # the flat algorithm keys became typed variants (asyncrl.algorithms.variants)
    **{
        f"algorithm.{key}": f"algorithm.policy_loss.{key}"
        for key in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
    },
    "algorithm.decoupled": "algorithm.correction.type",
    "algorithm.is_level": "algorithm.correction.level",
    "algorithm.is_cap": "algorithm.correction.cap",
    "algorithm.is_batch_normalize": "algorithm.correction.batch_normalize",
    "algorithm.reject_level": "algorithm.rejection.type",
    **{
        f"algorithm.reject_{key}": f"algorithm.rejection.{key}"
        for key in ("metric", "agg", "low", "high")
    },
    "algorithm.use_kl_in_reward": "algorithm.kl_in_reward.type",
    "algorithm.kl_ctrl": "algorithm.kl_in_reward.type",
    "algorithm.kl_penalty": "algorithm.kl_in_reward.estimator",
    "algorithm.kl_coef": "algorithm.kl_in_reward.coef",
    "algorithm.kl_target": "algorithm.kl_in_reward.target",
    "algorithm.kl_horizon": "algorithm.kl_in_reward.horizon",
    "algorithm.use_kl_loss": "algorithm.kl_loss.type",
    "algorithm.kl_loss_coef": "algorithm.kl_loss.coef",
    "algorithm.kl_loss_type": "algorithm.kl_loss.estimator",
}
"""Keys that moved, old dotted name -> new one. A config (file or override) that still uses the
old name is refused with a message naming the new one, rather than `unknown key`."""

INTO_VARIANT = {
    "algorithm.clip_ratio_c": "ppo",
    "algorithm.decoupled": "decoupled or truncated_is",
    "algorithm.is_level": "truncated_is",
    "algorithm.is_cap": "truncated_is",
    "algorithm.is_batch_normalize": "truncated_is",
    "algorithm.reject_level": "token or sequence",
    "algorithm.reject_metric": "token or sequence",
    "algorithm.reject_agg": "sequence",
    "algorithm.reject_low": "token or sequence",
    "algorithm.reject_high": "token or sequence",
    "algorithm.use_kl_in_reward": "fixed or adaptive",
    "algorithm.kl_ctrl": "fixed or adaptive",
    "algorithm.kl_penalty": "fixed or adaptive",
    "algorithm.kl_coef": "fixed or adaptive",
    "algorithm.kl_target": "adaptive",
    "algorithm.kl_horizon": "adaptive",
    "algorithm.use_kl_loss": "reference",
    "algorithm.kl_loss_coef": "reference",
    "algorithm.kl_loss_type": "reference",
}
"""Old keys whose new home is a field of some variants only (or the variant's `type`) -> those
variants: the refusal says which `type` to set (`asyncrl.algorithms.variants`)."""


def refuse_renamed_keys(tree: dict[str, Any]) -> None:
    """Raise a ValueError naming every key of `tree` that `RENAMED_KEYS` says has moved."""
    found = []
    for old, new in RENAMED_KEYS.items():
        node: Any = tree
        for part in old.split("."):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            found.append(f"{old} was renamed: use {new}{_variant_hint(new, old, node)}")
    if found:
        raise ValueError("; ".join(found))


OFF_MEANS_NONE = frozenset(
    {"algorithm.decoupled", "algorithm.reject_level", "algorithm.use_kl_in_reward"}
    | {"algorithm.use_kl_loss", "algorithm.is_level"}
)
"""Old keys whose false (or `off`) value is now the variant `none` of their new key's family."""


def _variant_hint(new: str, old: str, value: Any) -> str:
    """ " with algorithm.correction.type=truncated_is" where the new key is a variant's field; the
    variant the value itself names where it names one (`decoupled: false` is `type=none`)."""
    if old not in INTO_VARIANT:
        return ""
    parent, leaf = new.rsplit(".", 1)
    types = INTO_VARIANT[old]
    if old in OFF_MEANS_NONE and value in (False, "off", None):
        if old == "algorithm.is_level":  # no truncation: decoupled, or no correction at all
            return f" (is_level off: {parent}.type=decoupled or none, which have no level)"
        return f"=none (what {old.removeprefix('algorithm.')}: {str(value).lower()} was)"
    if old in ("algorithm.reject_level", "algorithm.kl_ctrl") and value in types.split(" or "):
        return f"={value}"
    return f" ({types})" if leaf == "type" else f" with {parent}.type={types}"


_MISSING = object()
