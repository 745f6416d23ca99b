"""The flat algorithm keys became typed variants (`asyncrl.algorithms.variants`): each old key is
refused naming its new home and, where that is a field of some variants only, the variant to
pick (`asyncrl.config.renamed.INTO_VARIANT`); the new spelling loads."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("old", "message", "new"),
    [
        (
            "algorithm.is_level=token",
            "algorithm.is_level was renamed: use algorithm.correction.level with "
            "algorithm.correction.type=truncated_is",
            ["algorithm.correction.type=truncated_is", "algorithm.correction.level=token"],
        ),
        (
            "algorithm.decoupled=true",
            "algorithm.decoupled was renamed: use algorithm.correction.type "
            "(decoupled or truncated_is)",
            ["algorithm.correction=decoupled"],
        ),
        (
            "algorithm.clip_ratio_high=0.28",
            "algorithm.clip_ratio_high was renamed: use algorithm.policy_loss.clip_ratio_high",
            ["algorithm.policy_loss.clip_ratio_high=0.28"],
        ),
        (
            "algorithm.kl_loss_coef=0.01",
            "algorithm.kl_loss_coef was renamed: use algorithm.kl_loss.coef with "
            "algorithm.kl_loss.type=reference",
            ["algorithm.kl_loss.type=reference", "algorithm.kl_loss.coef=0.01"],
        ),
        (
            "algorithm.reject_agg=max",
            "algorithm.reject_agg was renamed: use algorithm.rejection.agg with "
            "algorithm.rejection.type=sequence",
            ["algorithm.rejection={type: sequence, metric: k3, agg: max, high: 0.2}"],
        ),
    ],
)
def test_an_old_algorithm_key_names_its_variant(old, message, new):
    with pytest.raises(ConfigError) as e:
        load_config(None, [old])
    assert message in str(e.value)
    load_config(None, new)


@pytest.mark.parametrize(
    ("old", "message"),
    [
        (
            "algorithm.decoupled=false",
            "use algorithm.correction.type=none (what decoupled: false was)",
        ),
        (
            "algorithm.use_kl_in_reward=false",
            "use algorithm.kl_in_reward.type=none (what use_kl_in_reward: false was)",
        ),
        ("algorithm.reject_level=off", "use algorithm.rejection.type=none"),
        ("algorithm.reject_level=token", "use algorithm.rejection.type=token"),
        ("algorithm.kl_ctrl=adaptive", "use algorithm.kl_in_reward.type=adaptive"),
    ],
)
def test_the_refusal_names_the_variant_the_old_value_meant(old, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [old])
    assert message in str(e.value)
