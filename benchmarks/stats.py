"""How sure a benchmark's median is: a percentile bootstrap interval of the median of paired ratios.

On this shared machine a round of either side moves by more than most changes, so a run is many
alternated pairs, each pair's ratio taken between rounds minutes apart at most, and the figure to
read is the median of those ratios with the interval that resampling them gives. A fixed seed: the
same ratios always print the same interval.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence


def median_interval(values: Sequence[float], confidence: float = 0.95, resamples: int = 4000,
                    seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the median of `values` and the central `confidence` share of the medians of
    `resamples` resamples of them, drawn with replacement."""
    if not values:
        raise ValueError("no values")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return (statistics.median(values), medians[int(tail * (resamples - 1))],
            medians[int(round((1 - tail) * (resamples - 1)))])
