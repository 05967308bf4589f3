"""benchmarks/stats.py: the interval a paired benchmark reports beside its median."""

import pytest

from benchmarks.stats import median_interval


def test_the_interval_holds_the_median_narrows_with_more_pairs_and_repeats_for_the_same_ratios() -> None:
    """Input: ratios spread as this machine spreads them (0.8 to 1.2 about 1.0), 10 of them, then the
    same spread 60 times over."""
    few = [0.8, 1.2, 0.95, 1.05, 0.9, 1.1, 1.0, 0.85, 1.15, 1.02]
    median, low, high = median_interval(few)
    assert low <= median <= high and low < high
    assert median_interval(few) == (median, low, high)  # a fixed seed: the same interval every time
    _, low60, high60 = median_interval(few * 6)
    assert low <= low60 <= high60 <= high and high60 - low60 < high - low


def test_one_value_repeated_has_no_spread_and_none_is_refused() -> None:
    """Input: five equal ratios; then an empty list."""
    assert median_interval([1.25] * 5) == (1.25, 1.25, 1.25)
    with pytest.raises(ValueError):
        median_interval([])
