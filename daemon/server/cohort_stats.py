"""One side of a rollout (its cohort, or its baseline): running totals, the latest samples, the
figures its stop conditions compare, and the judgement itself. Plain data, no torch: kvd keeps
one per side of its rollout (rollouts.py), and kvd router adds the replicas' up to judge a fleet
rollout across the fleet (fleet_rollouts.py, a policy's `judged: fleet`)."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from kvctl.daemon.stats import LATENCY_BUCKETS, percentile
from kvctl.policies.rollout import StopCondition

SAMPLES_KEPT = 5000  # each side's latest TTFTs and times per output token, for its percentiles
KEPT_DIGITS = 6  # a stored sample's decimals (seconds: to the microsecond)
TOTALS = ("requests", "prompt_tokens", "hit_tokens", "recomputed_tokens", "preemptions", "finished_blocks",
          "reserved_unused_blocks")


@dataclass
class CohortStats:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    finished_blocks: int = 0  # blocks its requests held at their finish, and those reserved they never wrote
    reserved_unused_blocks: int = 0
    ttfts: deque = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))  # the latest (percentiles)
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))  # every one (metrics)
    ttft_sum: float = 0.0
    tpots: deque = field(default_factory=lambda: deque(maxlen=SAMPLES_KEPT))  # time per output token, the latest

    def add(self, request) -> None:
        """A finished request (engine.requests.Request: its prompt and metrics)."""
        m = request.metrics
        self.requests += 1
        self.prompt_tokens += len(request.prompt_ids)
        self.hit_tokens += m.cached_tokens
        self.recomputed_tokens += m.recomputed_tokens
        self.preemptions += m.preemptions
        self.finished_blocks += m.finished_blocks
        self.reserved_unused_blocks += m.reserved_unused_blocks
        if m.ttft is not None:
            self.ttfts.append(m.ttft)  # O(1): each finished request during a rollout, on the engine thread
            self.ttft_buckets[bisect.bisect_left(LATENCY_BUCKETS, m.ttft)] += 1
            self.ttft_sum += m.ttft
        if len(m.token_times) > 1:  # decode time over the tokens after the first (sample 0's)
            self.tpots.append((m.token_times[-1] - m.token_times[0]) / (len(m.token_times) - 1))

    def sides_entry(self) -> dict:
        """Its totals and its latest samples, as kvd router adds up a fleet rollout's (`pooled`)."""
        return {**{name: getattr(self, name) for name in TOTALS}, "ttfts": list(self.ttfts), "tpots": list(self.tpots)}

    @classmethod
    def pooled(cls, entries: list[dict]) -> "CohortStats":
        """One side across replicas, from each one's `sides_entry()`: totals summed, samples put
        together (each replica's latest), so its figures are those of all their requests."""
        kept = SAMPLES_KEPT * max(len(entries), 1)
        stats = cls(ttfts=deque(maxlen=kept), tpots=deque(maxlen=kept))
        for entry in entries:
            for name in TOTALS:
                setattr(stats, name, getattr(stats, name) + int(entry[name]))
            stats.ttfts.extend(float(value) for value in entry["ttfts"])
            stats.tpots.extend(float(value) for value in entry["tpots"])
        return stats

    def figures(self) -> dict:
        prompt = self.prompt_tokens
        return {"requests": self.requests,
                "recomputed_token_ratio": self.recomputed_tokens / prompt if prompt else None,
                "hit_ratio": self.hit_tokens / prompt if prompt else None,
                "ttft_p50_seconds": percentile(self.ttfts, 0.5), "ttft_p95_seconds": percentile(self.ttfts, 0.95),
                "preemptions_per_request": self.preemptions / self.requests if self.requests else None,
                # what a reservation cohort frees: the share of its requests' blocks reserved and never written
                "reserved_unused_ratio": (self.reserved_unused_blocks / self.finished_blocks
                                          if self.finished_blocks else None),
                "tpot_p50_seconds": percentile(self.tpots, 0.5), "tpot_p95_seconds": percentile(self.tpots, 0.95)}


def kept_entry(entry: dict) -> dict:
    """A `sides_entry()` as a rollout's record keeps it: its samples to the microsecond (about
    half the JSON of their every digit; no percentile a stop condition compares moves by more)."""
    return {**entry, **{name: [round(value, KEPT_DIGITS) for value in entry[name]] for name in ("ttfts", "tpots")}}


def min_requests(rollout: dict, condition: StopCondition) -> int:
    """Requests each side needs before `condition` is compared: the policy's `min_requests`
    when it sets one, else what the figure needs (`StopCondition.min_requests`)."""
    return rollout["policy"].get("min_requests") or condition.min_requests


def first_tripped(rollout: dict, cohort: CohortStats, baseline: CohortStats) -> dict | None:
    """The first of the rollout's stop conditions that has enough requests on each side
    (`min_requests`) and trips: {"reason", "condition", the values it compared, and "figures": each
    side's}; None: none."""
    cohort_figures, baseline_figures = cohort.figures(), baseline.figures()
    for text in rollout["stops"]:
        condition = StopCondition.parse(text)
        needed = min_requests(rollout, condition)
        if cohort.requests < needed or baseline.requests < needed:
            continue
        trips, values = condition.tripped(cohort_figures, baseline_figures)
        if trips:
            return {"reason": f"stop condition tripped: {text}", "condition": text, **values,
                    "figures": {"cohort": cohort_figures, "baseline": baseline_figures}}
    return None
