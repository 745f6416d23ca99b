"""Lengths that cannot fit the model's context fail before anything starts, naming the keys
and the model's limit (the engine would otherwise cut every response at the context)."""

from __future__ import annotations

import json
import time

import pytest

from asyncrl.config import load_config
from asyncrl.launch.fleet import LaunchError
from asyncrl.launch.run import check_lengths, launch


def _model(tmp_path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return str(tmp_path)


def test_a_response_budget_as_long_as_the_context_fails_in_under_a_second(tmp_path):
    (tmp_path / "m").mkdir()
    model = _model(tmp_path / "m", max_position_embeddings=256)
    cfg = load_config(
        None,
        [
            f"trainer.model_path={model}",
            "rollout.max_new_tokens=100000",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    start = time.monotonic()
    with pytest.raises(LaunchError) as e:
        launch(cfg)
    assert time.monotonic() - start < 1.0
    assert "rollout.max_new_tokens=100000" in str(e.value)
    assert "context of 256 tokens (max_position_embeddings in" in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing was created


def test_prompt_plus_response_beyond_the_context_names_both_keys(tmp_path):
    model = _model(tmp_path, max_position_embeddings=256)
    cfg = load_config(None, ["data.max_prompt_length=200", "rollout.max_new_tokens=100"])
    with pytest.raises(
        LaunchError, match=r"data.max_prompt_length=200 plus rollout.max_new_tokens=100 is 300"
    ):
        check_lengths(cfg, model)
    check_lengths(
        load_config(None, ["data.max_prompt_length=156", "rollout.max_new_tokens=100"]), model
    )


def test_the_engines_own_cap_is_the_context_when_lower(tmp_path):
    model = _model(tmp_path, max_position_embeddings=4096)
    cfg = load_config(
        None,
        ["rollout.engine=vllm", "rollout.vllm.max_model_len=512", "rollout.max_new_tokens=600"],
    )
    with pytest.raises(LaunchError, match=r"context of 512 tokens \(rollout.vllm.max_model_len\)"):
        check_lengths(cfg, model)


def test_other_names_of_the_context_and_none_at_all(tmp_path):
    cfg = load_config(None, ["rollout.max_new_tokens=1024"])
    with pytest.raises(LaunchError, match="n_positions"):
        check_lengths(cfg, _model(tmp_path, n_positions=1024))
    check_lengths(cfg, _model(tmp_path, hidden_size=8))  # states no context: nothing to check


def test_an_engine_cap_set_above_the_config_is_trusted(tmp_path):
    """A rope-scaled model (YaRN) serves more than its max_position_embeddings when the engine
    is told so: the cap the user set wins."""
    model = _model(tmp_path, max_position_embeddings=32768)
    overrides = ["rollout.engine=vllm", "rollout.vllm.max_model_len=131072"]
    check_lengths(load_config(None, [*overrides, "rollout.max_new_tokens=40000"]), model)
