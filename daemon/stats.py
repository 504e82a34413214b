"""Nearest-rank percentiles, the one definition every kvd and kvctl report uses; the latency
buckets of kvd's histograms."""

from __future__ import annotations

import math
from typing import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The smallest value with at least q (in [0, 1]) of the values at or below it; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered) - 1e-9))
    return ordered[min(len(ordered), rank) - 1]


# upper bounds (seconds) of the buckets of every latency histogram kvd exports
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
