"""Every algorithm option runs through the real pipeline (replay, server, FSDP2 learner) and
produces finite losses and the metrics it promises."""

import math

import pytest

from asyncrl.config import load_config
from asyncrl.launch.run import launch
from asyncrl.metrics import read_jsonl

pytestmark = pytest.mark.integration

LONG = {"decoupled_tis_reject", "gae_two_ranks", "rollout_corr_variants"}
"""Cases of half a minute or more on 2 cores: the `long` tier (.ci/run's own step)."""

CASES = {
    "gae_two_ranks": (
        ["algorithm.adv_estimator=gae", "learner.world_size=2"],
        ["value_loss", "value_mean", "critic_grad_norm"],
    ),
    "rloo": (["algorithm.adv_estimator=rloo"], []),
    "rpp": (["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.99"], []),
    "rpp_baseline": (["algorithm.adv_estimator=reinforce_plus_plus_baseline"], []),
    "remax": (["algorithm.adv_estimator=remax"], []),
    "decoupled_tis_reject": (
        [
            "algorithm.correction.type=truncated_is",
            "algorithm.correction.level=sequence",
            "algorithm.correction.cap=2.0",
            "algorithm.rejection.type=token",
            "algorithm.rejection.metric=k3",
            "algorithm.rejection.high=5.0",
            "replay.max_staleness=4",
        ],
        ["is_weight_mean", "is_weight_max", "masked_token_frac", "proximal_behaviour_kl"],
    ),
    "rollout_corr_variants": (
        [
            "algorithm.correction.type=truncated_is",
            "algorithm.correction.level=token",
            "algorithm.correction.batch_normalize=true",
            "algorithm.rejection.type=sequence",
            "algorithm.rejection.metric=k3",
            "algorithm.rejection.agg=max",
            "algorithm.rejection.high=5.0",
            "algorithm.kl_loss.type=reference",
            "algorithm.kl_loss.estimator=k3+",
        ],
        ["is_batch_norm_factor", "is_norm_weight_max", "masked_seq_frac", "kl_loss_ref"],
    ),
    "gspo_seq_mean": (
        [
            "algorithm.policy_loss.type=gspo",
            "algorithm.policy_loss.clip_ratio_low=0.0003",
            "algorithm.policy_loss.clip_ratio_high=0.0004",
            "algorithm.loss_agg_mode=seq-mean-token-mean",
        ],
        [],
    ),
    "kl_everywhere_epochs": (
        [
            "algorithm.kl_in_reward.type=adaptive",
            "algorithm.kl_loss.type=reference",
            "algorithm.entropy_coeff=0.01",
            "algorithm.loss_agg_mode=seq-mean-token-sum-norm",
            "learner.ppo_epochs=2",
            "learner.ppo_mini_batch_size=2",
        ],
        ["kl_in_reward", "kl_coef", "kl_loss_ref"],
    ),
}
COMMON = [
    "mismatch_kl",
    "clip_frac",
    "ratio_mean",
    "ratio_max",
    "entropy",
    "grad_norm",
    "adv_mean",
    "adv_std",
    "loss",
    "reward_mean",
]


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.long) if c in LONG else c for c in sorted(CASES)]
)
def test_algorithm_runs_end_to_end(case, tmp_path, model_cache):
    overrides, extra_metrics = CASES[case]
    cfg = load_config(
        overrides=[
            f"trainer.run_dir={tmp_path / 'run'}",
            f"trainer.cache_dir={model_cache}",
            "trainer.warmstart_steps=100",
            "trainer.total_steps=3",
            "trainer.save_final=false",
            "data.train_batch_size=4",
            "rollout.n=4",
            "learner.micro_batch_size=8",
            "launch.progress=none",
            *overrides,
        ]
    )
    rows = read_jsonl(launch(cfg) / "metrics.jsonl")
    assert [r["version"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in COMMON + extra_metrics:
            assert key in r and math.isfinite(r[key]), f"{case}: metric {key} missing or not finite"
