"""Tiering decisions: keep a block in a lower tier, and restore it or recompute it.

Pure: fed measured rates and counts, never reading a clock or touching tensors.

    recompute_seconds(tokens) = tokens / prefill_tokens_per_second
    restore_seconds(bytes)    = latency + bytes / bytes_per_second        (of the source tier)

A block evicted from the device is kept (demoted) when

    expected_reuse * recompute_seconds(block) >= bytes(block) / write bandwidth

with expected_reuse = prior + hits of its prefix (a prefix never reused still gets the prior,
since most prefixes are first reused after their first eviction). A prefix in a lower tier is
restored when restore_seconds(bytes of the run) < recompute_seconds(tokens of the run).
A router prices a replica's lower-tier blocks the same way (`restore_seconds`).

Whether to start a fetch from disk or Redis (`should_fetch`) is that judgement with room to learn
(`should_probe`): until a tier's reads are measured `MEASURED_READS` times it is fetched from, and a
fetch judged not worth it is still made when the tier's rate was last measured `PROBE_AFTER_S` or
more ago (one such probe at a time). A rate measured low once (a first read of a few blocks, mostly
round trip; a read under a passing load) would otherwise stop every fetch, and with them every
measurement that could correct it; a tier that is slow indeed costs one probe a period, whatever the
request rate. Writes learn the same way: an eviction whose blocks `worth_keeping` refuses still
writes them down while the tier's write rate is not measured well enough, or has grown old (a first
write of two blocks, measured at 78 MB/s on a disk that takes 200 MB/s, had stopped every later
write).
How long a waiting request holds out for such a restore's fetch is `PrefetchWait`'s call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MEASURED_READS = 3  # reads of a tier measured before its rate may stop a fetch
PROBE_AFTER_S = 30.0  # a fetch judged not worth it is made anyway when the rate is this old (measured again)


@dataclass
class RateMeter:
    """An exponentially weighted estimate of throughput (units per second) and fixed latency."""

    rate: float  # prior, units per second
    latency: float = 0.0  # prior, seconds per operation
    weight: float = 0.2  # how much one new measurement moves the estimate
    samples: int = 0
    latency_samples: int = 0
    measured_at: float | None = None  # when a reading last came (or a probe was sent for one), if fed a clock

    def observe(self, units: float, seconds: float, *, fixed: float | None = None, at: float | None = None) -> None:
        """One operation moved `units` in `seconds`; `fixed` is its measured fixed part, if known;
        `at` is when (the caller's clock), if it keeps track."""
        if at is not None:
            self.measured_at = at
        variable = seconds - (fixed or 0.0)
        if units <= 0 or seconds <= 0 or variable <= 0:
            return  # nothing moved, or the measurement leaves the transfer itself no time
        rate = units / variable
        w = 1.0 if self.samples == 0 else self.weight
        self.rate = (1 - w) * self.rate + w * rate
        if fixed is not None:
            self.latency = (1 - w) * self.latency + w * fixed
        self.samples += 1

    def observe_latency(self, seconds: float) -> None:
        """A call that moved nothing (a lookup that found nothing): its time is all fixed cost."""
        if seconds <= 0:
            return
        w = 1.0 if self.latency_samples == 0 else self.weight
        self.latency = (1 - w) * self.latency + w * seconds
        self.latency_samples += 1

    def observe_net_of_latency(self, units: float, seconds: float, at: float | None = None) -> None:
        """One call moved `units` in `seconds`, of which its fixed cost is taken to be the latency
        measured so far (at most half the call): a small read is not taken for a slow link."""
        self.observe(units, seconds - min(self.latency, seconds / 2), at=at)

    def seconds(self, units: float) -> float:
        return self.latency + units / self.rate


@dataclass
class TieringPolicy:
    """Demotion and restore judgements from measured rates (see module docstring)."""

    prefill: RateMeter = field(default_factory=lambda: RateMeter(rate=2000.0))  # tokens per second
    reuse_prior: float = 0.5
    mode: str = "measured"  # or "always": keep every evicted block, restore whatever is found

    def __post_init__(self) -> None:
        if self.mode not in ("measured", "always"):
            raise ValueError(f"tiering: invalid value {self.mode!r}; use measured or always")

    def worth_keeping(self, prefix_hits: int, block_tokens: int, block_bytes: int, write: RateMeter) -> bool:
        """Writes run off the serving loop in groups, so a write's fixed latency (an fsync, a
        round trip) is not charged to the block; its bandwidth is."""
        if self.mode == "always":
            return True
        expected_reuse = self.reuse_prior + max(0, prefix_hits)
        return expected_reuse * (block_tokens / self.prefill.rate) >= block_bytes / write.rate

    def should_restore(self, tokens: int, nbytes: int, read: RateMeter) -> bool:
        if self.mode == "always":
            return tokens > 0
        return tokens > 0 and read.seconds(nbytes) < tokens / self.prefill.rate

    def should_fetch(self, tokens: int, nbytes: int, read: RateMeter, now: float) -> bool:
        """Whether to fetch a run from disk or Redis for a waiting request at `now`: `should_restore`,
        but optimistic until the tier's reads are measured, and probing when its rate has grown old."""
        if tokens <= 0:
            return False
        return self.should_restore(tokens, nbytes, read) or self.should_probe(read, now)

    @staticmethod
    def should_probe(meter: RateMeter, now: float) -> bool:
        """Whether to move blocks a judgement from `meter` refused anyway, to measure the tier: while
        it has fewer than `MEASURED_READS` readings, and when its last one is `PROBE_AFTER_S` old. A
        probe marks the meter (`measured_at = now`): no second probe until its own reading is in, or
        the period passes again."""
        if meter.samples < MEASURED_READS:
            return True
        if meter.measured_at is None or now - meter.measured_at >= PROBE_AFTER_S:
            meter.measured_at = now
            return True
        return False

    def break_even_tokens(self, bytes_per_token: float, read: RateMeter) -> float:
        """Shortest prompt for which restoring from this tier beats recomputing (inf if never)."""
        gain_per_token = 1.0 / self.prefill.rate - bytes_per_token / read.rate
        if gain_per_token <= 0:
            return math.inf
        return read.latency / gain_per_token


PREFETCH_POLICIES = ("timeout", "best_effort", "wait_complete")
WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")  # when a block goes down (tiered.py)
TIER_CODECS = ("none", "int8", "fp8_e4m3")  # how disk and Redis store a block (daemon/cache/tiers/codec.py)


@dataclass(frozen=True)
class PrefetchWait:
    """How long a waiting request holds out for its prefix to come up from disk or Redis before
    it is admitted with what has arrived (the rest is recomputed). SGLang HiCache's three
    prefetch policies, by their names:

        best_effort    never wait: admission takes whatever is staged by then
        wait_complete  wait until the fetch has ended (everything staged, or it stopped at a
                       block found nowhere or failing verification)
        timeout        wait until the fetch ends, or until `timeout` + `per_1k_tokens` x
                       tokens / 1024 seconds after it started, whichever comes first

    The engine lets a waiting request's turn pass to the requests behind it, so a slow disk or
    Redis holds up only the request that needs it. Pure: fed times, never reading a clock."""

    policy: str = "timeout"
    timeout: float = 2.0  # seconds, under `timeout`
    per_1k_tokens: float = 0.0  # seconds more per 1,024 tokens fetched, under `timeout`

    def __post_init__(self) -> None:
        if self.policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch_policy: invalid value {self.policy!r}; use {', '.join(PREFETCH_POLICIES)}")
        if not self.timeout > 0:
            raise ValueError(f"prefetch_timeout: invalid value {self.timeout!r}; must be > 0 seconds")
        if not self.per_1k_tokens >= 0:
            raise ValueError(f"prefetch_timeout_per_1k_tokens: invalid value {self.per_1k_tokens!r}; must be >= 0")

    def deadline(self, started: float, tokens: int) -> float:
        """When a fetch of `tokens` tokens that started at `started` stops being waited for."""
        if self.policy == "best_effort":
            return started
        if self.policy == "wait_complete":
            return math.inf
        return started + self.timeout + self.per_1k_tokens * tokens / 1024

    def waits(self, started: float, tokens: int, now: float) -> bool:
        """Whether a request whose fetch is still running keeps waiting at `now`."""
        return now < self.deadline(started, tokens)

    def outcome(self, fetch_ended: bool) -> str:
        """How a request's wait ended when it is admitted: `complete` (its fetch had ended),
        `timeout` (its deadline passed first) or `best_effort` (admitted without waiting)."""
        if fetch_ended:
            return "complete"
        return "best_effort" if self.policy == "best_effort" else "timeout"


# miss: the fetch ended and found none of the blocks (a shared Redis asked for blocks another daemon
# may have written, and had none of them): counted apart, so that `complete` means blocks came up
PREFETCH_OUTCOMES = ("complete", "timeout", "best_effort", "cancelled", "miss")


def held_run(keys, holders) -> dict[str, int]:
    """Blocks per tier of the longest run from keys[0] that some holder has, each block counted
    in the first holder that has it: `holders` is (tier name, container) pairs, fastest first."""
    run: dict[str, int] = {}
    for key in keys:
        where = next((name for name, held in holders if key in held), None)
        if where is None:
            break
        run[where] = run.get(where, 0) + 1
    return run


def restore_seconds(blocks_by_tier: dict[str, int], block_bytes: int, rates: dict[str, dict[str, float]]) -> float:
    """Seconds to bring runs of blocks up from lower tiers, one tier after another: each tier's
    fixed latency plus its bytes at its read rate. `rates`: tier -> {"bytes_per_second",
    "latency_seconds", and optionally "block_bytes" where a tier stores a block in other than
    `block_bytes` (compressed)} (kvd's measured figures, or its priors). A tier with no rate is
    left out."""
    total = 0.0
    for tier, blocks in blocks_by_tier.items():
        rate = rates.get(tier)
        if blocks > 0 and rate is not None:
            total += rate["latency_seconds"] + blocks * rate.get("block_bytes", block_bytes) / rate["bytes_per_second"]
    return total


class CircuitBreaker:
    """closed -> open after `threshold` consecutive failures; half-open after `cooldown` seconds
    lets one call through; a success closes it, a failure opens it again. Fed a clock."""

    def __init__(self, threshold: int = 3, cooldown: float = 5.0) -> None:
        self.threshold, self.cooldown = threshold, cooldown
        self.failures = 0
        self.opened_at: float | None = None
        self.trips = 0

    def state(self, now: float) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if now - self.opened_at >= self.cooldown else "open"

    def allow(self, now: float) -> bool:
        return self.state(now) != "open"

    def success(self) -> None:
        self.failures, self.opened_at = 0, None

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.opened_at is not None or self.failures >= self.threshold:
            if self.opened_at is None:
                self.trips += 1
            self.opened_at = now
