import math

import pytest
import torch

from asyncrl.algorithms.correction_math import (
    decoupled_ppo_token_loss,
    importance_weights,
    rejection_mask,
)
from asyncrl.algorithms.kl_math import AdaptiveKLController, FixedKLController, kl_penalty
from asyncrl.algorithms.loss_math import gspo_token_loss, mismatch_kl, ppo_clip_token_loss
from learner.losses import (
    AGGREGATION_MODES,
    aggregate_denominator,
    aggregate_loss,
    entropy_from_logits,
)


def test_ppo_clip_and_dual_clip_by_hand():
    old = torch.zeros(1, 5)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 5.0, 2.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    loss, st = ppo_clip_token_loss(logp, old, adv, mask, 0.2, 0.2, clip_c=3.0)
    # t0: A=1, r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped); t1: r=0.5 -> max(-0.5, -0.8) = -0.5
    # t2: A=-1, r=1.1 -> max(1.1, 1.1) = 1.1, min(1.1, 3) = 1.1
    # t3: A=-1, r=5 -> max(5, 1.2) = 5, dual clip min(5, 3) = 3; t4 masked -> 0
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, 1.1, 3.0, 0.0]]))
    assert float(st["tokens"]) == 4.0
    assert float(st["clipped_tokens"]) == 1.0
    assert float(st["dual_clipped_tokens"]) == 1.0
    assert math.isclose(float(st["ratio_sum"]), 1.5 + 0.5 + 1.1 + 5.0, rel_tol=1e-6)
    assert math.isclose(float(st["ratio_max"]), 5.0, rel_tol=1e-6)
    loss, st = ppo_clip_token_loss(logp, old, adv, mask, 0.2, 0.2, clip_c=None)
    assert math.isclose(float(loss[0, 3]), 5.0, rel_tol=1e-6)
    assert float(st["dual_clipped_tokens"]) == 0.0
    with pytest.raises(ValueError, match="clip_c"):
        ppo_clip_token_loss(logp, old, adv, mask, 0.2, 0.2, clip_c=1.0)


def test_dual_clip_bounds_loss_and_kills_gradient_at_large_ratio():
    logp = torch.tensor([[math.log(1e6), 0.0]], requires_grad=True)
    adv = torch.tensor([[-2.0, -2.0]])
    loss, _ = ppo_clip_token_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), 0.2, 0.2, 3.0)
    # -A * clip_c = 2 * 3 = 6 instead of 2e6; at r = 1: max(2, 2) = 2
    torch.testing.assert_close(loss.detach(), torch.tensor([[6.0, 2.0]]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0]]))


def test_ppo_gradient_on_policy_is_minus_advantage_and_padding_is_safe():
    logp = torch.tensor([[-0.3, -1.2, float("-inf")]], requires_grad=True)
    adv = torch.tensor([[0.5, -0.5, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    old = torch.tensor([[-0.3, -1.2, 0.0]])
    loss, _ = ppo_clip_token_loss(logp, old, adv, mask, 0.2, 0.2)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 0.5, 0.0]]))


def test_gspo_by_hand_and_against_sequence_objective():
    old = torch.zeros(3, 3)
    # row 0: log-ratios 0.2, 0.4 (+ padding) -> s = e^0.3; row 1: hole in the middle, mean of
    # -0.1 and -0.3 -> s = e^-0.2; row 2: s = e^0.6 = 1.822 > 1 + 0.5, clipped for A = 1
    logp0 = torch.tensor([[0.2, 0.4, 7.0], [-0.1, 5.0, -0.3], [0.6, 0.6, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0], [-1.0], [1.0]]).expand(3, 3)
    logp = logp0.clone().requires_grad_(True)
    loss, st = gspo_token_loss(logp, old, adv, mask, 0.2, 0.5)
    s0, s1 = math.exp(0.3), math.exp(-0.2)
    expected = torch.tensor([[-s0, -s0, 0.0], [s1, 0.0, s1], [-1.5, -1.5, 0.0]])
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)
    assert float(st["clipped_tokens"]) == 2.0
    num, den = aggregate_loss(loss, mask, "seq-mean-token-mean")
    (num / den).backward()
    # the paper's sequence-level objective, written directly
    ref_logp = logp0.clone().requires_grad_(True)
    m = mask
    seq_ratio = torch.exp(((ref_logp - old) * m).sum(-1) / m.sum(-1))
    a = adv[:, 0]
    j = torch.maximum(-a * seq_ratio, -a * seq_ratio.clamp(0.8, 1.5))
    j.mean().backward()
    torch.testing.assert_close(logp.grad, ref_logp.grad * m, rtol=1e-5, atol=1e-7)
    # by hand: d/dlogp_t of -A s / 3 sequences, s through the mean over 2 tokens -> -A s / 6
    assert math.isclose(float(logp.grad[0, 0]), -s0 / 6, rel_tol=1e-5)
    assert float(logp.grad[2].abs().sum()) == 0.0


def test_decoupled_ppo_on_policy_equals_policy_gradient():
    logp = torch.tensor([[-0.3, -1.2, -0.7], [-2.0, -0.1, -0.5]], requires_grad=True)
    adv = torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    current = logp.detach()
    loss, st = decoupled_ppo_token_loss(
        logp, current, current, adv, mask, 0.2, 0.2, clip_c=3.0, is_weights=None
    )
    # ratio = 1 and weight = 1 everywhere: l = -A * 1, dl/dlogp = -A on sampled tokens
    torch.testing.assert_close(loss.detach(), -adv * mask)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, -adv * mask)
    assert float(st["clipped_tokens"]) == 0.0
    assert float(st["is_weight_sum"]) == 5.0
    assert float(st["behaviour_k3_sum"]) == 0.0


def test_decoupled_ppo_clips_around_proximal_and_weights_by_behaviour():
    prox = torch.zeros(1, 3)
    behav = torch.log(torch.tensor([[0.5, 2.0, 1.0]]))  # weights exp(prox - behav) = 2, 0.5, 1
    logp = torch.log(torch.tensor([[1.1, 1.5, 1.0]])).requires_grad_(True)
    adv = torch.ones(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, st = decoupled_ppo_token_loss(logp, prox, behav, adv, mask, 0.2, 0.2)
    # t0: r = 1.1 in range -> 2 * -1.1 = -2.2; t1: r = 1.5 clipped to 1.2 -> 0.5 * -1.2 = -0.6
    torch.testing.assert_close(loss.detach(), torch.tensor([[-2.2, -0.6, 0.0]]))
    assert float(st["clipped_tokens"]) == 1.0
    assert math.isclose(float(st["is_weight_max"]), 2.0, rel_tol=1e-6)
    # k3 of KL(behav || prox): t0: r = 2 -> 2 - 1 - ln 2; t1: r = 0.5 -> 0.5 - 1 + ln 2
    k3 = (2 - 1 - math.log(2)) + (0.5 - 1 + math.log(2))
    assert math.isclose(float(st["behaviour_k3_sum"]), k3, rel_tol=1e-5)
    capped = importance_weights(prox, behav, mask, "token", cap=1.5)
    loss, _ = decoupled_ppo_token_loss(logp, prox, behav, adv, mask, 0.2, 0.2, None, capped)
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.5 * 1.1, -0.6, 0.0]]))


def test_importance_weights_token_sequence_and_cap():
    prox = torch.log(torch.tensor([[2.0, 3.0, 4.0], [0.5, 1.0, 1.0]])).requires_grad_(True)
    behav = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    w = importance_weights(prox, behav, mask, "token", None)
    assert not w.requires_grad
    torch.testing.assert_close(w, torch.tensor([[2.0, 3.0, 0.0], [0.5, 0.0, 0.0]]))
    w = importance_weights(prox, behav, mask, "token", cap=2.5)
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.5, 0.0], [0.5, 0.0, 0.0]]))
    # sequence: exp(ln 2 + ln 3) = 6 on row 0's sampled tokens (the masked ln 4 left out)
    w = importance_weights(prox, behav, mask, "sequence", None)
    torch.testing.assert_close(w, torch.tensor([[6.0, 6.0, 0.0], [0.5, 0.0, 0.0]]))
    w = importance_weights(prox, behav, mask, "sequence", cap=5.0)
    torch.testing.assert_close(w, torch.tensor([[5.0, 5.0, 0.0], [0.5, 0.0, 0.0]]))


def test_token_rejection_by_ratio_and_k_metrics():
    prox = torch.log(torch.tensor([[3.0, 1.0, 0.4, 100.0]]))
    behav = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    keep, st = rejection_mask(prox, behav, mask, "token", "ratio", low=0.5, high=2.0)
    torch.testing.assert_close(keep, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert float(st["rejected_tokens"]) == 2.0 and float(st["tokens"]) == 3.0
    assert math.isclose(float(st["rejected_fraction"]), 2 / 3, rel_tol=1e-6)
    # log r = ln 2: k1 = -0.6931, k2 = 0.5 * 0.4805 = 0.2402, k3 = 2 - 1 - 0.6931 = 0.3069
    prox = torch.log(torch.tensor([[2.0]]))
    one = torch.ones(1, 1)
    for metric, bound_out, bound_in in (("k2", 0.24, 0.241), ("k3", 0.30, 0.31)):
        out, _ = rejection_mask(prox, torch.zeros(1, 1), one, "token", metric, high=bound_out)
        kept, _ = rejection_mask(prox, torch.zeros(1, 1), one, "token", metric, high=bound_in)
        assert float(out) == 0.0 and float(kept) == 1.0
    out, _ = rejection_mask(prox, torch.zeros(1, 1), one, "token", "k1", low=-0.69)
    kept, _ = rejection_mask(prox, torch.zeros(1, 1), one, "token", "k1", low=-0.7)
    assert float(out) == 0.0 and float(kept) == 1.0


def test_sequence_rejection_removes_whole_sequences():
    prox = torch.tensor([[0.1, 0.1, 0.1], [0.1, -0.1, 3.0], [0.0, 1.0, 0.0]])
    behav = torch.zeros(3, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # sequence ratios: e^0.3 = 1.35 > 1.3 (rejected), e^0 = 1 (kept), e^1 = 2.72 (rejected)
    keep, st = rejection_mask(prox, behav, mask, "sequence", "ratio", high=1.3)
    torch.testing.assert_close(keep, torch.tensor([[0.0] * 3, [1.0, 1.0, 0.0], [0.0] * 3]))
    assert float(st["rejected_sequences"]) == 2.0 and float(st["sequences"]) == 3.0
    assert float(st["rejected_tokens"]) == 5.0
    # k2 mean of row 2 = (0 + 0.5) / 2 = 0.25 > 0.2: its first token (k2 = 0) goes too
    keep, _ = rejection_mask(prox, behav, mask, "sequence", "k2", high=0.2)
    torch.testing.assert_close(keep, torch.tensor([[1.0] * 3, [1.0, 1.0, 0.0], [0.0] * 3]))


def test_aggregate_loss_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 6.0, 7.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    # sampled: row 0 {1, 3} (hole at 2.0), row 1 {4, 5, 6, 7}, row 2 none -> 6 tokens, 2 seqs
    expected = {
        "token-mean": (26.0, 6.0),
        "seq-mean-token-sum": (26.0, 2.0),
        "seq-mean-token-mean": (4 / 2 + 22 / 4, 2.0),
        "seq-mean-token-sum-norm": (26 / 4, 2.0),
    }
    for mode, (num, den) in expected.items():
        n, d = aggregate_loss(loss, mask, mode, horizon=4)
        assert math.isclose(float(n), num) and float(d) == den, mode
    with pytest.raises(ValueError, match="horizon"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(loss, mask, "mean")


def test_aggregation_invariant_under_micro_batching():
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(7, 6, generator=gen) > 0.4).float()
    mask[3] = 0.0
    base = torch.randn(7, 6, generator=gen)
    for mode in AGGREGATION_MODES:
        full_x = base.clone().requires_grad_(True)
        n, d = aggregate_loss(full_x * 2.0, mask, mode, horizon=6)
        (n / d).backward()
        split_x = base.clone().requires_grad_(True)
        global_den = aggregate_denominator(mask, mode)
        total = torch.zeros(())
        for lo, hi in ((0, 2), (2, 3), (3, 7)):
            num, _ = aggregate_loss(split_x[lo:hi] * 2.0, mask[lo:hi], mode, horizon=6)
            (num / global_den).backward()
            total = total + num.detach()
        torch.testing.assert_close(total / global_den, (n / d).detach(), msg=mode)
        torch.testing.assert_close(split_x.grad, full_x.grad, msg=mode)


def test_kl_penalty_kinds_by_hand():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    # logp - ref = (0.5, -1); k3 with x = ref - logp = (-0.5, 1): e^x - x - 1
    k3 = [math.exp(-0.5) + 0.5 - 1, math.e - 2]
    cases = {
        "kl": [0.5, -1.0],
        "abs": [0.5, 1.0],
        "mse": [0.125, 0.5],
        "low_var_kl": k3,
    }
    aliases = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
    for kind, want in cases.items():
        torch.testing.assert_close(kl_penalty(logp, ref, kind), torch.tensor(want))
        if kind in aliases:
            torch.testing.assert_close(kl_penalty(logp, ref, aliases[kind]), torch.tensor(want))
    # ref - logp = 30 -> clamped to 20 -> e^20 - 21 -> clamped to 10
    assert float(kl_penalty(torch.tensor(-30.0), torch.tensor(0.0), "k3")) == 10.0
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(logp, ref, "full")


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(10.0, 4)
    assert fixed.value == 0.05
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=10)
    ctl.update(2.0, 1)  # e = clip(2/1 - 1) = 0.2 -> 0.1 * (1 + 0.2 / 10) = 0.102
    assert math.isclose(ctl.value, 0.102)
    ctl.update(1.1, 1)  # e = 0.1 -> 0.102 * 1.01 = 0.10302
    assert math.isclose(ctl.value, 0.10302)
    ctl.update(0.5, 2)  # e = -0.5 -> clip -0.2 -> 0.10302 * (1 - 0.2 * 2 / 10) = 0.0989...
    assert math.isclose(ctl.value, 0.10302 * 0.96)


def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    # p = (.5, .5) -> ln 2; p = (.25, .75) -> -(.25 ln .25 + .75 ln .75)
    h2 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(2.0), h2]))
    big = entropy_from_logits(torch.tensor([1000.0, 1000.0, 1000.0]))
    assert math.isclose(float(big), math.log(3.0), rel_tol=1e-6)
    masked = torch.tensor([0.0, 0.0, float("-inf")], requires_grad=True)
    h = entropy_from_logits(masked)
    h.backward()
    assert math.isclose(float(h.detach()), math.log(2.0), rel_tol=1e-6)
    assert torch.isfinite(masked.grad).all()


def test_mismatch_kl_by_hand():
    behav = torch.tensor([[-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert float(mismatch_kl(behav, behav, mask)) == 0.0
    learner = behav + torch.tensor([[math.log(2.0), 0.0, 50.0]])
    # token 0: r = 2 -> 2 - 1 - ln 2 = 0.3069; token 1: 0; padded token ignored; mean over 2
    expected = (1 - math.log(2.0)) / 2
    assert math.isclose(float(mismatch_kl(learner, behav, mask)), expected, rel_tol=1e-5)
