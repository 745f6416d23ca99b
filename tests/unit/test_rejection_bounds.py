"""A rejection's bounds are checked when the config loads, naming the field
(`asyncrl.algorithms.corrections`): they used to load and then fail at the first step (a ratio
bound <= 0), reject nothing at the price of a proximal forward (no bound), or reject every
token (low > high)."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config


@pytest.mark.parametrize(
    "rejection, match",
    [
        ("{type: token, metric: ratio, low: -1}", "low=-1.0: a ratio bound must be > 0"),
        ("{type: sequence, metric: ratio, high: 0}", "high=0.0: a ratio bound must be > 0"),
        ("token", "needs low or high"),
        ("{type: sequence, metric: k3}", "needs low or high"),
        ("{type: token, metric: k1, low: 0.5, high: -0.5}", "low=0.5 > high=-0.5"),
    ],
)
def test_meaningless_bounds_are_refused_at_load(rejection, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, [f"algorithm.rejection={rejection}"])
    assert "algorithm.rejection" in str(e.value)


@pytest.mark.parametrize(
    "rejection",
    [
        "{type: token, metric: ratio, low: 0.5, high: 2.0}",
        "{type: token, metric: k1, low: -0.5}",  # k1 = -log r may be negative
        "{type: sequence, metric: k3, agg: max, high: 0.2}",
        "{type: token, metric: k2, low: 0.1, high: 0.1}",  # equal bounds: allowed
        "none",
    ],
)
def test_meaningful_bounds_load(rejection):
    load_config(None, [f"algorithm.rejection={rejection}"])


def test_the_aggregation_check_still_speaks_first():
    """A sequence rejection whose aggregation means nothing says so, bounds or not."""
    with pytest.raises(ConfigError, match="seq_max_k1"):
        load_config(None, ["algorithm.rejection={type: sequence, metric: k1, agg: max}"])
