"""The replay's service model from a trace's own timings (`kvctl bench replay --rates-from-trace`).

The replay serves each request in `uncached prompt tokens / prefill_rate + output tokens /
decode_rate` seconds (simulator.py). The right rates depend on the model, the device and the load,
so the ones a guess gives can put a replay's queues and cache pressure far from what a live kvd
saw. A trace kvd saved says how it served each request (`served`: admission to first token, first
token to last, prompt tokens the cache gave). This module finds the rates at which the replay's
totals equal the live ones:

- prefill_rate: uncached prompt tokens of every served request ÷ their admission-to-first-token
  seconds. A fully cached prompt still costs a step; the sum counts that step against the rate.
- prefill_overhead and prefill_context_cost, where the trace shows prompts of different lengths
  computed after different amounts of context: a plane through each request's admission-to-first-
  token seconds against its uncached tokens u and their attention's reach u * (c + u / 2) / 1,024
  (c its cached tokens), by least squares. Its value at 0 is the overhead; its slope in u gives
  prefill_rate in place of the ratio above, and the other slope over that one the context cost.
  Where the plane says a negative time or cost, a line through the uncached tokens alone (no
  context cost); where that does too, the ratio above and neither.
- decode_rate: output tokens after the first ÷ their first-to-last-token seconds (per request:
  they ran beside the others, as the replay's requests do).
- decode_batch_cost, where the trace shows requests decoding beside different numbers of others:
  a line through each request's seconds a token against the mean number of requests its replica
  had in service (admitted, not finished, itself included) while it decoded, by least squares
  weighted by its tokens. The line's value at one request gives decode_rate in place of the mean
  above, and its slope over that value the cost of each other request (the replay's model, see
  simulator.py). A line that falls (decoding never slowed) fits a cost of 0 at the mean rate.
- decode_context_cost, where the trace also shows decoding beside different amounts of context:
  a plane in place of the line, through each request's seconds a token against both the mean
  number in service and the mean context its replica held in service meanwhile, in units of 1,024
  tokens (`context_in_service`: each request's prompt from its admission, growing by its output
  from its first token to its last). Its value at one request and no context gives decode_rate;
  each slope over that value gives its cost. Where either slope falls, that cost is 0 and the
  other is fitted alone, as above.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from .trace import TraceError, TraceRequest


FIT_MIN_REQUESTS = 3  # requests that made two tokens or more, for decode_batch_cost's line
CONTEXT_UNIT = 1024  # decode_context_cost is per this many tokens of context in service


@dataclass(frozen=True, slots=True)
class MeasuredRates:
    requests: int  # lines that say how kvd served them
    prefill_rate: float | None  # uncached prompt tokens per second; None: nothing to measure it on
    # output tokens per second per request (alone, where decode_batch_cost is fitted); None: no request made two
    decode_rate: float | None
    # each other request in service lengthens a decode step by this fraction of a lone one's; None: not
    # fitted (fewer than FIT_MIN_REQUESTS made two tokens, or all decoded beside as many others)
    decode_batch_cost: float | None = None
    # each CONTEXT_UNIT tokens of context in service lengthen a decode step by this fraction of a lone
    # request's with none; None: not fitted (as above, or all decoded beside as much context)
    decode_context_cost: float | None = None
    # seconds each prompt's computation takes beyond its tokens', and each CONTEXT_UNIT tokens before a
    # prompt token make it this fraction longer; None: not fitted (fit_prefill: the ratio stands)
    prefill_overhead: float | None = None
    prefill_context_cost: float | None = None


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
    fitted = fit_decode_costs(served) if decode_rate is not None else None
    prefill = fit_prefill(served)
    prefill_rate = uncached / prefill_s if uncached and prefill_s > 0 else None
    return MeasuredRates(len(served), prefill_rate if prefill is None else prefill[0],
                         decode_rate if fitted is None else fitted[0], None if fitted is None else fitted[1],
                         None if fitted is None else fitted[2], *(prefill[1:] if prefill is not None else (None, None)))


def fit_prefill(served: Sequence[TraceRequest]) -> tuple[float, float, float] | None:
    """(prefill_rate, prefill_overhead, prefill_context_cost) from the served requests' admission-to-
    first-token seconds (see the module's doc); None where neither the plane nor the line holds."""
    points = []  # (uncached tokens, their attention's reach in CONTEXT_UNITs, seconds, weight)
    for r in served:
        cached = r.served.cached_tokens
        uncached = r.input_length - cached
        points.append((float(uncached), uncached * (cached + uncached / 2) / CONTEXT_UNIT,
                       r.served.prefill_ms / 1000.0, 1.0))
    if len(points) < FIT_MIN_REQUESTS:
        return None
    plane = _plane(points)
    if plane is not None and plane[0] >= 0 and plane[1] > 0 and plane[2] >= 0:
        return 1.0 / plane[1], plane[0], plane[2] / plane[1]
    line = _line([(u, y, w) for u, _, y, w in points])
    if line is not None and line[0] >= 0 and line[1] > 0:
        return 1.0 / line[1], line[0], 0.0
    return None


def decode_points(served: Sequence[TraceRequest]) -> list[tuple[float, float, float, float]]:
    """(others in service, context in service in CONTEXT_UNITs, seconds a token, tokens) of each
    served request that made two tokens or more, each replica's apart."""
    by_replica: dict[str | None, list[TraceRequest]] = defaultdict(list)
    for r in served:
        by_replica[r.replica].append(r)
    points = []
    for requests in by_replica.values():
        spans = in_service(requests)
        contexts = context_in_service(spans, [(r.input_length, r.output_length) for r in requests])
        for r, span, mean, context in zip(requests, spans, mean_in_service(spans), contexts):
            tokens = r.output_length - 1
            if tokens > 0 and mean is not None:
                points.append((mean - 1.0, context / CONTEXT_UNIT, (span[2] - span[1]) / tokens, tokens))
    return points


def fit_decode_costs(served: Sequence[TraceRequest]) -> tuple[float, float, float | None] | None:
    """(decode rate alone with no context, decode_batch_cost, decode_context_cost or None where the
    trace cannot say) from the served requests' decode timings (see the module's doc); None where
    it cannot say the batch cost either (fit_batch_cost)."""
    points = decode_points(served)
    plane = _plane([(x, c, y, w) for x, c, y, w in points]) if len(points) >= FIT_MIN_REQUESTS else None
    if plane is not None:
        alone, per_other, per_context = plane
        if alone > 0 and per_other >= 0 and per_context > 0:
            return 1.0 / alone, per_other / alone, per_context / alone
        if alone > 0 and per_other < 0 and per_context > 0:  # context alone slows it: a line through that
            line = _line([(c, y, w) for _, c, y, w in points])
            if line is not None and line[0] > 0 and line[1] > 0:
                return 1.0 / line[0], 0.0, line[1] / line[0]
    fitted = _batch_cost([(x, y, w) for x, _, y, w in points])
    return None if fitted is None else (*fitted, None if plane is None else 0.0)


def _line(points: Sequence[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(value at 0, slope) of the least-squares line through (x, y, weight); None where x does not vary."""
    weight = sum(w for _, _, w in points)
    x_mean = sum(x * w for x, _, w in points) / weight
    y_mean = sum(y * w for _, y, w in points) / weight
    spread = sum(w * (x - x_mean) ** 2 for x, _, w in points)
    if spread <= 1e-9 * weight:
        return None
    slope = sum(w * (x - x_mean) * (y - y_mean) for x, y, w in points) / spread
    return y_mean - slope * x_mean, slope


def _plane(points: Sequence[tuple[float, float, float, float]]) -> tuple[float, float, float] | None:
    """(value at 0, slope in x, slope in z) of the least-squares plane through (x, z, y, weight); None
    where x and z do not vary apart (one of them constant, or one a line of the other)."""
    weight = sum(p[3] for p in points)
    x_mean, z_mean, y_mean = (sum(p[i] * p[3] for p in points) / weight for i in range(3))
    sxx = sum(w * (x - x_mean) ** 2 for x, _, _, w in points)
    szz = sum(w * (z - z_mean) ** 2 for _, z, _, w in points)
    sxz = sum(w * (x - x_mean) * (z - z_mean) for x, z, _, w in points)
    sxy = sum(w * (x - x_mean) * (y - y_mean) for x, _, y, w in points)
    szy = sum(w * (z - z_mean) * (y - y_mean) for _, z, y, w in points)
    det = sxx * szz - sxz * sxz
    if det <= 1e-9 * max(sxx * szz, 1e-300) or sxx <= 1e-9 * weight or szz <= 1e-9 * weight:
        return None
    per_x, per_z = (sxy * szz - szy * sxz) / det, (szy * sxx - sxy * sxz) / det
    return y_mean - per_x * x_mean - per_z * z_mean, per_x, per_z


def fit_batch_cost(served: Sequence[TraceRequest]) -> tuple[float, float] | None:
    """(decode rate alone, decode_batch_cost) from the served requests' decode timings, each
    replica's apart (see the module's doc); None where the trace cannot say."""
    return _batch_cost([(x, y, w) for x, _, y, w in decode_points(served)])


def _batch_cost(points: Sequence[tuple[float, float, float]]) -> tuple[float, float] | None:
    """fit_batch_cost's line through (others in service, seconds a token, tokens)."""
    if len(points) < FIT_MIN_REQUESTS:
        return None
    line = _line(points)
    if line is None:  # all beside as many others: nothing to draw a line through
        return None
    alone, slope = line
    if slope <= 0:  # decoding never slowed: no cost, at the mean rate
        return 1.0 / (sum(y * w for _, y, w in points) / sum(w for _, _, w in points)), 0.0
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


def context_in_service(spans: Sequence[tuple[float, float, float]],
                       lengths: Sequence[tuple[int, int]]) -> list[float]:
    """For each span (admitted, first token, last token), the mean context every span held in service
    from its first token to its last: each its prompt (`lengths`: prompt, output) from its admission,
    growing by its output evenly from its first token to its last. 0.0 for one that decoded in no time.

    Each span's context is a line in time on each of its two pieces; their sum's integral up to any
    time is kept as sums of the lines' coefficients over the pieces begun and the areas of those ended,
    so the whole takes one sorted sweep."""
    origin = min((admitted for admitted, _, _ in spans), default=0.0)  # (small numbers: the sums cancel less)
    spans = [(admitted - origin, first - origin, last - origin) for admitted, first, last in spans]
    pieces = []  # (start, end, a, b): context a + b * t on [start, end]
    for (admitted, first, last), (prompt, output) in zip(spans, lengths):
        if first > admitted:
            pieces.append((admitted, first, float(prompt), 0.0))
        if last > first:
            slope = output / (last - first)
            pieces.append((first, last, prompt - slope * first, slope))
    changes = sorted([(start, 0, i) for i, (start, _, _, _) in enumerate(pieces)]
                     + [(end, 1, i) for i, (_, end, _, _) in enumerate(pieces)])
    queries = sorted((t, q) for q, (_, first, last) in enumerate(spans) for t in (first, last))
    ended = a_sum = a_start = b_sum = b_start = 0.0  # the running sums (see the docstring)
    at: dict[tuple[int, float], float] = {}
    k = 0
    for t, q in queries:
        while k < len(changes) and changes[k][0] <= t:
            _, kind, i = changes[k]
            start, end, a, b = pieces[i]
            sign = 1.0 if kind == 0 else -1.0
            a_sum, a_start = a_sum + sign * a, a_start + sign * a * start
            b_sum, b_start = b_sum + sign * b, b_start + sign * b * start * start
            if kind == 1:
                ended += a * (end - start) + b * (end * end - start * start) / 2.0
            k += 1
        at[q, t] = ended + a_sum * t - a_start + b_sum * t * t / 2.0 - b_start / 2.0
    return [(at[q, last] - at[q, first]) / (last - first) if last > first else 0.0
            for q, (_, first, last) in enumerate(spans)]
