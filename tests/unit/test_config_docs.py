"""The config described from its own fields: `asyncrl config`, the annotated `--dry-run`,
the nearest-key suggestion and `--version`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from asyncrl.config import Config, ConfigError, config_to_yaml, load_config
from asyncrl.config.docs import describe, nearest_key, walk
from asyncrl.launch.cli import main


def test_asyncrl_config_replay_lists_max_staleness_with_its_docstring(capsys):
    assert main(["config", "replay"]) == 0
    out = capsys.readouterr().out
    doc = Config.model_fields["replay"].annotation.model_fields["max_staleness"].description
    assert "replay.max_staleness: int = 2  (>= 0)" in out
    assert " ".join(doc.split())[:60] in " ".join(out.split())
    assert "learner." not in out


def test_every_key_is_documented():
    undocumented = [k.path for k in walk(Config) if not k.doc]
    assert not undocumented, f"config keys without a docstring: {undocumented}"


def test_describe_covers_every_key_and_nested_sections():
    out = describe(Config)
    for key in walk(Config):
        assert f"\n{key.path}: " in "\n" + out
    assert "rollout.vllm." in describe(Config, "rollout.vllm")


def test_an_unknown_section_names_the_sections(capsys):
    assert main(["config", "nope"]) == 2
    assert "sections: data, rollout" in capsys.readouterr().err


def test_the_annotated_dry_run_loads_back_to_the_same_config():
    cfg = load_config(None, ["rollout.n=3", "data.train_files=[a.parquet, b.parquet]"])
    text = config_to_yaml(cfg, comments=True)
    assert "  # A sample of policy version v is trained" in text
    assert yaml.safe_load(text) == cfg.model_dump(mode="json")
    assert Config.model_validate(yaml.safe_load(text)) == cfg


@pytest.mark.parametrize(
    ("override", "suggested"),
    [
        ("replay.max_stalness=1", "replay.max_staleness"),  # a typo in the right section
        ("trainer.max_staleness=1", "replay.max_staleness"),  # the right key, wrong section
        ("learner.learning_rate=1e-5", None),  # nothing close: no guess
    ],
)
def test_an_unknown_key_suggests_the_nearest(override, suggested):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    if suggested:
        assert f"did you mean {suggested}?" in str(e.value)
    else:
        assert "did you mean" not in str(e.value)


def test_nearest_key_at_the_top_level():
    assert nearest_key(Config, "", "replays") == "replay"


def test_version():
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.launch.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("asyncrl ")


def test_a_variant_key_lists_each_variant_with_its_own_documented_fields():
    """`asyncrl config algorithm` shows what each variant takes: a field of one variant only
    (ppo's dual clip, truncated_is's cap) appears under that variant and no other."""
    text = describe(Config, "algorithm")
    ppo = text.index("algorithm.policy_loss.type=ppo:")
    gspo = text.index("algorithm.policy_loss.type=gspo:")
    dual_clip = text.index("algorithm.policy_loss.clip_ratio_c: float | None = 3.0")
    assert ppo < dual_clip < gspo
    assert text.count("algorithm.policy_loss.clip_ratio_c:") == 1
    truncated = text.index("algorithm.correction.type=truncated_is:")
    assert "algorithm.correction.cap: float | None = 2.0" in text[truncated:]
    assert "algorithm.correction.type=none: no fields" in text
