"""Docs that cannot drift: finds every module path, config key and file that a docstring or a
doc names and that does not exist. Read as text and with `ast`; nothing of the project is
imported. tests/unit/test_docs_drift.py runs it on the tree.

Where names are read: the module, class and function docstrings of every .py under `SOURCES`,
and docs/*.md and README.md (code blocks included).

What counts as naming something; all other text is prose and is not read:
1. A dotted name that starts with a directory of `SOURCES` or a config section, backticked or
   not, and not right after a `.`, `/`, `$` or word character (`self.replay.x` is code):
   `asyncrl.wire.protocol`, `replay.service.ReplayService`, `tools.bench_agents:LognormalLengthAgent`,
   `replay.max_staleness=2`. It must be one of:
   - a module path: the longest prefix that is a module or package file, then (after `.` or
     `:`) a top-level name that module defines (imported names count only in a package's
     `__init__`, which re-exports: a plain module is named where the name is declared), then
     optionally a member of a class defined there;
   - a config key: a field of `asyncrl.config.Config`, then fields of its section classes; a
     `dict` field ends the check, so does `*` (`rollout.vllm.*`); parts with capitals
     (`trainer.Learner`, a module named relative to its package) are not config keys;
   - an entry-point group: one a `Registry(...)` reads or pyproject.toml declares
     (`asyncrl.tasks`).
   A name whose last part is a file extension (`replay.msgpack`, `learner.md`) is a file name.
2. A path with a directory: `learner/trainer.py`, `.ci/run`, `docs/data/simulator/`. Read only
   when its first component is a top-level entry of the repository that .gitignore does not
   ignore (in a docstring also an entry of the module's own directory: `sandbox/seccomp.py`).
   So runtime paths (`runs/...`, `RUN_DIR/failed_groups.jsonl`, `$OUT/x`, `checkpoints/step_3/`)
   are not read, nor other projects' (`sglang/srt/...`). Under a Python package, a path with
   neither an extension nor a trailing `/` is a name, not a file (the data source
   `asyncrl/arith`).
3. In a docstring, a bare `.py` file name (`engine.py`): a file in the module's own directory.
   Name another project's file with its path (`vllm/worker/worker.py`).
4. In a package's `__init__` docstring, its component list: a bullet or a `;`-clause that starts
   with backticked names and a colon (`` - `buffer`: ``, `` `process` and `child`: ``), each a
   module or sub-package (`engines/`) of the package, or a top-level name of one of its modules;
   and a backticked dotted name that starts with one of its modules, a module path from the
   package (`server.RolloutServer.run`).
5. In markdown, a link target (`[plot](real_model.png)`), relative to the document.
"""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("asyncrl", "learner", "replay", "rollout_servers", "tools")
FILE_EXTENSIONS = frozenset(
    {"py", "md", "yaml", "yml", "toml", "json", "jsonl", "msgpack", "parquet", "png", "txt"}
    | {"log", "pt", "sh", "csv", "html", "cfg"}
)

DOTTED = re.compile(r"(?<![\w.$/-])([A-Za-z_]\w*(?:\.\w+)+(?::\w+(?:\.\w+)*)?)")
PATH = re.compile(r"(?<![\w./~$@:-])(\.?\w[\w.-]*(?:/[\w.-]*)+)")
BARE_PY = re.compile(r"(?<![\w./~$@:-])(\w[\w-]*\.py)\b(?!/)")
COMPONENTS = re.compile(r"(?:^[ \t]*- |; )((?:`\w+/?`(?:, | and | / )?)+):", re.MULTILINE)
RELATIVE_PATH = re.compile(r"`(\w+(?:\.\w+)+(?::\w+(?:\.\w+)*)?)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
REGISTRY_GROUP = re.compile(r'\bRegistry(?:\[[^\]]*\])?\(\s*"[^"]*",\s*"([^"]+)"')
CONFIG_PART = re.compile(r"[a-z_][a-z0-9_]*")
FREE_FIELD_TYPES = frozenset({"dict", "Dict", "Mapping", "Any"})
OPEN_BASES = frozenset({"Generic", "Protocol", "object"})


@dataclass(frozen=True)
class Stale:
    """A name that names nothing: the file and line it is written on, the name, and why."""

    file: str
    line: int
    name: str
    why: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: `{self.name}`: {self.why}"


@dataclass(frozen=True)
class Text:
    """A docstring or a markdown file: the file it is in, the line it starts on, its kind
    ("module" docstring, "definition" docstring, or "markdown")."""

    path: Path
    line: int
    text: str
    kind: str

    def stale(self, offset: int, name: str, why: str) -> Stale:
        line = self.line + self.text.count("\n", 0, offset)
        return Stale(_shown(self.path), line, name, why)


def _shown(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@cache
def _entries(directory: Path) -> frozenset[str]:
    return frozenset(p.name for p in directory.iterdir())


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement in `body`, nested ones included (cheaper than `ast.walk`: expressions are
    skipped)."""
    for node in body:
        yield node
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):
            for part in getattr(node, block, []):
                yield from _statements([part] if isinstance(part, ast.stmt) else part.body)


def _top_level_names(body: list[ast.stmt], imports: bool = True) -> set[str]:
    """Names a module (or class body) binds, under `if`/`try`/`with` blocks too; `*` if it
    star-imports, when any name may exist."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom) and imports:
            names |= {alias.asname or alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for part in getattr(node, block, []):
                    block_body = [part] if isinstance(part, ast.stmt) else part.body
                    names |= _top_level_names(block_body, imports)
    return names


def _member_names(cls: ast.ClassDef) -> set[str]:
    """A class's attributes: what its body binds and every `self.x` its methods assign."""
    names = _top_level_names(cls.body)
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return names


def _simple_names(node: ast.expr) -> set[str]:
    """The bare names in an annotation or a base (`X | None`, `list[X]`, `"X"`, `mod.X`: X)."""
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            names.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            with contextlib.suppress(SyntaxError):
                names |= _simple_names(ast.parse(sub.value, mode="eval").body)
    return names


class Tree:
    """What exists in a checkout: its files, its modules and their names, the config's keys and
    the entry-point groups."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.py_files = [p for d in SOURCES for p in sorted((root / d).rglob("*.py"))]
        self.asts = {p: _parse(p) for p in self.py_files}

    @cached_property
    def classes(self) -> dict[str, list[ast.ClassDef]]:
        found: dict[str, list[ast.ClassDef]] = {}
        for module in self.asts.values():
            for node in _statements(module.body):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(node)
        return found

    @cached_property
    def entry_point_groups(self) -> set[str]:
        """The groups pyproject.toml declares and those a `Registry("kind", "group")` reads."""
        pyproject = (self.root / "pyproject.toml").read_text()
        groups = set(re.findall(r'^\[project\.entry-points\."([^"]+)"\]', pyproject, re.M))
        for path in self.py_files:
            groups.update(REGISTRY_GROUP.findall(path.read_text()))
        return groups

    @cached_property
    def repository_entries(self) -> frozenset[str]:
        """Top-level entries of the checkout that .gitignore does not ignore (a local `runs/`
        or `models/` is not the repository's)."""
        ignore = self.root / ".gitignore"
        patterns = [
            line.strip().strip("/")
            for line in (ignore.read_text().splitlines() if ignore.exists() else [])
            if line.strip() and not line.startswith("#")
        ]
        return frozenset(
            name
            for name in _entries(self.root)
            if name != ".git" and not any(fnmatch.fnmatch(name, p) for p in patterns)
        )

    def has_member(self, class_name: str, member: str) -> bool:
        """Whether the class(es) named `class_name` have `member`, inherited ones included; a
        base from outside the tree may define anything."""
        for cls in self.classes.get(class_name, []):
            if member in _member_names(cls):
                return True
            for base in set().union(*map(_simple_names, cls.bases)) - OPEN_BASES - {class_name}:
                if base not in self.classes or self.has_member(base, member):
                    return True
        return False

    def module_problem(self, name: str, package: Path | None = None) -> str | None:
        """None if `name` is a module path (`a.b`, `a.b:attr`, `a.b.Class.member`) from the
        repository's root, or from `package`'s directory when given, else why."""
        module, _, attrs = name.partition(":")
        parts = module.split(".")
        directory: Path | None = package or self.root
        source = package / "__init__.py" if package else None
        cut = 0
        while cut < len(parts) and directory is not None:
            if (directory / parts[cut]).is_dir():
                directory = directory / parts[cut]
                source = directory / "__init__.py" if (directory / "__init__.py").exists() else None
            elif (directory / f"{parts[cut]}.py").exists():
                directory, source = None, directory / f"{parts[cut]}.py"
            else:
                break
            cut += 1
        found = ".".join(parts[:cut])
        rest = parts[cut:] + (attrs.split(".") if attrs else [])
        if (attrs and cut < len(parts)) or (rest and source is None):
            return f"no module {'.'.join(parts[:cut] + rest[:1])}"
        if not rest or source is None:
            return None
        body = self.module_ast(source).body
        names = _top_level_names(body, imports=source.name == "__init__.py")
        if rest[0] not in names and "*" not in names:
            if rest[0] in _top_level_names(body):
                return f"{found} imports {rest[0]}: name the module that defines it"
            if source.name == "__init__.py" and cut < len(parts):
                return f"no module {found}.{rest[0]}, nor a name {rest[0]} in {found}"
            return f"no name {rest[0]} in {found}"
        own_class = any(isinstance(n, ast.ClassDef) and n.name == rest[0] for n in body)
        if len(rest) > 1 and own_class and not self.has_member(rest[0], rest[1]):
            return f"{found}.{rest[0]} has no attribute {rest[1]}"
        return None

    def module_ast(self, path: Path) -> ast.Module:
        if path not in self.asts:
            self.asts[path] = _parse(path)
        return self.asts[path]

    def config_problem(self, key: str) -> str | None:
        """None if `key` is a config key (`replay.max_staleness`), else why."""
        owners = self.config_roots
        for depth, part in enumerate(key.split(".")):
            fields: dict[str, ast.expr] = {}
            for owner in owners:
                fields |= self._fields(owner)
            if part not in fields:
                return f"no config key {'.'.join(key.split('.')[: depth + 1])}"
            types = _simple_names(fields[part])
            if types & FREE_FIELD_TYPES:
                return None
            owners = [cls for t in types for cls in self.classes.get(t, [])]
        return None

    @cached_property
    def config_roots(self) -> list[ast.ClassDef]:
        """`asyncrl.config.Config`, where every config key starts."""
        body = self.module_ast(self.root / "asyncrl" / "config" / "__init__.py").body
        roots = [n for n in body if isinstance(n, ast.ClassDef) and n.name == "Config"]
        assert roots, "asyncrl/config/__init__.py defines no class Config: config keys have no root"
        return roots

    @cached_property
    def config_sections(self) -> set[str]:
        return {name for root in self.config_roots for name in self._fields(root)}

    def _fields(self, cls: ast.ClassDef) -> dict[str, ast.expr]:
        """The annotated fields of a config class and of its bases in the tree."""
        fields: dict[str, ast.expr] = {}
        for base in set().union(*map(_simple_names, cls.bases)) - {cls.name}:
            for parent in self.classes.get(base, []):
                fields |= self._fields(parent)
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                fields[node.target.id] = node.annotation
        return fields


def docstrings(path: Path, module: ast.Module) -> Iterator[Text]:
    """The module's docstring, then every class's and function's."""
    for node in [module, *_statements(module.body)]:
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = node.body[0] if node.body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            kind = "module" if node is module else "definition"
            yield Text(path, first.value.lineno, first.value.value, kind)


def dotted_problems(tree: Tree, text: Text) -> Iterator[Stale]:
    """Rule 1: dotted names must be module paths, config keys or entry-point groups."""
    for match in DOTTED.finditer(text.text):
        name = match.group(1)
        first, last = name.split(".")[0], re.split(r"[.:]", name)[-1]
        if last in FILE_EXTENSIONS and ":" not in name:
            continue
        is_module = first in SOURCES
        is_key = first in tree.config_sections and all(
            CONFIG_PART.fullmatch(part) for part in name.split(".")
        )
        if not (is_module or is_key) or name in tree.entry_point_groups:
            continue
        problems = [tree.module_problem(name)] if is_module else []
        problems += [tree.config_problem(name)] if is_key else []
        if all(problems):
            yield text.stale(match.start(), name, "; ".join(problems))


def path_problems(tree: Tree, text: Text) -> Iterator[Stale]:
    """Rules 2, 3 and 5: paths with a directory, bare `.py` names, markdown links."""
    bases = [(tree.root, tree.repository_entries)]
    if text.kind != "markdown":
        bases.append((text.path.parent, _entries(text.path.parent)))
    for match in PATH.finditer(text.text):
        path = match.group(1).rstrip(".,:;")
        first, _, rest = path.partition("/")
        is_file = path.endswith("/") or "." in path.rpartition("/")[2]
        readable = [
            base
            for base, entries in bases
            if first in entries
            and rest
            and (is_file or "__init__.py" not in _entries(base / first))
        ]
        if readable and not any((base / path).exists() for base in readable):
            yield text.stale(match.start(), path, "no such file or directory in the repository")
    if text.kind != "markdown":
        for match in BARE_PY.finditer(text.text):
            if match.group(1) not in _entries(text.path.parent):
                yield text.stale(
                    match.start(), match.group(1), f"no such file in {_shown(text.path.parent)}/"
                )
        return
    for match in LINK.finditer(text.text):
        target = match.group(1).partition("#")[0]
        external = "://" in target or target.startswith("mailto:")
        if target and not external and not (text.path.parent / target).exists():
            yield text.stale(match.start(1), target, "links to no file")


def component_problems(tree: Tree, text: Text) -> Iterator[Stale]:
    """Rule 4: what a package's docstring names in the package exists."""
    if text.kind != "module" or text.path.name != "__init__.py":
        return
    package = text.path.parent
    modules = [tree.module_ast(p) for p in sorted(package.glob("*.py"))]
    names = set().union(*(_top_level_names(m.body) for m in modules))
    for match in RELATIVE_PATH.finditer(text.text):
        name = match.group(1)
        first = name.split(".")[0]
        if (package / f"{first}.py").exists() or (package / first / "__init__.py").exists():
            problem = tree.module_problem(name, package)
            if problem:
                yield text.stale(match.start(1), name, problem)
    for match in COMPONENTS.finditer(text.text):
        for name in re.findall(r"`(\w+/?)`", match.group(1)):
            bare = name.rstrip("/")
            if (package / bare).is_dir() or (
                not name.endswith("/") and (bare in names or (package / f"{bare}.py").exists())
            ):
                continue
            yield text.stale(
                match.start(1), name, f"no module, sub-package or name of {_shown(package)}/"
            )


def stale_names(tree: Tree, py_files: list[Path], markdown: list[Path]) -> list[Stale]:
    """Every stale name in the docstrings of `py_files` and in the `markdown` files."""
    texts = [t for p in py_files for t in docstrings(p, tree.module_ast(p))]
    texts += [Text(p, 1, p.read_text(), "markdown") for p in markdown]
    found: list[Stale] = []
    for text in texts:
        found += dotted_problems(tree, text)
        found += path_problems(tree, text)
        found += component_problems(tree, text)
    return found
