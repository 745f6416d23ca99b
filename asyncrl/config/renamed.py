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
}
"""Keys that moved, old dotted name -> new one. A config (file or override) that still uses the
old name is refused with a message naming the new one, rather than `unknown key`."""


def refuse_renamed_keys(tree: dict[str, Any]) -> None:
    """Raise a ValueError naming every key of `tree` that `RENAMED_KEYS` says has moved."""
    found = []
    for old, new in RENAMED_KEYS.items():
        node: Any = tree
        for part in old.split("."):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            found.append(f"{old} was renamed: use {new}")
    if found:
        raise ValueError("; ".join(found))


_MISSING = object()
