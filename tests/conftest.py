"""Fixtures shared by every tier."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The Ray launcher's plan imports Ray, which the project installs everywhere but the lent GPU
# machine lacks (tools/gpu_check.sh installs only what asyncrl needs there): without Ray, those
# tests are left out instead of failing the whole collection.
collect_ignore = [] if importlib.util.find_spec("ray") else ["unit/test_ray_placement.py"]

ENGINE_STEP_TIMEOUT_S = 1800
"""A vLLM, SmolLM2 or SGLang test may take this long (engine start-up and a real model's
training on CPU); every other test gets `timeout` in pyproject.toml (pytest-timeout)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        engine_step = any(item.get_closest_marker(m) for m in ("vllm", "smollm2", "sglang"))
        if engine_step and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(ENGINE_STEP_TIMEOUT_S))


@pytest.fixture(scope="module")
def replay_fuzz() -> Iterator[ModuleType]:
    """The message fuzzer of the replay (tools/replay_fuzz/), imported from its path as
    tools/simulate.py's tests do: tools/ is not a package of the project."""
    init = ROOT / "tools" / "replay_fuzz" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "replay_fuzz", init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["replay_fuzz"] = module  # its modules import each other through the package
    spec.loader.exec_module(module)
    yield module
    for name in [n for n in sys.modules if n == "replay_fuzz" or n.startswith("replay_fuzz.")]:
        sys.modules.pop(name)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    """The embedded tiny model (and its tokenizer) saved in a folder, once per test module; a
    module that needs another model (vLLM's head size) defines its own."""
    from asyncrl.demo.model_cache import TinyModelSpec
    from asyncrl.demo.tiny_model import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(tokenizer, TinyModelSpec(), seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
