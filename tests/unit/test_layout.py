"""The layout rules of docs/architecture.md, checked on the source with `ast` (nothing is imported).

Layers: the core (`asyncrl/` but for the three sub-packages below; its parts ordered by
`CORE_ORDER`) <- the fleets (`rollout_servers`, `replay`, `learner`,
`reward_models`) <- the launch layer (`asyncrl.launch`). Around them: the demo (`asyncrl.demo`)
and analysis (`asyncrl.analysis`). Every import counts: module level, inside functions, and under
`TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("asyncrl", "rollout_servers", "replay", "learner", "reward_models")
FLEETS = ("rollout_servers", "replay", "learner", "reward_models")
MAX_FILE_LINES = 400
"""For the five packages; tools/ and tests/ may reach `MAX_SCRIPT_LINES`."""
MAX_SCRIPT_LINES = 500
MAX_SCRIPT_FUNCTION_LINES = 80
"""tools/ and tests/ functions (a benchmark's main may read as one list of steps)."""
MAX_FUNCTION_LINES = 60


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    return {
        _module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
    }


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Project modules `path` imports (`from a.b import c` counts a.b.c when that is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def layer(module: str) -> str:
    """facade | core | launch | demo | analysis | one of FLEETS."""
    if module == "asyncrl":
        return "facade"  # the package's __init__: `asyncrl.run`, the Python entry point
    top, _, rest = module.partition(".")
    if top in FLEETS:
        return top
    sub = rest.partition(".")[0]
    return sub if sub in ("launch", "demo", "analysis") else "core"


def import_graph() -> dict[str, set[str]]:
    sources = _sources()
    modules = set(sources)
    graph = {}
    for name, path in sources.items():
        # a package's own modules importing each other through the package is not an edge
        graph[name] = {
            m for m in _imports(path, modules) if m != name and not name.startswith(m + ".")
        }
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


ALLOWED = {
    "core": {"core"},
    "rollout_servers": {"core", "rollout_servers"},
    "replay": {"core", "replay"},
    "learner": {"core", "learner"},
    "reward_models": {"core", "reward_models"},
    "demo": {"core", "demo"},
    "analysis": {"core", "analysis", "replay"},  # the pipeline model runs the replay's admission
    "launch": {"core", "launch", "demo", "analysis", *FLEETS},
    "facade": {"core", "launch"},  # and nothing imports the facade
}
"""Which layers each layer may import."""


CORE_ORDER = ("base", "wire", "algorithms", "data", "config", "placement", "run_spec", "weights")
"""The core's parts, lowest first: each imports only itself and the parts before it, so no import
runs back up and no two parts form a circle. `base` is the modules every part may use."""
CORE_BASE = {"registry", "dtypes", "cpu", "trace", "metrics", "loggers", "checkpoints"}
CORE_TOP = {"evaluation"}
"""Core modules above every part (the evaluation job reads the config, data and the wire)."""


def core_part(module: str) -> str:
    """The part of the core (`CORE_ORDER`, `CORE_TOP`) a core module belongs to."""
    part = module.split(".")[1]
    return "base" if part in CORE_BASE else part


def core_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports between core parts that run against `CORE_ORDER`, and core modules in no part."""
    found = []
    for src, targets in sorted(graph.items()):
        if layer(src) != "core":
            continue
        part = core_part(src)
        if part in CORE_TOP:
            continue
        if part not in CORE_ORDER:
            found.append(f"{src} is in no part of the core (CORE_ORDER)")
            continue
        for dst in sorted(targets):
            other = core_part(dst)
            if layer(dst) == "core" and (
                other in CORE_TOP or CORE_ORDER.index(other) > CORE_ORDER.index(part)
            ):
                found.append(f"{src} ({part}) imports {dst} ({other}), a later part")
    return found


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{src} ({layer(src)}) imports {dst} ({layer(dst)})"
        for src, targets in sorted(graph.items())
        for dst in sorted(targets)
        if layer(dst) not in ALLOWED[layer(src)]
    ]


def test_no_import_circle():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()) or [])


def test_layers_import_only_what_they_may():
    assert layer_violations(import_graph()) == []


def test_the_core_parts_import_only_earlier_parts():
    assert core_violations(import_graph()) == []


def test_the_core_rule_catches_an_import_running_back_up():
    bad = {
        "asyncrl.wire.codec": {"asyncrl.config"},  # the wire reading the config
        "asyncrl.config": {"asyncrl.weights.sync"},
        "asyncrl.data.rows": {"asyncrl.evaluation"},
        "asyncrl.stray": set(),
    }
    fine = {"asyncrl.weights.sync": {"asyncrl.config", "asyncrl.wire.codec", "asyncrl.registry"}}
    assert len(core_violations(bad)) == 4
    assert core_violations(fine) == []


def test_the_checks_catch_what_they_are_for():
    """The rules fail on a circle, a core module importing a fleet, a fleet importing another
    fleet, and production code importing the demo."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    bad = {
        "asyncrl.config": {"replay.buffer"},
        "learner.trainer": {"replay.prompts"},
        "rollout_servers.rewards.functions": {"asyncrl.demo.tasks"},
        "asyncrl.wire.protocol": {"asyncrl.launch.cli"},
        "asyncrl.launch.cli": {"learner.trainer", "asyncrl.demo.tasks"},
        "asyncrl.metrics": {"asyncrl"},  # the core reaching the entry point
    }
    assert len(layer_violations(bad)) == 5


def test_import_graph_sees_every_kind_of_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "import asyncrl.wire.codec\n"
        "if TYPE_CHECKING:\n    from replay import buffer\n"
        "def f():\n    from learner.losses import aggregate_loss\n"
    )
    modules = {"asyncrl.wire.codec", "replay.buffer", "learner.losses", "replay"}
    assert _imports(src, modules) == {
        "asyncrl.wire.codec",
        "replay.buffer",
        "learner.losses",
        "replay",
    }


def _long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            if length > limit:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return out


@pytest.mark.parametrize("top", [*PACKAGES, "tools", "tests"])
def test_files_and_functions_stay_readable(top):
    files = sorted((ROOT / top).rglob("*.py"))
    limit = MAX_FILE_LINES if top in PACKAGES else MAX_SCRIPT_LINES
    long_files = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p in files
        if (n := len(p.read_text().splitlines())) > limit
    ]
    assert long_files == []
    function_limit = MAX_FUNCTION_LINES if top in PACKAGES else MAX_SCRIPT_FUNCTION_LINES
    assert [f for p in files for f in _long_functions(p, function_limit)] == []


def test_importing_the_package_or_a_core_module_does_not_load_the_launch_layer():
    code = (
        "import sys, asyncrl, asyncrl.config, asyncrl.wire.protocol\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('asyncrl.launch'))\n"
        "assert not loaded, loaded\n"
        "assert callable(asyncrl.run)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


FACADES = {"asyncrl", "asyncrl.config", "rollout_servers.sandbox"}
"""Packages whose `__init__` is their public face: `asyncrl.run`, `asyncrl.config.Config` with
its sections, `rollout_servers.sandbox.Sandbox`. Every other name is imported from its home."""


def _top_level(tree: ast.Module) -> tuple[set[str], dict[str, tuple[str, str]]]:
    """(names a module defines, names it imports: alias -> (module, name))."""
    defined: set[str] = set()
    imported: dict[str, tuple[str, str]] = {}
    for stmt in tree.body:
        for node in ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt]:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    imported[alias.asname or alias.name] = (node.module, alias.name)
    return defined, imported


def reexports(sources: dict[str, str], importers: dict[str, str]) -> list[str]:
    """`from m import x` in `importers` (name -> source text) where project module m (in
    `sources`) does not define x but imports it from elsewhere: a re-export kept for an old
    import path. Package facades (`FACADES`) are exempt."""
    tops = {name: _top_level(ast.parse(text)) for name, text in sources.items()}
    found = []
    for where, text in sorted(importers.items()):
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.ImportFrom) and node.module in tops and node.level == 0):
                continue
            if node.module in FACADES:
                continue
            defined, imported = tops[node.module]
            for alias in node.names:
                home = imported.get(alias.name)
                if home and alias.name not in defined and f"{node.module}.{alias.name}" not in tops:
                    found.append(
                        f"{where}:{node.lineno} imports {alias.name} from {node.module}, "
                        f"which has it from {home[0]}"
                    )
    return found


def test_every_name_is_imported_from_its_home_module():
    """Issue 41: no compatibility re-exports. A split module's names are imported from where
    they now live, so the old module cannot keep a second path to them."""
    sources = {name: path.read_text() for name, path in _sources().items()}
    files = [p for top in [*PACKAGES, "tools", "tests"] for p in sorted((ROOT / top).rglob("*.py"))]
    importers = {str(p.relative_to(ROOT)): p.read_text() for p in files}
    assert reexports(sources, importers) == []


def test_the_reexport_rule_catches_an_old_path():
    sources = {
        "pkg.new": "def moved(): ...\n",
        "pkg.old": "from pkg.new import moved\n\ndef kept(): ...\n",
        "asyncrl.config": "from pkg.new import moved\n",
    }
    importers = {
        "a.py": "from pkg.old import moved, kept\n",
        "b.py": "from pkg.new import moved\nfrom asyncrl.config import moved\n",
    }
    assert reexports(sources, importers) == [
        "a.py:1 imports moved from pkg.old, which has it from pkg.new"
    ]


MAY_NAME_FLEETS = ("asyncrl/launch/", "asyncrl/demo/", "asyncrl/analysis/")
"""Core folders allowed to name a fleet module in a string (they start the fleets)."""
_DOTTED = re.compile(rf"(?:{'|'.join(FLEETS)})(?:\.\w+)+(?::[\w.]+)?")


def fleet_strings(source: str, modules: set[str]) -> list[tuple[int, str]]:
    """(line, string) of each string constant of `source` that is an import path into a fleet
    (`learner.kl` or `learner.kl:kl_penalty`, naming a module of `modules`): a way round the
    import rule. Docstrings (a string standing alone as a statement) may name fleet modules;
    config keys (`learner.lr`, `replay.max_staleness=`) name no module and pass."""
    tree = ast.parse(source)
    docs = {
        id(n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
            continue
        if id(node) in docs or not _DOTTED.fullmatch(node.value):
            continue
        name = node.value.partition(":")[0]
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if "." in name:  # a module below a fleet's package
            found.append((node.lineno, node.value))
    return found


def test_the_core_names_no_fleet_module_in_a_string():
    """DESIGN.md: the core imports no fleet, not even by an import string
    (`import_object("learner.kl:kl_penalty")`): its math lives in the core."""
    sources = _sources()
    fleet = {name for name in sources if name.split(".")[0] in FLEETS}
    bad = [
        f"{rel}:{line} {text!r}"
        for name, path in sources.items()
        if name.split(".")[0] == "asyncrl"
        and not (rel := path.relative_to(ROOT).as_posix()).startswith(MAY_NAME_FLEETS)
        for line, text in fleet_strings(path.read_text(), fleet)
    ]
    assert bad == []


def test_the_fleet_string_rule_catches_an_import_path():
    source = (
        '"""Docstring: the math was `learner.kl.kl_penalty`."""\n'
        "class A:\n"
        '    x = 1\n    """An attribute docstring naming learner.losses."""\n'
        "def f():\n"
        '    fn = import_object("learner.kl:kl_penalty")\n'
        '    g = load("replay.buffer")\n'
        '    key = "learner.lr"\n'
        '    flag = f"learner.lora.rank={1}"\n'
        '    name = "replay.msgpack"\n'
    )
    modules = {"learner", "learner.kl", "learner.losses", "learner.lora", "replay", "replay.buffer"}
    assert fleet_strings(source, modules) == [
        (6, "learner.kl:kl_penalty"),
        (7, "replay.buffer"),
    ]
