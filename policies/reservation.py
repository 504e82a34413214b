"""Output reservation: how many output tokens to reserve cache space for at admission.

Specs (as an operator writes them):

    fixed:N       reserve N tokens (capped at the request's max_tokens)
    fraction:F    reserve ceil(F x max_tokens), 0 < F <= 1
    p95           the 95th percentile of observed output lengths (capped at
                  max_tokens); max_tokens until `min_samples` outputs were seen

Every policy answers `reserve(max_tokens)` and learns from `observe(output_len)`.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Protocol


class ReservationPolicy(Protocol):
    spec: str

    def reserve(self, max_tokens: int) -> int: ...

    def observe(self, output_tokens: int) -> None: ...


class FixedReservation:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.spec = f"fixed:{tokens}"

    def reserve(self, max_tokens: int) -> int:
        return min(self.tokens, max_tokens)

    def observe(self, output_tokens: int) -> None:
        pass


class FractionReservation:
    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.spec = f"fraction:{fraction:g}"

    def reserve(self, max_tokens: int) -> int:
        return min(max_tokens, math.ceil(self.fraction * max_tokens))

    def observe(self, output_tokens: int) -> None:
        pass


class PercentileReservation:
    """Reserve the q-th percentile of the last `window` observed output lengths."""

    def __init__(self, quantile: float = 0.95, *, window: int = 1000, min_samples: int = 20) -> None:
        self.quantile = quantile
        self.min_samples = min_samples
        self.spec = f"p{round(quantile * 100)}"
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: list[int] = []

    def observe(self, output_tokens: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(output_tokens)
        bisect.insort(self._sorted, output_tokens)

    def current(self) -> int | None:
        """The percentile now, or None before `min_samples` observations."""
        if len(self._sorted) < self.min_samples:
            return None
        index = min(len(self._sorted) - 1, math.ceil(self.quantile * len(self._sorted)) - 1)
        return self._sorted[max(index, 0)]

    def reserve(self, max_tokens: int) -> int:
        value = self.current()
        return max_tokens if value is None else min(value, max_tokens)


def parse_reservation(spec: str) -> ReservationPolicy:
    """Parse `fixed:N`, `fraction:F` or `p95`; errors name the field and the value."""
    text = spec.strip()
    kind, _, arg = text.partition(":")
    try:
        if kind == "fixed" and arg:
            tokens = int(arg)
            if tokens < 0:
                raise ValueError
            return FixedReservation(tokens)
        if kind == "fraction" and arg:
            fraction = float(arg)
            if not 0.0 < fraction <= 1.0:
                raise ValueError
            return FractionReservation(fraction)
        if kind.startswith("p") and not arg and kind[1:].isdigit():
            q = int(kind[1:])
            if not 1 <= q <= 100:
                raise ValueError
            return PercentileReservation(q / 100.0)
    except ValueError:
        pass
    raise ValueError(
        f"output reservation: invalid value {spec!r}; expected fixed:N (N >= 0), "
        "fraction:F (0 < F <= 1) or pNN such as p95"
    )
