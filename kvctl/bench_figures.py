"""Per-request records of a benchmark and the figures computed from them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from kvctl.daemon.stats import percentile


@dataclass
class RequestRecord:
    index: int
    start: float  # when the request was sent (seconds, shared clock)
    prompt_tokens: int = 0
    cached_tokens: int | None = 0  # None: kvd did not report it to this caller (report_cached_tokens)
    token_times: list[float] = field(default_factory=list)  # when each output token arrived
    end: float | None = None
    status: str = "ok"  # ok, rejected (429), aborted (error or cut short)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def median(values: list[float]) -> float | None:
    return percentile(values, 0.5)


def figures(records: list[RequestRecord]) -> dict:
    ok = [r for r in records if r.status == "ok" and r.end is not None]
    if ok:
        wall = max(r.end for r in ok) - min(r.start for r in records)
    else:
        wall = 0.0
    output = sum(len(r.token_times) for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [gap for r in ok for gap in r.itls]
    e2e = [r.end - r.start for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    reported = all(r.cached_tokens is not None for r in ok)  # else the cache's figures are not known
    cached = [r.ttft for r in ok if reported and r.cached_tokens > 0 and r.ttft is not None]
    uncached = [r.ttft for r in ok if reported and r.cached_tokens == 0 and r.ttft is not None]
    ratio = median(cached) / median(uncached) if cached and uncached and median(uncached) else None
    return {
        "requests": len(records), "completed": len(ok),
        "rejections": sum(1 for r in records if r.status == "rejected"),
        "aborts": sum(1 for r in records if r.status == "aborted"),
        "seconds": wall,
        "output_tokens": output,
        "output_tokens_per_second": output / wall if wall else 0.0,
        "requests_per_second": len(ok) / wall if wall else 0.0,
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p95_s": percentile(ttfts, 0.95),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_p50_s": percentile(itls, 0.5), "itl_p95_s": percentile(itls, 0.95),
        "e2e_p50_s": percentile(e2e, 0.5), "e2e_p95_s": percentile(e2e, 0.95), "e2e_p99_s": percentile(e2e, 0.99),
        "cached_token_ratio": (sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0) if reported else None,
        "ttft_cached_over_uncached": ratio,
    }


def served_figures(lines: list[dict]) -> dict | None:
    """kvd's own account of a run's requests: the `served` of its trace lines (`GET /admin/trace`).
    The client's TTFT is the queue plus the prefill plus the way back; these part them:
    `queued_p50_s` (arrival to admission), `prefill_p50_s` (admission to first token), and
    `prefill_cached_over_uncached`: the median prefill of requests the cache served some of their
    prompt over that of requests it served none of. That ratio is what the cache saves, whatever
    the queue. None when no line says how it was served."""
    return timing_figures([line["served"] for line in lines if line.get("served")])


def timing_figures(served: list[dict]) -> dict | None:
    """`served_figures` of the lines' `served` objects themselves (None: none)."""
    if not served:
        return None
    queued = [s["queued_ms"] / 1000.0 for s in served]
    prefill = [s["prefill_ms"] / 1000.0 for s in served]
    cached = [s["prefill_ms"] / 1000.0 for s in served if s["cached_tokens"] > 0]
    uncached = [s["prefill_ms"] / 1000.0 for s in served if s["cached_tokens"] == 0]
    return {"requests": len(served), "queued_p50_s": median(queued), "queued_p95_s": percentile(queued, 0.95),
            "prefill_p50_s": median(prefill),
            "prefill_cached_over_uncached": median(cached) / median(uncached)
            if cached and uncached and median(uncached) else None}


RATIO_FIGURES = ("output_tokens_per_second", "requests_per_second", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s",
                 "itl_p50_s", "itl_p95_s", "e2e_p50_s", "e2e_p95_s", "e2e_p99_s", "cached_token_ratio",
                 "ttft_cached_over_uncached")  # every figure but the counts (rejections, aborts)


def ratios(kvd: dict, baseline: dict | None) -> dict:
    if baseline is None:
        return {}
    out = {}
    for name in RATIO_FIGURES:
        a, b = kvd.get(name), baseline.get(name)
        out[name] = a / b if a is not None and b not in (None, 0, 0.0) else None
    return out


def engine_figures(before: dict, after: dict, wall_seconds: float) -> dict | None:
    """What the daemon's engine did during a run, from its /admin/status `steps` before and after:
    model steps by kind, the fraction of the run's wall time spent in steps, and the mean decode
    step. Next to the client's inter-token latency it shows what serving adds on top of the model
    (a busy fraction near 1 means the engine is the limit). None when the daemon does not report
    steps (an older kvd)."""
    if "steps" not in before or "steps" not in after or wall_seconds <= 0:
        return None

    def delta(kind: str, field_name: str) -> float:
        old = before["steps"].get(kind, {}).get(field_name, 0)
        return after["steps"].get(kind, {}).get(field_name, 0) - old

    kinds = sorted(after["steps"])
    steps = {kind: int(delta(kind, "count")) for kind in kinds}
    busy = sum(delta(kind, "seconds") for kind in kinds)
    decodes = steps.get("decode", 0)
    return {"steps": steps, "busy_fraction": busy / wall_seconds,
            "decode_step_mean_s": delta("decode", "seconds") / decodes if decodes else None,
            "threads": after.get("engine_threads"),
            "cpus_shared_fraction": _shared_fraction(before.get("cpu_share"), after.get("cpu_share"))}


def _shared_fraction(before: dict | None, after: dict | None) -> float | None:
    """Of the daemon's looks at its neighbours during the run, the fraction that found other busy
    kvd engines on its CPUs (its figures then measure a shared host); None where it does not look
    (a GPU, an older kvd) or did not look during the run."""
    if not before or not after or "looks" not in before or "looks" not in after:
        return None
    looks = after["looks"] - before["looks"]
    return (after["shared_looks"] - before["shared_looks"]) / looks if looks > 0 else None


def across_runs(runs: list[dict | None]) -> tuple[dict | None, dict | None]:
    """Figures of repeated runs (each a `figures()` or `ratios()` dict): the median of each
    figure, and its [min, max]. A figure that is None in a run (no cached request, say) is left
    out of that figure's median; None where no run has it. (None, None) for no runs."""
    present = [run for run in runs if run is not None]
    if not present:
        return None, None
    middle, spread = {}, {}
    for name in present[0]:
        values = [run[name] for run in present if run.get(name) is not None]
        if not values:
            middle[name] = None
            continue
        middle[name] = statistics.median(values)
        spread[name] = [min(values), max(values)]
    return middle, spread
