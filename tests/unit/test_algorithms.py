import math

import torch

from learner.algorithms import grpo_advantages, ppo_clip_loss


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    adv = grpo_advantages(rewards, groups, eps=0.0 + 1e-12)
    # group 0: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    std0 = math.sqrt(1 / 3)
    expected = [(2 / 3) / std0, (-1 / 3) / std0, (-1 / 3) / std0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_grpo_advantages_sum_to_zero_per_group_and_singleton_is_zero():
    torch.manual_seed(0)
    rewards = torch.rand(12)
    groups = torch.tensor([0] * 5 + [1] * 6 + [2])
    for norm in (True, False):
        adv = grpo_advantages(rewards, groups, norm_by_std=norm)
        for g in range(3):
            assert abs(float(adv[groups == g].sum())) < 1e-5
        assert float(adv[-1]) == 0.0


def test_dr_grpo_is_mean_centred_only():
    adv = grpo_advantages(torch.tensor([3.0, 1.0]), torch.tensor([0, 0]), norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]))


def test_ppo_clip_by_hand():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 2.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, st = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2)
    # token 0: A=1, r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped); token 1: r=0.5 -> max(-0.5, -0.8) = -0.5
    # token 2: A=-1, r=1.1 -> max(1.1, 1.1) = 1.1; token 3 masked
    assert math.isclose(float(loss), -1.2 - 0.5 + 1.1, rel_tol=1e-5)
    assert float(st["clipped_tokens"]) == 1.0
    assert math.isclose(float(st["ratio_sum"]), 1.5 + 0.5 + 1.1, rel_tol=1e-5)
    assert math.isclose(float(st["ratio_max"]), 1.5, rel_tol=1e-5)


def test_ppo_gradient_equals_policy_gradient_on_policy():
    logp = torch.tensor([[-0.3, -1.2, -0.7]], requires_grad=True)
    adv = torch.tensor([[0.5, 0.5, 0.5]])
    mask = torch.ones(1, 3)
    loss, _ = ppo_clip_loss(logp, logp.detach(), adv, mask, 0.2, 0.2)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv)  # d(-A r)/dlogp = -A at r = 1
