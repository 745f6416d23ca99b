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
    with pytest.raises(ConfigError, match="rollout.vllm.dtype was renamed: use rollout.dtype"):
        load_config(None, ["rollout.vllm.dtype=bfloat16"])
    assert load_config(None, ["rollout.dtype=bfloat16"]).rollout.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("rollout.max_tool_calls", "rollout.tool_agent.max_tool_calls"),
        ("rollout.tool_config", "rollout.tool_agent.tool_config"),
        ("rollout.max_response_tokens", "rollout.tool_agent.max_response_tokens"),
        ("rollout.max_batch_size", "rollout.hf.max_batch_size"),
    ],
)
def test_a_renamed_key_is_refused_naming_its_new_name(old, new, tmp_path):
    """From an override and from a file alike; the new name is accepted."""
    with pytest.raises(ConfigError, match=f"{old} was renamed: use {new}"):
        load_config(None, [f"{old}=3"])
    section, key = old.split(".")
    path = tmp_path / "old.yaml"
    path.write_text(f"{section}:\n  {key}: 3\n")
    with pytest.raises(ConfigError, match=f"{old} was renamed: use {new}"):
        load_config(path)
    value = "x.yaml" if new.endswith("tool_config") else "3"
    cfg = load_config(None, [f"{new}={value}"])
    *parents, leaf = new.split(".")
    node = cfg
    for part in parents:
        node = getattr(node, part)
    assert str(getattr(node, leaf)) == value


def test_every_renamed_key_points_to_a_key_that_exists():
    """In the variant the refusal names, when the new key is a field of some variants only."""
    from asyncrl.algorithms.variants import VariantOf
    from asyncrl.config import RENAMED_KEYS, AlgorithmConfig, Config
    from asyncrl.config.renamed import INTO_VARIANT

    for old, new in RENAMED_KEYS.items():
        node = Config()
        if old in INTO_VARIANT and not new.endswith(".type"):
            _, key, field = new.split(".")
            metadata = AlgorithmConfig.model_fields[key].metadata
            family = next(m for m in metadata if isinstance(m, VariantOf))
            assert field in family.registry[INTO_VARIANT[old].split()[0]].model_fields, new
            continue
        for part in new.split("."):
            assert part in type(node).model_fields, new
            node = getattr(node, part)


def test_each_engine_checks_only_its_own_limits():
    """The checks live beside each engine's options (`asyncrl.config.engine`): top_p < 1 is
    refused for the engines that recompute (vLLM, SGLang) and allowed for hf."""
    assert load_config(None, ["rollout.top_p=0.9"]).rollout.top_p == 0.9
    for engine in ("vllm", "sglang"):
        with pytest.raises(ConfigError, match=f"rollout.top_p=0.9 with rollout.engine={engine}"):
            load_config(None, [f"rollout.engine={engine}", "rollout.top_p=0.9"])
    with pytest.raises(ConfigError, match="lora.rank=4 with rollout.engine=sglang"):
        load_config(None, ["rollout.engine=sglang", "learner.lora.rank=4"])
    load_config(None, ["rollout.engine=vllm", "learner.lora.rank=4"])


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
