"""How one `section.key=value` override lands in a config tree, variant keys included.

A variant key (`asyncrl.algorithms.variants.VariantOf`: `algorithm.policy_loss`, ...) holds a
mapping with its `type`, or just the variant's name. An override treats the two alike: a name in
the tree is refined as its mapping (`algorithm.correction=truncated_is` then
`algorithm.correction.level=sequence`), and switching the variant (`algorithm.policy_loss=gspo`,
or `algorithm.policy_loss.type=gspo`) keeps the fields already set that the new variant also
has, in whatever order the overrides come. A field the new variant lacks is dropped when it
holds the old variant's default (a full dump, a resumed run's config.yaml), and refused naming
it otherwise: a value that was set is never discarded silently.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from asyncrl.algorithms.variants import VariantOf, variant_name


def apply_override(
    tree: dict[str, Any], path: list[str], value: Any, root: type[BaseModel]
) -> None:
    """Set `path` to `value` in `tree`, a config tree of the model `root`; ValueError naming the
    key when a section in the way is not one, or a variant switch would drop a field's value."""
    node, family = tree, None
    model: type[BaseModel] | None = root
    for i, part in enumerate(path[:-1]):
        child_family = _variant_of(model, part)
        child = node.setdefault(part, {})
        if child_family is not None and not isinstance(child, dict):
            child = node[part] = {"type": _bare(child_family, child)}  # refined field by field
        if not isinstance(child, dict):
            raise ValueError(f"{'.'.join(path[: i + 1])} is not a section")
        model, family = _child_model(model, part, child_family, child), child_family
        node = child
    last = path[-1]
    if family is not None and last == "type":  # `<key>.type=name` switches the variant
        node_copy = dict(node)
        node.clear()
        node.update(_switch(family, node_copy, value))
        return
    last_family = _variant_of(model, last)
    old = node.get(last)
    if last_family is not None and not isinstance(value, dict) and old is not None:
        old_map = old if isinstance(old, dict) else {"type": old}
        node[last] = _switch(last_family, old_map, value)
        return
    node[last] = value


def _bare(family: VariantOf, value: Any) -> Any:
    """The `type` a bare value at `family`'s key names (`off` is `none`), or the value itself for
    validation to refuse."""
    try:
        return variant_name(family, value)
    except ValueError:
        return value


def _variant_of(model: type[BaseModel] | None, field: str) -> VariantOf | None:
    """The `VariantOf` of `model`'s field `field`, if it is a variant key."""
    if model is None or field not in model.model_fields:
        return None
    return next((m for m in model.model_fields[field].metadata if isinstance(m, VariantOf)), None)


def _child_model(
    model: type[BaseModel] | None, field: str, family: VariantOf | None, child: dict[str, Any]
) -> type[BaseModel] | None:
    """The model of `model.field`: the variant class its `type` names, or the section's class."""
    if model is None or field not in model.model_fields:
        return None
    if family is not None:
        return family.registry.get(variant_name(family, child.get("type", family.default)))
    annotation = model.model_fields[field].annotation
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def _switch(family: VariantOf, old: dict[str, Any], new_type: Any) -> dict[str, Any]:
    """The mapping of the variant `new_type` in place of `old`: `old`'s fields that it has too;
    one it lacks is dropped when it holds the old variant's default, else refused (ValueError)."""
    try:
        name = variant_name(family, new_type)
    except ValueError:
        return {"type": new_type}  # validation names what is wrong with it
    new_cls = family.registry.get(name)
    old_name = variant_name(family, old.get("type", family.default))
    if new_cls is None or old_name == name:
        return {**old, "type": name}
    defaults = _defaults(family, old_name)
    kept: dict[str, Any] = {"type": name}
    for field, value in old.items():
        if field == "type":
            continue
        if field in new_cls.model_fields:
            kept[field] = value
        elif field not in defaults or defaults[field] != value:
            own = ", ".join(f for f in new_cls.model_fields if f != "type") or "none"
            raise ValueError(
                f"{family.key}.{field}={value} is not a field of {family.key}.type={name} (its "
                f"fields: {own}): drop {family.key}.{field} to switch from {old_name}, or keep "
                f"{family.key}.type={old_name}"
            )
    return kept


def _defaults(family: VariantOf, name: str) -> dict[str, Any]:
    """The default field values of the variant `name`, as a dump writes them ({}: unknown)."""
    cls = family.registry.get(name)
    try:
        return cls().model_dump(mode="json") if cls is not None else {}
    except Exception:  # a variant with required fields: none has a default to drop
        return {}
