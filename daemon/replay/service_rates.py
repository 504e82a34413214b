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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .trace import TraceError, TraceRequest


@dataclass(frozen=True, slots=True)
class MeasuredRates:
    requests: int  # lines that say how kvd served them
    prefill_rate: float | None  # uncached prompt tokens per second; None: nothing to measure it on
    decode_rate: float | None  # output tokens per second per request; None: no request made two tokens


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
    return MeasuredRates(len(served), uncached / prefill_s if uncached and prefill_s > 0 else None,
                         later / decode_s if later and decode_s > 0 else None)
