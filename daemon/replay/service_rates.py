"""The replay's service model from a trace's own timings (`kvctl bench replay --rates-from-trace`).

The replay serves each request in `uncached prompt tokens / prefill_rate + output tokens /
decode_rate` seconds (simulator.py). The right rates depend on the model, the device and the load,
so the ones a guess gives can put a replay's queues and cache pressure far from what a live kvd
saw. A trace kvd saved says how it served each request (`served`: admission to first token, first
token to last, prompt tokens the cache gave). This module finds the rates at which the replay's
totals equal the live ones:

- prefill_rate: uncached prompt tokens of every served request ÷ their admission-to-first-token
  seconds. A fully cached prompt still costs a step; the sum counts that step against the rate.
- decode_rate: output tokens after the first ÷ their first-to-last-token seconds (per request:
  they ran beside the others, as the replay's requests do).
- decode_batch_cost, where the trace shows requests decoding beside different numbers of others:
  a line through each request's seconds a token against the mean number of requests its replica
  had in service (admitted, not finished, itself included) while it decoded, by least squares
  weighted by its tokens. The line's value at one request gives decode_rate in place of the mean
  above, and its slope over that value the cost of each other request (the replay's model, see
  simulator.py). A line that falls (decoding never slowed) fits a cost of 0 at the mean rate.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from .trace import TraceError, TraceRequest


FIT_MIN_REQUESTS = 3  # requests that made two tokens or more, for decode_batch_cost's line


@dataclass(frozen=True, slots=True)
class MeasuredRates:
    requests: int  # lines that say how kvd served them
    prefill_rate: float | None  # uncached prompt tokens per second; None: nothing to measure it on
    # output tokens per second per request (alone, where decode_batch_cost is fitted); None: no request made two
    decode_rate: float | None
    # each other request in service lengthens a decode step by this fraction of a lone one's; None: not
    # fitted (fewer than FIT_MIN_REQUESTS made two tokens, or all decoded beside as many others)
    decode_batch_cost: float | None = None


def measured_rates(requests: Sequence[TraceRequest]) -> MeasuredRates:
    """The rates the trace's `served` timings give; TraceError when no line has them."""
    served = [r for r in requests if r.served is not None]
    if not served:
        raise TraceError("rates_from_trace: no line of the trace says how it was served (`served`: traces kvd "
                         "saves have it; a Mooncake trace does not); give --prefill-rate and --decode-rate")
    uncached = sum(r.input_length - r.served.cached_tokens for r in served)
    prefill_s = sum(r.served.prefill_ms for r in served) / 1000.0
    later = sum(max(r.output_length - 1, 0) for r in served)
    decode_s = sum(r.served.decode_ms for r in served) / 1000.0
    decode_rate = later / decode_s if later and decode_s > 0 else None
    fitted = fit_batch_cost(served) if decode_rate is not None else None
    return MeasuredRates(len(served), uncached / prefill_s if uncached and prefill_s > 0 else None,
                         decode_rate if fitted is None else fitted[0], None if fitted is None else fitted[1])


def fit_batch_cost(served: Sequence[TraceRequest]) -> tuple[float, float] | None:
    """(decode rate alone, decode_batch_cost) from the served requests' decode timings, each
    replica's apart (see the module's doc); None where the trace cannot say."""
    by_replica: dict[str | None, list[TraceRequest]] = defaultdict(list)
    for r in served:
        by_replica[r.replica].append(r)
    points = []  # (others in service, seconds a token, tokens)
    for requests in by_replica.values():
        spans = in_service(requests)
        for r, span, mean in zip(requests, spans, mean_in_service(spans)):
            tokens = r.output_length - 1
            if tokens > 0 and mean is not None:
                points.append((mean - 1.0, (span[2] - span[1]) / tokens, tokens))
    weight = sum(w for _, _, w in points)
    if len(points) < FIT_MIN_REQUESTS:
        return None
    x_mean = sum(x * w for x, _, w in points) / weight
    y_mean = sum(y * w for _, y, w in points) / weight
    spread = sum(w * (x - x_mean) ** 2 for x, _, w in points)
    if spread <= 1e-9 * weight:  # all beside as many others: nothing to draw a line through
        return None
    slope = sum(w * (x - x_mean) * (y - y_mean) for x, y, w in points) / spread
    if slope <= 0:
        return 1.0 / y_mean, 0.0
    alone = y_mean - slope * x_mean
    if alone <= 0:  # a line that says a lone request would decode in no time: no fit
        return None
    return 1.0 / alone, slope / alone


def in_service(served: Sequence[TraceRequest]) -> list[tuple[float, float, float]]:
    """(admitted, first token, last token) of each served request, in seconds on the trace's clock."""
    spans = []
    for r in served:
        admitted = (r.timestamp_ms + r.served.queued_ms) / 1000.0
        first = admitted + r.served.prefill_ms / 1000.0
        spans.append((admitted, first, first + r.served.decode_ms / 1000.0))
    return spans


def mean_in_service(spans: Sequence[tuple[float, float, float]]) -> list[float | None]:
    """For each span, the mean number of spans in service (admitted to last token, itself included)
    from its first token to its last; None for one that decoded in no time."""
    changes = sorted([(admitted, 1) for admitted, _, _ in spans] + [(last, -1) for _, _, last in spans])
    times: list[float] = []
    area: list[float] = []  # the count's integral up to each change
    after: list[int] = []  # the count just after each change
    total, count = 0.0, 0
    for when, step in changes:
        if times:
            total += count * (when - times[-1])
        count += step
        times.append(when)
        area.append(total)
        after.append(count)

    def integral(t: float) -> float:
        i = bisect.bisect_right(times, t) - 1
        return 0.0 if i < 0 else area[i] + after[i] * (t - times[i])

    return [(integral(last) - integral(first)) / (last - first) if last > first else None
            for _, first, last in spans]
