"""A run directory's config.yaml written before the algorithm keys became typed variants
(`asyncrl.algorithms.variants`): its flat `algorithm` block (`policy_loss: ppo`,
`clip_ratio_low`, `decoupled`, `is_level`, `reject_level`, `use_kl_in_reward`, `use_kl_loss`...)
is rewritten into the variants the old learner ran, so `asyncrl launch --resume RUN` and
`asyncrl eval --run-dir RUN` go on with such a run.

Only a run's own config.yaml is migrated (it is a full dump, every old key in it): a user's
config file or override that still spells an old key is refused naming the new one
(`asyncrl.config.renamed`). The migration is deterministic: each variant is chosen from the old
flags as the old learner read them, and carries its own fields from the old keys; the old keys
no variant chosen has are dropped.
"""

from __future__ import annotations

from typing import Any

from asyncrl.algorithms.policy_losses import POLICY_LOSSES
from asyncrl.config.renamed import RENAMED_KEYS

OLD_KEYS = frozenset(
    {key.removeprefix("algorithm.") for key in RENAMED_KEYS if key.startswith("algorithm.")}
)
"""The flat algorithm keys of a config written before the variants."""


def migrate_algorithm(tree: dict[str, Any]) -> bool:
    """Rewrite `tree`'s flat algorithm keys into variants, in place; whether there were any."""
    algo = tree.get("algorithm")
    if not isinstance(algo, dict) or not OLD_KEYS & algo.keys():
        return False
    old = {key: algo.pop(key) for key in list(algo) if key in OLD_KEYS}
    loss = algo.get("policy_loss", "ppo")
    if not isinstance(loss, dict):
        algo["policy_loss"] = _policy_loss(str(loss), old)
    algo["correction"] = _correction(old)
    algo["rejection"] = _rejection(old)
    algo["kl_in_reward"] = _kl_in_reward(old)
    algo["kl_loss"] = _kl_loss(old)
    return True


def _level(value: Any) -> str:
    """An old `is_level`/`reject_level`: `off` (YAML's bare off: false), token or sequence."""
    return "off" if value in (False, None, "off") else str(value)


def _policy_loss(name: str, old: dict[str, Any]) -> dict[str, Any]:
    """The loss with the old clip keys its variant has (ppo: all three; gspo: not
    clip_ratio_c, which it never read)."""
    cls = POLICY_LOSSES.get(name)
    clips = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
    fields = [f for f in clips if f in old and (cls is None or f in cls.model_fields)]
    return {"type": name, **{f: old[f] for f in fields}}


def _correction(old: dict[str, Any]) -> dict[str, Any]:
    """is_level token|sequence (which needed decoupled=true): truncated_is; decoupled alone:
    decoupled (untruncated weights); neither: none (clipped against the behaviour policy)."""
    level = _level(old.get("is_level"))
    if level != "off":
        fields = {"is_cap": "cap", "is_batch_normalize": "batch_normalize"}
        kept = {new: old[key] for key, new in fields.items() if key in old}
        return {"type": "truncated_is", "level": level, **kept}
    return {"type": "decoupled" if old.get("decoupled") else "none"}


def _rejection(old: dict[str, Any]) -> dict[str, Any]:
    """reject_level token|sequence with its keys; off, or no bound (it rejected nothing): none."""
    level = _level(old.get("reject_level"))
    if level == "off" or (old.get("reject_low") is None and old.get("reject_high") is None):
        return {"type": "none"}
    keys = ["metric", "low", "high"] + (["agg"] if level == "sequence" else [])
    return {"type": level, **{k: old[f"reject_{k}"] for k in keys if f"reject_{k}" in old}}


def _kl_in_reward(old: dict[str, Any]) -> dict[str, Any]:
    """use_kl_in_reward: kl_ctrl's controller (fixed or adaptive) with its keys; else none."""
    if not old.get("use_kl_in_reward"):
        return {"type": "none"}
    ctrl = old.get("kl_ctrl", "fixed")
    fields = {"kl_coef": "coef", "kl_penalty": "estimator"}
    if ctrl == "adaptive":
        fields |= {"kl_target": "target", "kl_horizon": "horizon"}
    return {"type": ctrl, **{new: old[key] for key, new in fields.items() if key in old}}


def _kl_loss(old: dict[str, Any]) -> dict[str, Any]:
    if not old.get("use_kl_loss"):
        return {"type": "none"}
    fields = {"kl_loss_coef": "coef", "kl_loss_type": "estimator"}
    return {"type": "reference", **{new: old[key] for key, new in fields.items() if key in old}}
