"""Docs that cannot drift: no docstring or doc names a module path, config key or file that does
not exist (the rules of what counts as naming one: tests/unit/docs_drift.py)."""

from __future__ import annotations

from pathlib import Path

from docs_drift import ROOT, Tree, stale_names

# Names that are stale on purpose, each written as history; (file, name): why it stays.
HISTORICAL = {
    ("docs/vllm.md", "rollout.vllm.dtype"): "the key's old name, said to have moved",
    ("tools/bench_sandbox.py", "rollout_servers/reward_sandbox.py"): "read from git at a commit",
}


def test_no_docstring_or_doc_names_a_missing_module_key_or_file():
    tree = Tree(ROOT)
    markdown = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    found = stale_names(tree, tree.py_files, markdown)
    stale = [s for s in found if (s.file, s.name) not in HISTORICAL]
    unused = set(HISTORICAL) - {(s.file, s.name) for s in found}
    assert not stale, f"{len(stale)} stale names (fix the text or the name):\n" + "\n".join(
        map(str, stale)
    )
    assert not unused, f"HISTORICAL entries no text needs any more: {sorted(unused)}"


# A checkout of its own, so that what the planted texts name does not move with the tree.
PLANTED_REPOSITORY = {
    ".gitignore": "runs/\n",
    "pyproject.toml": '[project.entry-points."asyncrl.tasks"]\n',
    "configs/default.yaml": "",
    "runs/x/metrics.jsonl": "",
    "asyncrl/__init__.py": "",
    "asyncrl/config/__init__.py": (
        "class ReplayConfig:\n    max_staleness: int = 2\n    kwargs: dict[str, int] = {}\n\n\n"
        "class Config:\n    replay: ReplayConfig = ReplayConfig()\n"
    ),
    "asyncrl/algorithms/estimators.py": 'ESTIMATORS = Registry("advantage estimator", "asyncrl.algorithms.estimators")\n',
    "asyncrl/algorithms/advantages.py": "from asyncrl.algorithms.estimators import ESTIMATORS\n",
    "replay/leases.py": (
        "class LeaseDesk:\n    def __init__(self):\n        self.held = {}\n\n"
        "    def grant(self): ...\n"
    ),
    "replay/__init__.py": '''"""A package.

Components, wired by `service.run_replay` (stale) through `leases.LeaseDesk`:
- `leases`: is here; `gone`: is not.
- `engines/` and `service`: a missing sub-package and a module.
"""
''',
    "replay/service.py": '''"""A module.

Stale: `asyncrl.no_such_module.thing`, `replay.leases.LeaseDesk.no_such_method`,
`asyncrl.algorithms.advantages.ESTIMATORS` (imported there, not declared), `replay.no_such_key`,
`engine.py` and configs/no_such.yaml.
Valid: `asyncrl.config.Config`, `replay.leases.LeaseDesk.grant`, `replay.leases.LeaseDesk.held`,
`asyncrl.algorithms.estimators.ESTIMATORS`, `replay.max_staleness=2`, `replay.kwargs.any`, `asyncrl.tasks`,
`leases.py`, configs/default.yaml and docs/pipeline.md.
Not names of the repository: runs/x/gone.jsonl, RUN_DIR/failed_groups.jsonl, $OUT/a.json,
`replay.msgpack`, the data source `asyncrl/arith`, vllm/worker/worker.py, `trainer.Learner`,
e.g. and i.e.
"""


def planted():
    """A function docstring: `replay.gone` is stale, `replay.leases` is not."""
''',
    "docs/pipeline.md": "",
    "docs/plot.png": "",
    "docs/planted.md": """# A doc

`asyncrl.config:Gone` and docs/gone.md are stale, so is [a plot](gone.png);
`asyncrl.config:Config`, docs/pipeline.md and [a plot](plot.png) are not.
""",
}


def test_planted_stale_names_are_reported_with_their_line(tmp_path):
    for name, text in PLANTED_REPOSITORY.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    tree = Tree(tmp_path)
    found = stale_names(tree, tree.py_files, [tmp_path / "docs" / "planted.md"])
    assert {(Path(s.file).relative_to(tmp_path).as_posix(), s.line, s.name) for s in found} == {
        ("replay/__init__.py", 3, "service.run_replay"),
        ("replay/__init__.py", 4, "gone"),
        ("replay/__init__.py", 5, "engines/"),
        ("replay/service.py", 3, "asyncrl.no_such_module.thing"),
        ("replay/service.py", 3, "replay.leases.LeaseDesk.no_such_method"),
        ("replay/service.py", 4, "asyncrl.algorithms.advantages.ESTIMATORS"),
        ("replay/service.py", 4, "replay.no_such_key"),
        ("replay/service.py", 5, "engine.py"),
        ("replay/service.py", 5, "configs/no_such.yaml"),
        ("replay/service.py", 16, "replay.gone"),
        ("docs/planted.md", 3, "asyncrl.config:Gone"),
        ("docs/planted.md", 3, "docs/gone.md"),
        ("docs/planted.md", 3, "gone.png"),
    }
    assert len(found) == 13
    assert str(found[0]).startswith(f"{tmp_path}/")
