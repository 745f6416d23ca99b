"""Environment variables are the process boundary only (docs/architecture.md, "Environment
variables: the process boundary only"): what the launcher tells a process travels in its
`RunSpec`, its `ProcessRole` or the config, read once; the environment holds the run's
secrets, what the launcher hands a child (thread counts, torchrun-style ranks) and the
switches of CUDA and third-party libraries.

This test finds every use of the environment in the five packages by their syntax trees
(`os.environ`, `os.getenv`, `os.putenv`, `os.unsetenv`, `from os import environ`) and names
the variable each one touches (a string, a module constant or a loop over constants; `*`
for the whole environment), then compares the lot with ALLOWED: a new side channel fails
here, and so does an entry that is no longer used (the list and the doc stay true)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("asyncrl", "learner", "replay", "rollout_servers", "reward_models")

ALLOWED = {
    # the run's secrets: never in argv (/proc/<pid>/cmdline) nor in launch.json
    ("asyncrl/wire/auth.py", "ASYNCRL_AUTH_KEY"),
    ("asyncrl/wire/auth.py", "ASYNCRL_RUN_SECRET"),
    ("asyncrl/wire/auth.py", "ASYNCRL_SYNC_KEY"),
    ("asyncrl/launch/eval_command.py", "ASYNCRL_RUN_SECRET"),
    # the launcher's environment for its children
    ("asyncrl/launch/local.py", "*"),
    ("asyncrl/launch/ray_actors.py", "*"),
    ("asyncrl/launch/fleet.py", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    ("learner/fsdp.py", "RANK"),
    ("learner/fsdp.py", "WORLD_SIZE"),
    ("learner/fsdp.py", "LOCAL_RANK"),
    ("learner/fsdp.py", "MASTER_ADDR"),
    ("learner/fsdp.py", "MASTER_PORT"),
    # CUDA and third-party libraries
    ("asyncrl/placement.py", "CUDA_VISIBLE_DEVICES"),
    ("asyncrl/wire/binds.py", "GLOO_SOCKET_IFNAME"),
    ("asyncrl/wire/binds.py", "NCCL_SOCKET_IFNAME"),
    ("asyncrl/launch/ray_connect.py", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"),
    ("asyncrl/loggers.py", "WANDB_MODE"),
    ("asyncrl/loggers.py", "WANDB_SILENT"),
    ("rollout_servers/engines/vllm.py", "VLLM_CPU_KVCACHE_SPACE"),
    ("rollout_servers/engines/sglang.py", "SGLANG_USE_CPU_ENGINE"),
}
_FUNCTIONS = {"getenv", "putenv", "unsetenv"}
_KEYED_METHODS = {"get", "setdefault", "pop", "__getitem__", "__contains__"}


def _constants(tree: ast.Module) -> dict[str, set[str]]:
    """The strings each name is bound to in the module: `NAME = "..."` anywhere, loops
    `for name, ... in (("...", ...), ...)` / `for name in ("...", ...)`, and the constants it
    imports from the packages (`from asyncrl.wire.auth import SECRET_ENV`)."""
    found = _bound_here(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGES):
            source = ROOT / (str(node.module).replace(".", "/") + ".py")
            if source.is_file():
                theirs = _bound_here(ast.parse(source.read_text()))
                for alias in node.names:
                    found.setdefault(alias.asname or alias.name, set()).update(
                        theirs.get(alias.name, ())
                    )
    return found


def _bound_here(tree: ast.Module) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    found.setdefault(target.id, set()).add(node.value.value)
        elif isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple | ast.List):
            target = node.target.elts[0] if isinstance(node.target, ast.Tuple) else node.target
            for item in node.iter.elts:
                first = item.elts[0] if isinstance(item, ast.Tuple) else item
                if isinstance(target, ast.Name) and isinstance(first, ast.Constant):
                    found.setdefault(target.id, set()).add(str(first.value))
    return found


def _names(key: ast.expr | None, constants: dict[str, set[str]]) -> set[str]:
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return {key.value}
    if isinstance(key, ast.Name) and key.id in constants:
        return constants[key.id]
    return {f"<unresolved {ast.unparse(key) if key is not None else '?'}>"}


def _is_os(node: ast.expr, attr: set[str]) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr in attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def environment_uses(path: Path) -> set[str]:
    """The variables of the environment that the module at `path` touches."""
    tree = ast.parse(path.read_text(), str(path))
    constants = _constants(tree)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            used |= {f"<from os import {a.name}>" for a in node.names if "env" in a.name}
        elif isinstance(node, ast.Call) and _is_os(node.func, _FUNCTIONS):
            used |= _names(node.args[0] if node.args else None, constants)
        elif _is_os(node, {"environ", "environb"}):
            used |= _environ_use(node, parents, constants)
    return used


def _environ_use(
    node: ast.expr, parents: dict[ast.AST, ast.AST], constants: dict[str, set[str]]
) -> set[str]:
    """What one `os.environ` expression touches: `[key]`, `.get(key)`, `key in`; else all."""
    parent = parents.get(node)
    if isinstance(parent, ast.Subscript):
        return _names(parent.slice, constants)
    if isinstance(parent, ast.Attribute) and parent.attr in _KEYED_METHODS:
        call = parents.get(parent)
        if isinstance(call, ast.Call) and call.args:
            return _names(call.args[0], constants)
    if isinstance(parent, ast.Compare) and parent.comparators == [node]:
        return _names(parent.left, constants)
    return {"*"}


def package_uses() -> set[tuple[str, str]]:
    uses = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            uses |= {(rel, name) for name in environment_uses(path)}
    return uses


def test_the_environment_is_read_only_at_the_process_boundary():
    uses = package_uses()
    new = sorted(uses - ALLOWED)
    assert not new, (
        f"environment variables used as a side channel: {new}. What the launcher tells a "
        "process travels in RunSpec, ProcessRole or the config (docs/architecture.md); a "
        "library's switch or a secret belongs in ALLOWED and in that doc's list"
    )
    assert sorted(ALLOWED - uses) == [], "ALLOWED lists uses that are gone: drop them (and the doc)"


def test_the_finder_sees_each_form_of_use(tmp_path):
    """Each form the finder must see, in a module it has never met."""
    module = tmp_path / "m.py"
    module.write_text(
        "import os\nfrom os import getenv\nKEY = 'A_KEY'\n"
        "x = os.environ['A'] + os.environ.get(KEY, '') + os.getenv('B', '')\n"
        "y = 'C' in os.environ\nos.environ.setdefault('D', '1')\n"
        "for var, v in (('E', 1), ('F', 2)):\n    os.environ[var] = str(v)\n"
        "child = {**os.environ}\nos.environ.update({})\nos.putenv(name_from_elsewhere, '')\n"
    )
    assert environment_uses(module) == {
        "A", "A_KEY", "B", "C", "D", "E", "F", "*", "<from os import getenv>",
        "<unresolved name_from_elsewhere>",
    }  # fmt: skip
