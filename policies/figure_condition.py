"""A condition on a named figure, `figure op number`, the number perhaps `* baseline`: a rollout's
stop conditions (rollout.StopCondition) and `kvctl bench replay --slo` (pure logic).

    ttft_p95_seconds > 1.5 * baseline
    itl_p95_s <= 0.05
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

_CONDITION = re.compile(r"^\s*([a-z0-9_]+)\s*(>=|<=|>|<)\s*([0-9]*\.?[0-9]+)\s*(\*\s*baseline)?\s*$")
COMPARE = {">": lambda a, b: a > b, ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b}


@dataclass(frozen=True)
class FigureCondition:
    figure: str
    op: str
    value: float
    relative: bool  # value is a multiple of the baseline's figure
    text: str

    @classmethod
    def parse(cls, text: str, figures: Sequence[str], *, field: str, example: str,
              baseline: bool = True) -> "FigureCondition":
        """`text` as a condition on one of `figures`; ValueError naming `field` (and showing `example`)
        when it is not one. `baseline`: whether `* baseline` may be written."""
        match = _CONDITION.match(text)
        if not match:
            raise ValueError(f"{field}: cannot parse {text!r}; write e.g. {example!r}")
        figure, op, value, relative = match.groups()
        if figure not in figures:
            raise ValueError(f"{field}: unknown figure {figure!r}; use one of {', '.join(figures)}")
        if relative is not None and not baseline:
            raise ValueError(f"{field}: {text.strip()!r} compares with a baseline, and there is none here; "
                             f"write a number, e.g. {example!r}")
        return cls(figure, op, float(value), relative is not None, text.strip())

    def holds(self, observed: float | None, reference: float | None = 1.0) -> bool | None:
        """Whether `observed` meets the condition against `value` (times `reference`, the baseline's
        figure, where relative); None where either is unknown."""
        if observed is None or reference is None or (isinstance(observed, float) and math.isnan(observed)):
            return None
        return COMPARE[self.op](observed, self.value * (reference if self.relative else 1.0))
