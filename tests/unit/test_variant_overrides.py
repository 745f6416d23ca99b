"""Overrides of a variant key (`asyncrl.config.overrides`): a bare name and a mapping are refined
and switched alike, whatever the order, keeping the fields set; a set field the new variant lacks
is refused naming it, a dumped default is dropped (a resume switching the variant); `off` is
`none`; a variant of another family is refused; a resume reports the fields a switch removed."""

from __future__ import annotations

import pytest

from asyncrl.algorithms.corrections import TruncatedIS
from asyncrl.algorithms.kl import ReferenceKLLoss
from asyncrl.algorithms.policy_losses import GSPOLoss
from asyncrl.config import AlgorithmConfig, ConfigError, apply_overrides, load_config
from asyncrl.launch.fleet import prepare_run_dir
from asyncrl.launch.resume import changed_keys


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.policy_loss.clip_ratio_low=0.0003", "algorithm.policy_loss=gspo"],
        ["algorithm.policy_loss=gspo", "algorithm.policy_loss.clip_ratio_low=0.0003"],
        ["algorithm.policy_loss.clip_ratio_low=0.0003", "algorithm.policy_loss.type=gspo"],
        [
            "algorithm.policy_loss={type: gspo, clip_ratio_low: 0.0003}",
            "algorithm.policy_loss=gspo",
        ],
    ],
)
def test_switching_the_variant_keeps_the_fields_set(overrides):
    loss = load_config(None, overrides).algorithm.policy_loss
    assert loss == GSPOLoss(clip_ratio_low=0.0003)


def test_a_files_variant_survives_its_name_given_again(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  policy_loss: {type: gspo, clip_ratio_low: 3.0e-4}\n")
    cfg = load_config(path, ["algorithm.policy_loss=gspo"])
    assert cfg.algorithm.policy_loss == GSPOLoss(clip_ratio_low=0.0003)


def test_a_set_field_the_new_variant_lacks_is_refused_by_name():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.policy_loss.clip_ratio_c=5.0", "algorithm.policy_loss=gspo"])
    assert (
        "algorithm.policy_loss.clip_ratio_c=5.0 is not a field of algorithm.policy_loss.type=gspo"
        in str(e.value)
    )


def test_a_full_dump_switches_its_variant(tmp_path):
    """A resume's config is a full dump: ppo's default clip_ratio_c=3.0 is dropped for gspo."""
    full = load_config(None, ["algorithm.policy_loss.clip_ratio_high=0.28"])
    cfg = apply_overrides(full, ["algorithm.policy_loss.type=gspo"])
    assert cfg.algorithm.policy_loss == GSPOLoss(clip_ratio_high=0.28)
    assert apply_overrides(full, ["algorithm.policy_loss=gspo"]) == cfg
    changed = apply_overrides(full, ["algorithm.policy_loss.clip_ratio_c=4.0"])
    with pytest.raises(ConfigError, match="clip_ratio_c=4.0 is not a field"):
        apply_overrides(changed, ["algorithm.policy_loss.type=gspo"])


def test_a_resume_reports_the_fields_a_switch_removed(tmp_path):
    run_dir = tmp_path / "run"
    prepare_run_dir(load_config(None, [f"trainer.run_dir={run_dir}"]), "asyncrl launch")
    cfg = apply_overrides(load_config(run_dir / "config.yaml"), ["algorithm.policy_loss=gspo"])
    assert changed_keys(run_dir / "config.yaml", cfg) == {
        "algorithm.policy_loss.type": {"was": "ppo", "now": "gspo"},
        "algorithm.policy_loss.clip_ratio_c": {"was": 3.0, "now": None},
    }


def test_the_bare_form_is_refined():
    cfg = load_config(
        None, ["algorithm.correction=truncated_is", "algorithm.correction.level=sequence"]
    )
    assert cfg.algorithm.correction == TruncatedIS(level="sequence")


def test_a_files_bare_form_is_refined(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  kl_loss: reference\n")
    cfg = load_config(path, ["algorithm.kl_loss.coef=0.01"])
    assert cfg.algorithm.kl_loss == ReferenceKLLoss(coef=0.01)


def test_a_field_of_another_variant_names_the_type_to_set():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.correction.level=sequence"])
    assert "set algorithm.correction.type=truncated_is" in str(e.value)


@pytest.mark.parametrize(
    "override",
    ["algorithm.correction=off", "algorithm.kl_in_reward=false", "algorithm.rejection=off"],
)
def test_off_is_none(override):
    assert load_config(None, [override]).algorithm == AlgorithmConfig()


def test_off_where_there_is_no_none_is_refused_in_words():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.policy_loss=off"])
    assert "algorithm.policy_loss cannot be off: name a policy loss" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.correction=3"])
    assert "expected an off-policy correction name" in str(e.value)


def test_a_variant_of_another_family_is_refused():
    with pytest.raises(ValueError, match="algorithm.correction='reference' is not a registered"):
        AlgorithmConfig(correction=ReferenceKLLoss())  # type: ignore[arg-type]
    algo = AlgorithmConfig()
    with pytest.raises(ValueError, match="algorithm.kl_loss"):
        algo.kl_loss = TruncatedIS()  # type: ignore[assignment]
