"""Algorithm choices as typed variants: a family (policy loss, off-policy correction, rejection,
KL in the reward, KL loss) is one `Registry` of `Variant` classes, and a config key names one by
its `type`, carrying only that variant's own fields (prime-rl's loss configs are a
discriminated union on `type` the same way).

A variant is declared once, a class with its `type`, its fields and what it does, under its
family's decorator (`@policy_loss`, `@off_policy_correction`, ...). The config key validates by
the class registered for its `type` (`VariantOf`), so a declaration in a user's module (or an
entry point of the family's group) is accepted as the built-ins are, and the learner calls the
variant's methods instead of branching on mode strings.

In a config a variant is a mapping (`{type: gspo, clip_ratio_low: 0.0003}`; a missing `type` is
the default's) or just its name (`algorithm.policy_loss=gspo`: its fields' defaults; `off` is
`none`). A field that is not the variant's own is refused naming the key, the variant and the
`type` that has it. Overrides refine and switch a variant keeping the fields set
(`asyncrl.config.overrides`).

Variants sit below `asyncrl.config` (`tests/unit/test_layout.py`): they are plain pydantic models
with the config sections' rules (unknown keys are errors, assignments are validated), and they
import no torch: their tensor math is in `learner/`, named by import path and imported on first
use, so validating a config costs no torch import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict
from pydantic_core import core_schema

from asyncrl.registry import Registry


class Variant(BaseModel):
    """Base of every variant: `type` names it in its family's registry."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )

    type: str
    """The variant's name in its family's registry."""


V = TypeVar("V", bound=Variant)


def declare(registry: Registry[Any]) -> Callable[[type[V]], type[V]]:
    """A class decorator registering the variant under its `type` (the field's default, which its
    `Literal` fixes); a later declaration of a name replaces the earlier one."""

    def wrap(cls: type[V]) -> type[V]:
        name = cls.model_fields["type"].default
        if not isinstance(name, str) or not name:
            raise ValueError(f"{cls.__name__} needs a default `type`, its name")
        registry.register(name, cls)
        return cls

    return wrap


@dataclass(frozen=True)
class VariantOf:
    """Annotated metadata of a config key that holds a variant of `registry`:
    `Annotated[A | B, VariantOf(REGISTRY, "section.key", "a")]`. It validates by the class the
    value's `type` names (`default` when absent), and serialises every field of the variant
    whatever its class; the union (the built-ins) is what the docs read."""

    registry: Registry[Any]
    key: str
    """The config key, as errors name it."""
    default: str
    """The `type` of a mapping without one."""

    def validate(self, value: Any) -> Variant:
        if isinstance(value, Variant):
            if self.registry.get(value.type) is type(value):
                return value
            value = value.model_dump()  # another family's variant: refused by its `type`
        if not isinstance(value, dict):
            value = {"type": variant_name(self, value)}
        name = value.get("type", self.default)
        if not isinstance(name, str) or name not in self.registry:
            raise ValueError(
                f"{self.key}={name!r} is not a registered {self.registry.kind}: "
                f"{self.registry.names()}"
            )
        try:
            return self.registry[name].model_validate({**value, "type": name})
        except pydantic.ValidationError as e:
            raise ValueError(_explain(e, self.registry, self.key, name)) from None

    def __get_pydantic_core_schema__(
        self, source: Any, handler: pydantic.GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            self.validate,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda value, info: value.model_dump(mode=info.mode), info_arg=True
            ),
        )


def variant_name(family: VariantOf, value: Any) -> str:
    """The variant `value` names at `family`'s key: a name as it is; `off` (YAML's bare off,
    read as false) is the family's `none`; ValueError naming the key otherwise."""
    if value is False or value == "off":
        if "none" in family.registry:
            return "none"
        raise ValueError(
            f"{family.key} cannot be off: name {_article(family.registry.kind)} "
            f"{family.registry.kind}: {family.registry.names()}"
        )
    if not isinstance(value, str):
        raise ValueError(
            f"{family.key}: expected {_article(family.registry.kind)} {family.registry.kind} "
            "name or a mapping with `type`"
        )
    return value


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _explain(err: pydantic.ValidationError, registry: Registry[Any], key: str, name: str) -> str:
    """One clause per error, each naming the full key; a field of another variant names the
    `type` to set for it."""
    cls = registry[name]
    own = ", ".join(f for f in cls.model_fields if f != "type")
    parts = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] != "extra_forbidden":
            parts.append(f"{key}.{field}: {msg}" if field else f"{key}.type={name}: {msg}")
            continue
        having = [n for n in registry.names() if field in registry[n].model_fields]
        hint = f"; set {key}.type={' or '.join(having)}" if having else ""
        fields = f"its fields: {own}" if own else "it has no fields"
        parts.append(f"{key}.{field} is not a field of {key}.type={name} ({fields}{hint})")
    return "; ".join(parts)
