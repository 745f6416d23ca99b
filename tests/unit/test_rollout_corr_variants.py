"""verl's rollout-correction variants (issue 31, point 5), each against a formula written here
from verl's code (`kl_penalty` in core_algos; `compute_rollout_correction_weights` and
`compute_rollout_rejection_mask` in rollout_corr_helper), not from `asyncrl.algorithms.correction_math`:
the "+" KL kinds (k3+: k3's value, k2's gradient), the batch normalisation of the importance
weights (and its independence of micro-batching), sequence rejection on the sum or the max of
k1/k2/k3, and the config errors of the combinations that mean nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.algorithms.correction_math import (
    importance_weights,
    normalize_importance_weights,
    rejection_mask,
)
from asyncrl.algorithms.kl import FixedKLInReward, ReferenceKLLoss
from asyncrl.algorithms.kl_math import kl_penalty
from asyncrl.config import AlgorithmConfig, ConfigError, LearnerConfig, load_config
from learner.batch import TrainBatch
from learner.corrections import off_policy_corrections
from learner.forward import policy_forward
from learner.fsdp import attention_implementation
from learner.update import UpdateInputs, Updater

CPU = torch.device("cpu")

# ---- k3+ ------------------------------------------------------------------------------------

LOGP = [-1.0, -2.0, -0.3, -30.0]
REF = [-1.5, -1.0, -0.3, 0.0]  # the last: ref - logp = 30, past both of k3's clamps


def _k3(logp: float, ref: float) -> float:
    """verl's low_var_kl: x = clamp(ref - logp, -20, 20), clamp(e^x - x - 1, -10, 10)."""
    x = min(max(ref - logp, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


@pytest.mark.parametrize(
    "kind, value",
    [
        ("k3+", _k3),
        ("low_var_kl+", _k3),
        ("k1+", lambda lp, r: lp - r),
        ("kl+", lambda lp, r: lp - r),
        ("abs+", lambda lp, r: abs(lp - r)),
    ],
)
def test_plus_kinds_have_their_kinds_value_and_k2s_gradient(kind, value):
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(REF, dtype=torch.float64, requires_grad=True)
    got = kl_penalty(logp, ref, kind)
    want = [value(lp, r) for lp, r in zip(LOGP, REF, strict=True)]
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-12)
    # the gradient of 0.5 (logp - ref)^2: logp - ref, unclamped (30 on the clamped token);
    # the reference gets none
    (grad,) = torch.autograd.grad(got.sum(), logp)
    np.testing.assert_allclose(grad.numpy(), np.subtract(LOGP, REF), rtol=1e-12)
    assert torch.autograd.grad(got.sum(), ref, allow_unused=True, retain_graph=False)[0] is None


def test_k3_without_plus_keeps_its_own_gradient():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    (grad,) = torch.autograd.grad(kl_penalty(logp, ref, "k3").sum(), logp)
    # d/dlogp (e^(ref - logp) - (ref - logp) - 1) = 1 - e^(ref - logp)
    torch.testing.assert_close(grad, torch.tensor([1 - math.exp(-0.5), 1 - math.e]))
    with pytest.raises(ValueError, match="k3\\+"):
        kl_penalty(logp, ref, "k2+")  # k2 itself (verl 0.9.1 takes it as k2): refused here


def test_the_config_takes_plus_kinds_for_the_kl_loss_and_the_reward_not_for_rejection():
    cfg = load_config(
        None,
        [
            "algorithm.kl_loss.type=reference",
            "algorithm.kl_loss.estimator=k3+",
            "algorithm.kl_in_reward.type=fixed",
            "algorithm.kl_in_reward.estimator=low_var_kl+",
        ],
    )
    algo = cfg.algorithm
    assert isinstance(algo.kl_loss, ReferenceKLLoss)
    assert isinstance(algo.kl_in_reward, FixedKLInReward)
    assert (algo.kl_loss.estimator, algo.kl_in_reward.estimator) == ("k3+", "low_var_kl+")
    with pytest.raises(ConfigError, match="rejection.metric"):  # a mask has no gradient
        load_config(None, ["algorithm.rejection.type=token", "algorithm.rejection.metric=k3+"])


# ---- batch normalisation of the importance weights --------------------------------------------


def _logps(seed: int, rows: int = 4, width: int = 6):
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(rows, width, generator=g) * 2 - 0.1
    proximal = behaviour + torch.randn(rows, width, generator=g) * 0.5
    mask = (torch.rand(rows, width, generator=g) > 0.3).float()
    mask[1] = 0.0  # a row with no sampled token
    mask[0, 0] = 1.0
    return proximal, behaviour, mask


@pytest.mark.parametrize("seed", [0, 1])
def test_token_batch_normalisation_as_verl(seed):
    proximal, behaviour, mask = _logps(seed)
    p, b, m = proximal.numpy(), behaviour.numpy(), mask.numpy() > 0
    w = np.minimum(np.exp(p - b), 2.0) * m  # truncated first, then normalised (verl)
    mean = w[m].mean()
    got, factor = normalize_importance_weights(
        importance_weights(proximal, behaviour, mask, "token", 2.0), mask, "token"
    )
    np.testing.assert_allclose(float(factor), mean, rtol=1e-6)
    np.testing.assert_allclose(got.numpy(), w / mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got.numpy()[m].mean(), 1.0, rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_sequence_batch_normalisation_averages_one_weight_per_sequence(seed):
    proximal, behaviour, mask = _logps(seed)
    p, b, m = proximal.numpy(), behaviour.numpy(), mask.numpy() > 0
    seq = np.minimum(np.exp(np.where(m, p - b, 0.0).sum(-1)), 3.0)  # one weight per sequence
    mean = seq[m.any(-1)].mean()  # over sequences with a sampled token (row 1 has none)
    got, factor = normalize_importance_weights(
        importance_weights(proximal, behaviour, mask, "sequence", 3.0), mask, "sequence"
    )
    np.testing.assert_allclose(float(factor), mean, rtol=1e-6)
    np.testing.assert_allclose(got.numpy(), (seq / mean)[:, None] * m, rtol=1e-5, atol=1e-7)


def test_a_zero_mean_leaves_the_weights_alone():
    w = torch.zeros(2, 3)
    got, factor = normalize_importance_weights(w, torch.ones(2, 3), "token")
    assert float(factor) == 1.0 and bool((got == 0).all())


def _tiny_batch(rows: int = 12, n: int = 4, seed: int = 0) -> TrainBatch:
    """`rows` samples in groups of `n` sharing a prompt, responses of 1-9 tokens."""
    g = torch.Generator().manual_seed(seed)
    groups = torch.arange(rows) // n
    prompts = torch.randint(3, 6, (rows // n,), generator=g)[groups]
    lengths = prompts + torch.randint(1, 10, (rows,), generator=g)
    pos = torch.arange(int(lengths.max()))[None]
    attention = (pos < lengths[:, None]).long()
    ids = torch.randint(1, 50, attention.shape, generator=g)
    for r in range(rows):
        ids[r, : prompts[r]] = ids[int(groups[r]) * n, : prompts[r]]
    loss_mask = ((pos >= prompts[:, None]) & (pos < lengths[:, None])).float()
    zeros = torch.zeros(attention.shape)
    return TrainBatch(
        ids * attention,
        attention,
        loss_mask,
        zeros,
        zeros.long(),
        torch.zeros(rows),
        groups,
        torch.full((rows,), float("nan")),
        prompts,
    )


def _tiny_model(lc: LearnerConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    config._attn_implementation = attention_implementation(lc, CPU)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_normalised_weights_give_one_loss_whatever_the_micro_batching(level):
    """The weights are normalised once over the whole batch (`off_policy_corrections`, as
    `Learner.compute_advantages` calls it before the update, on every rank alike); the
    update's loss and gradient are then
    those of one big micro-batch whether it runs in 1 or 3 micro-batches."""
    algo = AlgorithmConfig(
        correction={"type": "truncated_is", "level": level, "cap": 2.0, "batch_normalize": True}
    )
    batch = _tiny_batch()
    mask = batch.loss_mask[:, 1:]
    g = torch.Generator().manual_seed(3)
    stats = {}
    for micro in (12, 4):
        lc = LearnerConfig(micro_batch_size=micro)
        model = _tiny_model(lc)
        with torch.no_grad():
            proximal = (
                policy_forward(
                    model, batch, 1.0, False, Updater(model, None, algo, lc, 1.0, 1, 0, CPU).layout
                )[0]
                * mask
            )
        if micro == 12:  # the same behaviour log-probs and advantages for both runs
            behaviour = (proximal + 0.4 * torch.randn(mask.shape, generator=g)) * mask
            adv = torch.randn(batch.size, generator=g)[:, None] * mask
        metrics: dict[str, float] = {}
        weights, _ = off_policy_corrections(algo, proximal, behaviour, mask, metrics)
        assert weights is not None and metrics["is_batch_norm_factor"] != 1.0
        raw = importance_weights(proximal, behaviour, mask, level, 2.0)
        # a mean over the first micro-batch alone would differ: the test has teeth
        part, _ = normalize_importance_weights(raw[:1], mask[:1], level)
        assert not torch.allclose(part, weights[:1])
        inputs = UpdateInputs(adv, behaviour, proximal, weights, None, None, None, None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        updater = Updater(model, optimizer, algo, lc, 1.0, 1, 0, CPU)
        assert len(updater.plan(batch, torch.arange(batch.size))) == 12 // micro
        stats[micro] = updater.run(batch, inputs, 1, 0)
    for key in ("loss", "grad_norm", "clip_frac"):
        assert stats[4][key] == pytest.approx(stats[12][key], rel=1e-4, abs=1e-7), key


# ---- sequence rejection on the sum or the max ---------------------------------------------------


def _verl_seq_stat(p, b, m, metric: str, agg: str) -> np.ndarray:
    """verl's rollout_rs seq_<agg>_<metric>: log r clamped to [-20, 20] (verl's SAFETY_BOUND)."""
    log_r = np.clip(p - b, -20.0, 20.0)
    per_token = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": np.exp(log_r) - 1.0 - log_r}[metric]
    if agg == "sum":
        return np.where(m, per_token, 0.0).sum(-1)
    top = np.where(m, per_token, -np.inf).max(-1)
    return np.where(np.isinf(top), 0.0, top)


@pytest.mark.parametrize(
    "metric, agg", [("k2", "sum"), ("k3", "sum"), ("k2", "max"), ("k3", "max"), ("k1", "sum")]
)
def test_sequence_rejection_on_the_sum_or_the_max_as_verl(metric, agg):
    proximal, behaviour, mask = _logps(5, rows=6, width=7)
    p, b, m = proximal.numpy(), behaviour.numpy(), mask.numpy() > 0
    stat = _verl_seq_stat(p, b, m, metric, agg)
    live = m.any(-1)
    ordered = np.sort(stat[live])  # bounds halfway between two sequences: no ties
    high = float(ordered[-3:-1].mean())  # the top two rejected
    low = float(ordered[:2].mean()) if metric == "k1" else None  # k1: both bounds
    keep_seq = (stat <= high) & (low is None or stat >= low)
    keep, st = rejection_mask(proximal, behaviour, mask, "sequence", metric, low, high, agg)
    np.testing.assert_array_equal(keep.numpy(), keep_seq[:, None] & m)
    assert 0 < keep_seq[live].sum() < live.sum()
    assert float(st["rejected_sequences"]) == (live & ~keep_seq).sum()
    assert float(st["sequences"]) == live.sum()


def test_sum_and_max_differ_from_the_mean_on_a_long_mild_sequence():
    """A long sequence of mild tokens passes a mean bound, fails a sum bound; a sequence with
    one wild token among tame ones fails a max bound that its mean passes."""
    behaviour = torch.zeros(2, 8)
    proximal = torch.tensor([[0.3] * 8, [2.0] + [0.0] * 7])
    mask = torch.ones(2, 8)
    k2 = {"mean": [0.045, 0.25], "sum": [0.36, 2.0], "max": [0.045, 2.0]}  # 0.5 (log r)^2
    for agg, values in k2.items():
        keep, _ = rejection_mask(proximal, behaviour, mask, "sequence", "k2", None, 0.3, agg)
        assert keep[:, 0].tolist() == [float(v <= 0.3) for v in values], agg


# ---- config errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["algorithm.rejection.type=token", "algorithm.rejection.agg=sum"],
            "algorithm.rejection.agg is not a field of algorithm.rejection.type=token",
        ),
        (
            ["algorithm.rejection.type=none", "algorithm.rejection.agg=max"],
            "algorithm.rejection.agg is not a field of algorithm.rejection.type=none",
        ),
        (
            ["algorithm.rejection.type=sequence", "algorithm.rejection.metric=ratio"]
            + ["algorithm.rejection.agg=sum"],
            "product of its token ratios",
        ),
        (
            ["algorithm.rejection.type=sequence", "algorithm.rejection.metric=k1"]
            + ["algorithm.rejection.agg=max"],
            "seq_max_k1",
        ),
        (
            ["algorithm.rejection.type=sequence", "algorithm.rejection.agg=median"],
            "algorithm.rejection.agg",
        ),
        (
            ["algorithm.correction.batch_normalize=true"],
            "algorithm.correction.batch_normalize is not a field of algorithm.correction.type=none",
        ),
    ],
)
def test_meaningless_combinations_are_refused_naming_the_keys(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, overrides)
    assert "algorithm." in str(e.value)


def test_the_meaningful_combinations_load():
    for agg in ("mean", "sum", "max"):
        load_config(
            None,
            [
                "algorithm.rejection.type=sequence",
                "algorithm.rejection.metric=k3",
                f"algorithm.rejection.agg={agg}",
                "algorithm.rejection.high=1.0",
            ],
        )
    load_config(
        None,
        [
            "algorithm.correction.type=truncated_is",
            "algorithm.correction.level=sequence",
            "algorithm.correction.batch_normalize=true",
        ],
    )
    with pytest.raises(ValueError, match="sequence level|reject_level=sequence"):
        rejection_mask(
            torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), "token", "k2", agg="sum"
        )
