"""Gradual rollouts: stable cohort assignment and stop conditions (pure logic, no clock reads).

A stop condition compares a cohort figure with a constant or with the baseline's figure:

    recomputed_token_ratio > 1.2 * baseline
    ttft_p95_seconds > 1.5 * baseline
    hit_ratio < 0.3
    tpot_p95_seconds > 1.1 * baseline    (time per output token: a speculative_config cohort)
    preemptions_per_request > 0.05       (a reservation cohort; reserved_unused_ratio says what it frees)
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

from .figure_condition import FigureCondition

FIGURES = ("recomputed_token_ratio", "hit_ratio", "ttft_p95_seconds", "ttft_p50_seconds", "preemptions_per_request",
           "tpot_p50_seconds", "tpot_p95_seconds", "reserved_unused_ratio")
MIN_REQUESTS = 5  # requests on each side before a stop condition compares them
# a nearest-rank p95 of fewer than 20 values is their maximum: one slow request would trip it
MIN_REQUESTS_FOR = {"ttft_p95_seconds": 20, "tpot_p95_seconds": 20}


# a fleet rollout's name (kvd router starts one rollout at every replica, each with its own number)
FLEET_ID = re.compile(r"fleet-[0-9a-f]{12}")


def new_fleet_id() -> str:
    return f"fleet-{secrets.token_hex(6)}"


def cohort_salt(rollout_id: int, fleet: str | None) -> str:
    """What a rollout's cohort hash is salted with: its fleet id where it is one rollout of a fleet
    rollout (a tenant then lands on the same side at every replica), else its own number."""
    return fleet if fleet else str(rollout_id)


def in_cohort(salt: int | str, key: str, fraction: float) -> bool:
    """Stable: SHA-256 of (rollout, key) mapped to [0, 1); the same key always lands the same way.
    `salt`: the rollout's number, or what `cohort_salt` gives."""
    digest = hashlib.sha256(f"kvctl/rollout/v1\0{salt}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


@dataclass(frozen=True)
class StopCondition(FigureCondition):
    """A rollout's stop condition on one of FIGURES, of its cohort against its baseline."""

    @classmethod
    def parse(cls, text: str) -> "StopCondition":  # type: ignore[override]
        return super().parse(text, FIGURES, field="stop", example="ttft_p95_seconds > 1.5 * baseline")

    @property
    def min_requests(self) -> int:
        """Requests each side needs before this condition is compared."""
        return MIN_REQUESTS_FOR.get(self.figure, MIN_REQUESTS)

    def tripped(self, cohort: dict, baseline: dict) -> tuple[bool, dict]:
        """Whether it trips, and the values it compared (for the record)."""
        observed = cohort.get(self.figure)
        reference = baseline.get(self.figure) if self.relative else 1.0
        result = self.holds(observed, reference)
        if result is None:
            return False, {"observed": observed, "threshold": None}
        return result, {"observed": observed, "threshold": self.value * reference,
                        "baseline": baseline.get(self.figure)}


def parse_fraction(text: str | float) -> float:
    """'10%' or 0.1 -> 0.1; refuses anything outside (0, 1]."""
    try:
        value = float(str(text).strip().rstrip("%")) / (100 if str(text).strip().endswith("%") else 1)
    except ValueError:
        raise ValueError(f"cohort: invalid value {text!r}; write e.g. 10%") from None
    if not 0 < value <= 1:
        raise ValueError(f"cohort: {text!r} is not in (0%, 100%]")
    return value
