import pytest

from asyncrl.config import Config, ConfigError, load_config, parse_override
from asyncrl.launch.cli import main


def test_default_config_loads_and_overrides_apply():
    cfg = load_config(
        overrides=["rollout.n=4", "replay.max_staleness=0", "learner.betas=[0.9, 0.95]"]
    )
    assert cfg.rollout.n == 4 and cfg.replay.max_staleness == 0
    assert cfg.learner.betas == (0.9, 0.95)


def test_unknown_key_names_the_key_and_allowed_keys():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["rollout.temprature=0.5"])
    assert "rollout.temprature" in str(e.value) and "temperature" in str(e.value)


def test_invalid_value_names_the_key_and_value():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["replay.max_staleness=-1", "rollout.engine=tgi"])
    text = str(e.value)
    assert "replay.max_staleness" in text and "-1" in text
    assert "rollout.engine" in text and "'hf'" in text


def test_unknown_section_and_malformed_override():
    with pytest.raises(ConfigError, match="bogus"):
        load_config(overrides=["bogus.key=1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("rollout.n")
    with pytest.raises(ConfigError, match="section and a field"):
        parse_override("n=3")


def test_remote_bind_needs_explicit_permission():
    with pytest.raises(ValueError, match="allow_remote"):
        Config.model_validate({"launch": {"host": "0.0.0.0"}})
    Config.model_validate({"launch": {"host": "0.0.0.0", "allow_remote": True}})


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_dry_run_prints_resolved_config(capsys):
    assert main(["launch", "--dry-run", "rollout.n=3"]) == 0
    out = capsys.readouterr().out
    assert "n: 3" in out and "max_staleness" in out


def test_cli_rejects_bad_override_before_starting(capsys):
    assert main(["launch", "rollout.n=0"]) == 2
    assert "rollout.n" in capsys.readouterr().err


def test_vllm_dtype_names_its_new_home():
    with pytest.raises(ConfigError, match="rollout.vllm.dtype is now rollout.dtype"):
        load_config(None, ["rollout.vllm.dtype=bfloat16"])
    assert load_config(None, ["rollout.dtype=bfloat16"]).rollout.dtype == "bfloat16"


def test_lora_is_configured_under_learner_for_either_engine():
    cfg = load_config(None, ["learner.lora.rank=8", "learner.lora.alpha=32"])
    assert cfg.learner.lora.scale == 4.0 and "q_proj" in cfg.learner.lora.target_modules
    assert load_config().learner.lora.rank == 0  # full fine-tuning by default
    assert load_config(None, ["learner.lora.rank=8", "rollout.engine=vllm"]).learner.lora.rank
    with pytest.raises(ConfigError, match="lora.rank"):
        load_config(None, ["learner.lora.rank=-1"])


def test_a_temperature_vllm_refuses_is_refused_before_the_run():
    """vLLM fails every request above temperature 2; the config says so up front instead of a
    run whose every group fails."""
    with pytest.raises(ConfigError, match=r"rollout.temperature=3.0 with rollout.engine=vllm"):
        load_config(None, ["rollout.engine=vllm", "rollout.temperature=3.0"])
    assert load_config(None, ["rollout.engine=vllm", "rollout.temperature=2.0"]).rollout
    assert load_config(None, ["rollout.temperature=3.0"]).rollout.temperature == 3.0  # hf
