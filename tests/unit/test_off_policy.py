"""The off-policy correction as the update applies it, for every policy_loss x decoupled x
is_level the config accepts, against formulas written here from verl 0.9.1's `core_algos` (not
from `asyncrl.algorithms.loss_math`), plus the value loss and the clamps, each by hand."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from asyncrl.algorithms.correction_math import importance_weights
from asyncrl.algorithms.loss_math import MAX_GSPO_LOG_RATIO, gspo_token_loss, ppo_clip_token_loss
from asyncrl.config import AlgorithmConfig, ConfigError, LearnerConfig, load_config
from learner.losses import value_token_loss
from learner.update import UpdateInputs, Updater

CLIP_LOW, CLIP_HIGH, CLIP_C, CAP = 0.2, 0.28, 3.0, 2.0
COMBOS = list(itertools.product(("ppo", "gspo"), (False, True), ("off", "token", "sequence")))


def _accepted(decoupled: bool, is_level: str) -> bool:
    return decoupled or is_level == "off"


def _correction(decoupled: bool, is_level: str) -> list[str]:
    """The old keys' combination in the new spelling (`algorithm.correction`)."""
    if is_level != "off":
        return ["algorithm.correction.type=truncated_is", f"algorithm.correction.level={is_level}"]
    return [f"algorithm.correction.type={'decoupled' if decoupled else 'none'}"]


def _algo(policy_loss: str, decoupled: bool, is_level: str, **clip: float) -> AlgorithmConfig:
    loss = {"type": policy_loss, **clip}
    if policy_loss == "gspo":
        loss.pop("clip_ratio_c", None)
    correction: dict = {"type": "decoupled" if decoupled else "none"}
    if is_level != "off":
        correction = {"type": "truncated_is", "level": is_level, "cap": CAP}
    return AlgorithmConfig(policy_loss=loss, correction=correction)


@pytest.mark.parametrize("policy_loss, decoupled, is_level", COMBOS)
def test_config_accepts_importance_weights_only_with_a_proximal_policy(
    policy_loss, decoupled, is_level
):
    if _accepted(decoupled, is_level):
        cfg = load_config(
            None, [f"algorithm.policy_loss={policy_loss}", *_correction(decoupled, is_level)]
        )
        assert cfg.algorithm.correction.decoupled == decoupled
    else:  # weights without a proximal policy cannot be spelled: the old keys are refused
        overrides = ["algorithm.decoupled=false", f"algorithm.is_level={is_level}"]
        with pytest.raises(ConfigError, match="algorithm.is_level was renamed"):
            load_config(None, overrides)


def _batch(seed: int):
    """Two sequences of 5 tokens with a mask hole and padding; proximal and behaviour differ
    enough that some ratios clip and some weights exceed the cap."""
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(2, 5, generator=g) * 2 - 0.1
    proximal = behaviour + torch.randn(2, 5, generator=g) * 0.6
    logp = (proximal + torch.randn(2, 5, generator=g) * 0.3).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0], [-1.5, -1.5, -1.5, -1.5, -1.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    return logp, proximal, behaviour, adv, mask


def _verl_expected(policy_loss, decoupled, is_level, logp, proximal, behaviour, adv, mask):
    """Per-token loss as verl 0.9.1 computes it: the ratio against old_log_prob (the proximal
    policy in decoupled mode, the rollout policy in bypass mode), rollout IS weights
    min(exp(old - rollout), cap) per token or per sequence multiplied into the clipped loss;
    AReaL's decoupled PPO (untruncated token weights) when decoupled without is_level."""
    old = proximal if decoupled else behaviour
    m = mask > 0
    diff = torch.where(m, logp - old, torch.zeros(()))
    if policy_loss == "ppo":
        ratio = torch.exp(torch.clamp(diff, min=-20.0, max=20.0))
        l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
        clip1 = torch.maximum(l1, l2)
        loss = torch.where(adv < 0, torch.minimum(-adv * CLIP_C, clip1), clip1)
    else:
        seq = (diff * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_seq = logp - logp.detach() + seq.detach()[:, None]
        ratio = torch.exp(torch.clamp(log_seq, max=10.0))
        loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH))
    if decoupled:
        log_w = torch.where(m, proximal - behaviour, torch.zeros(()))
        if is_level == "sequence":
            log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
        w = torch.exp(torch.clamp(log_w, -20.0, 20.0))
        if is_level != "off":
            w = w.clamp(max=CAP)
        loss = loss * w
    return loss * mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "policy_loss, decoupled, is_level", [c for c in COMBOS if _accepted(c[1], c[2])]
)
def test_update_loss_matches_verl_for_every_accepted_combination(
    policy_loss, decoupled, is_level, seed
):
    algo = _algo(
        policy_loss,
        decoupled,
        is_level,
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
        clip_ratio_c=CLIP_C,
    )
    logp, proximal, behaviour, adv, mask = _batch(seed)
    weights = None
    if is_level != "off":  # what Learner.compute_advantages hands the update
        weights = importance_weights(proximal, behaviour, mask, is_level, CAP)
    inputs = UpdateInputs(
        advantages=adv,
        old_logprobs=behaviour,
        proximal=proximal if decoupled else None,
        is_weights=weights,
        keep=None,
        ref_logprobs=None,
        returns=None,
        old_values=None,
    )
    updater = Updater(
        None, None, algo, LearnerConfig(micro_batch_size=4), 1.0, 1, 0, torch.device("cpu")
    )
    got, _ = updater._policy_loss(logp, torch.arange(2), inputs, mask)
    expected = _verl_expected(
        policy_loss, decoupled, is_level, logp, proximal, behaviour, adv, mask
    )
    torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    (grad_got,) = torch.autograd.grad(got.sum(), logp)
    (grad_expected,) = torch.autograd.grad(expected.sum(), logp)
    torch.testing.assert_close(grad_got, grad_expected, rtol=1e-5, atol=1e-6)


def test_gspo_applies_the_importance_weights():
    """The bug this guards against: with policy_loss=gspo the weights were computed and logged
    but never multiplied into the loss."""
    logp, proximal, behaviour, adv, mask = _batch(0)
    w = torch.full_like(mask, 0.5)
    inputs = UpdateInputs(adv, behaviour, proximal, w, None, None, None, None)
    algo = _algo("gspo", True, "token")
    updater = Updater(
        None, None, algo, LearnerConfig(micro_batch_size=4), 1.0, 1, 0, torch.device("cpu")
    )
    got, _ = updater._policy_loss(logp, torch.arange(2), inputs, mask)
    pl = algo.policy_loss
    plain, _ = gspo_token_loss(logp, proximal, adv, mask, pl.clip_ratio_low, pl.clip_ratio_high)
    torch.testing.assert_close(got, plain * 0.5)


def test_gspo_clamps_the_sequence_ratio_at_10_and_gives_clamped_rows_no_gradient():
    """verl 0.9.1 clamps log s_{i,t} at 10 (not 20) with a clamp that cuts the gradient."""
    old = torch.zeros(2, 2)
    logp = torch.tensor([[11.5, 11.5], [0.5, 0.5]], requires_grad=True)
    adv = -torch.ones(2, 2)
    loss, _ = gspo_token_loss(logp, old, adv, torch.ones(2, 2), 0.2, 0.2)
    assert MAX_GSPO_LOG_RATIO == 10.0
    torch.testing.assert_close(loss[0].detach(), torch.full((2,), math.exp(10.0)))
    loss.sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad[0], torch.zeros(2))  # clamped row: no gradient
    # unclamped row: d/dlogp_t of -A s = s / |y| * |y| ... per token s_i (A = -1)
    torch.testing.assert_close(logp.grad[1], torch.full((2,), math.exp(0.5)))


def test_ppo_ratio_is_clamped_on_both_sides_as_verl_does():
    """exp(clamp(logp - old, -20, 20)): a log-ratio of -25 gives exp(-20) and no gradient."""
    logp = torch.tensor([[-25.0, 25.0, 0.1]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0, 1.0]])
    loss, _ = ppo_clip_token_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), 0.2, 0.2, None)
    # t0: A<0, r = e^-20 -> max(e^-20, 0.8) = 0.8 (the clipped branch, no gradient either way)
    torch.testing.assert_close(loss[0, 0].detach(), torch.tensor(0.8))
    unclipped_low = ppo_clip_token_loss(logp, torch.zeros(1, 3), -adv, torch.ones(1, 3), 10, 10)[0]
    torch.testing.assert_close(unclipped_low[0, 0].detach(), torch.tensor(math.exp(-20.0)))
    unclipped_low.sum().backward()
    assert logp.grad is not None
    assert float(logp.grad[0, 0]) == 0.0 and float(logp.grad[0, 1]) == 0.0
    assert float(logp.grad[0, 2]) != 0.0


def test_value_loss_by_hand():
    """0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2) per token, 0 off the mask; clipped_tokens
    counts tokens whose clipped term is strictly larger (verl's vf_clipfrac numerator)."""
    values = torch.tensor([[1.0, 0.0, 2.0, 5.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, st = value_token_loss(values, old, returns, mask, clip=0.5)
    # t0: V=1, Vc=0.5, R=0 -> max(1, 0.25) = 1 -> 0.5
    # t1: V=0, Vc=0, R=1 -> max(1, 1) = 1 -> 0.5
    # t2: V=2, Vc=1.5, R=3 -> max(1, 2.25) = 2.25 -> 1.125 (clipped term larger)
    # t3: masked -> 0
    torch.testing.assert_close(loss.detach(), torch.tensor([[0.5, 0.5, 1.125, 0.0]]))
    assert float(st["tokens"]) == 3.0 and float(st["clipped_tokens"]) == 1.0
    loss.sum().backward()
    # t0: d/dV 0.5 (V - R)^2 = V - R = 1; t1: both equal, max picks the first: -1; t2: the
    # clipped branch is active and V is beyond V_old + c, so no gradient
    assert values.grad is not None
    torch.testing.assert_close(values.grad, torch.tensor([[1.0, -1.0, 0.0, 0.0]]))
