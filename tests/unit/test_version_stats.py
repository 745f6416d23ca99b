"""Per-step version metrics: staleness by the oldest sampled token, versions spanned."""

from __future__ import annotations

import torch

from learner.version_stats import version_stats


def test_staleness_by_oldest_sampled_token_and_versions_spanned():
    versions = torch.tensor(
        [
            [5, 5, 6, 6],  # spans 5 and 6: staleness by 5
            [6, 6, 6, -1],  # one version; the unsampled slot does not count
            [3, 7, 7, 7],  # a prompt token (mask 0) of an old version does not count
        ]
    )
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 1, 1]])
    stats = version_stats(versions, mask, version=7, max_staleness=2)
    assert stats["staleness_hist"] == [1, 1, 1]  # staleness 2, 1, 0
    assert stats["staleness_max"] == 2.0 and stats["staleness_mean"] == 1.0
    assert abs(stats["multi_version_frac"] - 1 / 3) < 1e-6
    assert abs(stats["versions_per_sample"] - 4 / 3) < 1e-6


def test_a_sample_without_sampled_tokens_spans_nothing():
    stats = version_stats(torch.tensor([[4, 4]]), torch.tensor([[0, 0]]), 4, 0)
    assert stats["versions_per_sample"] == 0.0 and stats["multi_version_frac"] == 0.0
