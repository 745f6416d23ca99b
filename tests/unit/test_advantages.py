import math

import pytest
import torch

from asyncrl.algorithms.advantages import (
    compute_advantages,
    gae_advantages,
    grpo_advantages,
    masked_mean,
    masked_whiten,
    outcome_token_rewards,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    rloo_advantages,
)


def whiten_by_loop(values: list[float]) -> list[float]:
    """Independent whitening: plain-Python mean and unbiased variance."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def scatter_rows(mask: torch.Tensor, flat: list[float]) -> torch.Tensor:
    """Put `flat` (row-major over the sampled tokens) back into a [B, T] tensor of zeros."""
    out = torch.zeros(mask.shape)
    out[mask > 0] = torch.tensor(flat)
    return out


def gae_by_loop(rewards, values, mask, gamma, lam):
    """Independent GAE: per row, list the sampled positions and recurse over that list."""
    adv = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        idx = [t for t, m in enumerate(row) if m > 0]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[i][t]
            adv[i][t] = next_adv
    return adv


def test_outcome_token_rewards_on_last_sampled_token():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    out = outcome_token_rewards(torch.tensor([2.0, 3.0, 5.0]), mask)
    expected = torch.tensor([[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)


def test_masked_mean_and_whiten_by_hand():
    x = torch.tensor([[1.0, float("inf"), 3.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    # mean of {1, 3, 5} = 3; the inf under mask 0 is ignored
    assert float(masked_mean(x, mask)) == 3.0
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([2.0, 5.0]))
    # unbiased var = (4 + 0 + 4) / 2 = 4 -> std 2 -> (-1, 0, 1)
    expected = torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(masked_whiten(x, mask), expected, rtol=1e-6, atol=1e-6)
    # a single token has variance 0 and whitens to 0 instead of raising
    single = masked_whiten(torch.tensor([[7.0, 2.0]]), torch.tensor([[1.0, 0.0]]))
    torch.testing.assert_close(single, torch.zeros(1, 2))


def test_gae_lambda_one_gamma_one_gives_reward_to_go():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    token_rewards = torch.tensor([[0.0, 0.5, 1.0, 0.0], [0.0, 7.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 0.7, 9.0], [0.1, 4.0, 0.3, 0.6]])
    _, returns = gae_advantages(token_rewards, values, mask, gamma=1.0, lam=1.0)
    # row 0: reward-to-go 1.5, 1.5, 1.0; row 1: the 7.0 under the hole is ignored -> 2, 2, 0
    expected = torch.tensor([[1.5, 1.5, 1.0, 0.0], [2.0, 0.0, 2.0, 0.0]])
    torch.testing.assert_close(returns, expected)


def test_gae_skips_mask_hole_by_hand():
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    token_rewards = torch.tensor([[0.0, 50.0, 0.0, 1.0]])
    values = torch.tensor([[1.0, 100.0, 2.0, 3.0]])
    adv, returns = gae_advantages(token_rewards, values, mask, gamma=0.5, lam=0.5)
    # t=3: delta = 1 + 0 - 3 = -2,             A3 = -2
    # t=2: delta = 0 + 0.5*3 - 2 = -0.5,       A2 = -0.5 + 0.25*(-2) = -1
    # t=1: tool output, skipped (its reward 50 and value 100 are never read)
    # t=0: delta = 0 + 0.5*2 - 1 = 0 (next value is V2), A0 = 0 + 0.25*(-1) = -0.25
    torch.testing.assert_close(returns, torch.tensor([[0.75, 0.0, 1.0, 1.0]]))
    expected = scatter_rows(mask, whiten_by_loop([-0.25, -1.0, -2.0]))
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)


def test_gae_matches_independent_loop_on_random_batch():
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(5, 9, generator=gen) > 0.3).float()
    mask[2] = 0.0  # a sequence with no sampled token
    token_rewards = torch.randn(5, 9, generator=gen)
    values = torch.randn(5, 9, generator=gen)
    adv, returns = gae_advantages(token_rewards, values, mask, gamma=0.9, lam=0.8)
    raw = gae_by_loop(token_rewards.tolist(), values.tolist(), mask.tolist(), 0.9, 0.8)
    raw_t = torch.tensor(raw)
    torch.testing.assert_close(returns, (raw_t + values) * mask, rtol=1e-5, atol=1e-5)
    flat = [raw[i][t] for i in range(5) for t in range(9) if mask[i, t] > 0]
    torch.testing.assert_close(adv, scatter_rows(mask, whiten_by_loop(flat)), rtol=1e-4, atol=1e-5)


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    adv = grpo_advantages(rewards, groups, eps=1e-12)
    # group 0: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3); groups 1, 2: 0
    std0 = math.sqrt(1 / 3)
    expected = [(2 / 3) / std0, (-1 / 3) / std0, (-1 / 3) / std0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_grpo_sums_to_zero_per_group_and_singleton_is_zero():
    rewards = torch.rand(12, generator=torch.Generator().manual_seed(0))
    groups = torch.tensor([0] * 5 + [1] * 6 + [2])
    for norm in (True, False):
        adv = grpo_advantages(rewards, groups, norm_by_std=norm)
        for g in range(3):
            assert abs(float(adv[groups == g].sum())) < 1e-5
        assert float(adv[-1]) == 0.0


def test_dr_grpo_is_mean_centred_only():
    adv = grpo_advantages(torch.tensor([3.0, 1.0]), torch.tensor([0, 0]), norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0]))


def test_rloo_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 5.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    adv = rloo_advantages(rewards, groups)
    # group 0: 1 - (0+0)/2 = 1, 0 - (1+0)/2 = -0.5 (twice); 2-sample group: +-(2 - 5); lone: 0
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, -3.0, 3.0, 0.0]))


def test_reinforce_plus_plus_return_to_go_skips_hole():
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    token_rewards = torch.tensor([[0.2, 9.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0]])
    adv = reinforce_plus_plus_advantages(token_rewards, mask, gamma=0.5)
    # row 0: G3 = 1, G2 = 0 + 0.5*1 = 0.5, G0 = 0.2 + 0.5*0.5 = 0.45 (the 9 in the hole ignored)
    # row 1: G1 = 2, G0 = 0 + 0.5*2 = 1; then whitened over all five sampled tokens
    expected = scatter_rows(mask, whiten_by_loop([0.45, 0.5, 1.0, 1.0, 2.0]))
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)


def test_reinforce_plus_plus_baseline_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    adv = reinforce_plus_plus_baseline_advantages(
        torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0, 0, 1]), mask
    )
    # centred: 0.5, -0.5, 0 (lone group) -> tokens {.5, .5, -.5, -.5, 0, 0}: mean 0,
    # unbiased var = 4 * 0.25 / 5 = 0.2 -> +-0.5 / sqrt(0.2) = +-1.1180
    a = 0.5 / math.sqrt(0.2 + 1e-8)
    expected = torch.tensor([[a, a, 0.0], [-a, 0.0, -a], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)


def test_remax_broadcasts_difference_without_whitening():
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    adv = remax_advantages(torch.tensor([1.0, 0.5]), torch.tensor([0.25, 1.0]), mask)
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.0, 0.75], [0.0, -0.5, 0.0]]))


def test_compute_advantages_dispatch_and_kl_in_reward():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    groups = torch.tensor([0, 0])
    rewards = torch.tensor([1.0, 0.0])
    # the KL penalty in the token rewards changes the sequence rewards to 0.9 and -0.2
    token_rewards = torch.tensor([[-0.1, 1.0, 5.0], [0.0, -0.2, 0.0]])
    adv, returns = compute_advantages(
        "grpo",
        rewards=rewards,
        mask=mask,
        group_index=groups,
        token_rewards=token_rewards,
        norm_adv_by_std=False,
    )
    assert returns is None
    # mean 0.35 -> +-0.55 on sampled tokens (the 5.0 off the mask is not a reward)
    expected = torch.tensor([[0.55, 0.55, 0.0], [-0.55, -0.55, -0.55]])
    torch.testing.assert_close(adv, expected)
    adv, _ = compute_advantages("rloo", rewards=rewards, mask=mask, group_index=groups)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]))
    _, returns = compute_advantages(
        "gae", rewards=rewards, mask=mask, group_index=groups, values=torch.zeros(2, 3)
    )
    assert returns is not None
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        adv, _ = compute_advantages(name, rewards=rewards, mask=mask, group_index=groups)
        assert adv.shape == (2, 3) and float(adv[0, 2]) == 0.0


def test_compute_advantages_errors():
    kwargs = {
        "rewards": torch.ones(1),
        "mask": torch.ones(1, 2),
        "group_index": torch.zeros(1, dtype=torch.long),
    }
    with pytest.raises(ValueError, match="grpo, rloo"):
        compute_advantages("ppo", **kwargs)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", **kwargs)
    with pytest.raises(ValueError, match="baseline_rewards"):
        compute_advantages("remax", **kwargs)
    # a reward that overflowed on its way in names itself instead of reaching a step
    inf = {
        **kwargs,
        "rewards": torch.tensor([math.inf, 1.0]),
        "group_index": torch.zeros(2, dtype=torch.long),
    }
    with pytest.raises(FloatingPointError, match="grpo advantages are not finite .from rewards"):
        compute_advantages("grpo", **{**inf, "mask": torch.ones(2, 2)})


def test_mask_holes_are_skipped_as_verl_0_9_1_does():
    """Numbers from verl 0.9.1's `compute_gae_advantage_return` and
    `compute_reinforce_plus_plus_outcome_advantage` on the same inputs (run on its wheel): a
    mask hole is skipped, carrying the next sampled token's value and return through it."""
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 9.0, 0.2]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    _, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.95)
    # verl: advantages [0.364, ., ., 0.8], returns = advantages + values at sampled tokens
    torch.testing.assert_close(returns[0, [0, 3]], torch.tensor([0.364 + 0.5, 0.8 + 0.2]))
    rpp = reinforce_plus_plus_advantages(torch.tensor([[0.0, 5.0, 0.0, 1.0]]), mask, gamma=0.9)
    # verl: returns [0.9, 0, 0, 1.0] (the reward inside the hole is dropped), then whitened
    torch.testing.assert_close(rpp[0, [0, 3]], torch.tensor([-0.7071, 0.7071]), atol=1e-4, rtol=0)
