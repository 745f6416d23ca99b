"""Named families that users extend: one small registry class serves all of them.

Agent loops, tools, interactions, reward functions, tasks and advantage estimators are each one
`Registry` plus one declaration per member. A member is registered three ways, and looked up the
same way whichever was used:

- by a decorator in the module that defines it: `@TOOLS.register("calculator")`;
- by an import path, imported on first use: `TOOLS.register("python", "pkg.module:PythonTool")`
  (how a package names its built-ins without importing them, so no import circle forms);
- by a Python entry point of an installed package, in the registry's `entry_point_group`:

      [project.entry-points."asyncrl.rewards"]
      "my_source" = "my_package.rewards:my_reward_fn"

  This is how the embedded demo task plugs in (see pyproject.toml), and how a user's package
  adds a task or a reward without touching asyncrl. Entry points are read once, by name only;
  nothing is imported until a member is used.

`resolve` also accepts `package.module:Attr` for a member that was never registered, when the
caller allows it (configuration may name an import path; dataset rows may not). `import_object`
is the one way any `module:attr` string becomes an object (registries, estimator declarations,
the reward workers).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")
U = TypeVar("U")


def import_object(path: str) -> Any:
    """The object at the import path `package.module:attr` (`attr` may be dotted, as in
    `Class.method`), importing the module now. ValueError naming `path` when it is not of that
    form, its module cannot be found, or the module has no such attribute; any other error
    raised while importing the module propagates as it is (a bug in that module)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path of the form package.module:attr")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"cannot import {module_name!r} (from {path!r}): {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """Name -> member (or -> `module:attr` of a member not imported yet)."""

    def __init__(self, kind: str, entry_point_group: str | None = None) -> None:
        self.kind = kind
        """What the members are, for error messages ("tool", "reward function", ...)."""
        self.entry_point_group = entry_point_group
        self._members: dict[str, T | str] = {}
        self._entry_points_read = entry_point_group is None

    @overload
    def register(self, name: str) -> Callable[[U], U]: ...
    @overload
    def register(self, name: str, member: T | str) -> T | str: ...
    def register(self, name: str, member: Any = None) -> Any:
        """`@registry.register("name")` over a member, or `registry.register("name", member)`
        where member may be an import path `package.module:Attr`. A later registration of a
        name replaces the earlier one (a user may override a built-in)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty string name, got {name!r}")
        if member is not None:
            self._members[name] = member
            return member

        def wrap(obj: U) -> U:
            self._members[name] = obj  # type: ignore[assignment]
            return obj

        return wrap

    def unregister(self, name: str) -> None:
        """Remove `name` (tests that register a member clean up with this)."""
        self._read_entry_points()
        self._members.pop(name, None)

    def names(self) -> list[str]:
        """Every registered name, in registration order (entry points last)."""
        self._read_entry_points()
        return list(self._members)

    def __contains__(self, name: object) -> bool:
        self._read_entry_points()
        return name in self._members

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __getitem__(self, name: str) -> T:
        """The member registered as `name` (imported now if it was registered as a path)."""
        self._read_entry_points()
        if name not in self._members:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {self.names()}")
        member = self._members[name]
        if isinstance(member, str):
            member = self._members[name] = self._import(member, name)
        return member

    def get(self, name: str) -> T | None:
        """The member registered as `name`, or None."""
        if name not in self:
            return None
        return self[name]

    def resolve(self, name_or_path: str, allow_path: bool = True) -> T:
        """The member registered as `name_or_path`, else (when `allow_path`) the object at the
        import path `package.module:Attr`. Raises ValueError naming the registered members."""
        if name_or_path in self:
            return self[name_or_path]
        if allow_path and ":" in name_or_path:
            return self._import(name_or_path, name_or_path)
        hint = ", or an import path like package.module:Name" if allow_path else ""
        raise ValueError(
            f"unknown {self.kind} {name_or_path!r}: registered are {self.names()}{hint}"
        )

    def _import(self, path: str, name: str) -> T:
        try:
            return import_object(path)
        except ValueError as e:
            raise ValueError(f"{self.kind} {name!r}: {e}") from e

    def _read_entry_points(self) -> None:
        """Add the names of installed entry points (once; explicit registrations win)."""
        if self._entry_points_read:
            return
        self._entry_points_read = True
        for ep in entry_points(group=self.entry_point_group or ""):
            self._members.setdefault(ep.name, ep.value)
