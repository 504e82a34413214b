"""Nearest-rank percentiles, the one definition every kvd and kvctl report uses."""

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
