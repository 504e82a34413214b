"""`kvctl trace stats FILE`: what a trace holds, before a replay sizes a cache for it.

Its shape (requests, span, arrival rate, prompt and output lengths, tenants), its reuse (the hit
ratio of one cache that never forgets, and the tokens such a cache would hold: past that size a
bigger cache gains nothing; and an LRU cache's at shares of that size, from one pass), how its
requests open (distinct first blocks, those shared: system prompts), and, for a trace kvd saved,
how kvd served it (its own cached-token ratio, queue and prefill times, and the rates `kvctl bench
replay --rates-from-trace` would take). For a fleet's
trace (kvd router's: each line names its replica), each replica's share and cached-token ratio,
and how many shared openings the live router served on more than one replica.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Sequence

from kvctl.bench_figures import timing_figures
from kvctl.daemon.cache.hit_curve import HitCurve
from kvctl.daemon.cache.keys import BlockKey
from kvctl.daemon.replay.service_rates import measured_rates
from kvctl.daemon.replay.simulator import max_hit_blocks
from kvctl.daemon.replay.trace import TraceKeyer, TraceRequest
from kvctl.daemon.stats import percentile
from kvctl.tables import seconds

TOP_OPENINGS = 5  # the most shared openings listed
SHARES = ((1, 64), (1, 16), (1, 4), (1, 2), (1, 1))  # the LRU caches sized, as shares of the working set


def lru_hit_ratios(requests: Sequence[TraceRequest], keys: Sequence[Sequence[BlockKey]] | None = None,
                   outputs: Sequence[Sequence[BlockKey]] | None = None) -> list[dict]:
    """The hit ratio an LRU cache of each share of the working set would have, in one pass
    (daemon/cache/hit_curve.py), at the trace's own ids (kvd's own blocks are finer, and the
    ratios within a point or two: 32 times fewer blocks to follow). `keys` and `outputs`: the
    requests' keys at the ids' size, where the caller has them."""
    block = requests[0].block_tokens
    if keys is None or outputs is None:
        keyer = TraceKeyer(block)
        keys = [keyer.keys(r) for r in requests]
        outputs = [keyer.output_keys(r, index, keys[index]) for index, r in enumerate(requests)]
    working_set = len({key for request_keys in (*keys, *outputs) for key in request_keys})
    sizes = [("whole" if top == bottom else f"{top}/{bottom}", max(1, round(working_set * top / bottom)))
             for top, bottom in SHARES]
    curve = HitCurve(sizes)
    for request, prompt_keys, output_keys in zip(requests, keys, outputs):
        curve.look(prompt_keys[:max(request.input_length - 1, 0) // block], request.input_length)
        curve.touch(reversed([*prompt_keys, *output_keys]))  # as kvd gives a finished sequence's blocks back
    return [{"share": label, "tokens": blocks * block, "hit_ratio": hit * block / curve.prompt_tokens
             if curve.prompt_tokens else 0.0}
            for (label, blocks), hit in zip(sizes, curve.hit_blocks)]


def opening(request: TraceRequest) -> tuple[str, int]:
    """What a request opens with: its tenant and first block id (a tenant's ids are its own)."""
    return request.tenant or "default", request.hash_ids[0]


def _spread(values: list[int]) -> dict:
    return {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95), "max": max(values)}


def trace_stats(requests: Sequence[TraceRequest], block_size: int = 16) -> dict:
    """The figures of `requests` (a trace read in arrival order); reuse at `block_size` tokens."""
    keyer = TraceKeyer(block_size)
    keys = [keyer.keys(r) for r in requests]
    outputs = [keyer.output_keys(r, index, keys[index]) for index, r in enumerate(requests)]
    hits = max_hit_blocks(requests, keys, block_size, outputs)
    prompt_blocks = {key for request_keys in keys for key in request_keys}
    output_blocks = {key for request_keys in outputs for key in request_keys} - prompt_blocks
    prompt = sum(r.input_length for r in requests)
    seconds = requests[-1].timestamp_ms / 1000.0
    openings = Counter(opening(r) for r in requests if r.hash_ids)
    figures = {
        "requests": len(requests), "seconds": seconds,
        "requests_per_second": len(requests) / seconds if seconds else None,
        "tenants": dict(Counter(r.tenant or "default" for r in requests).most_common()),
        "block_tokens": requests[0].block_tokens,
        "input_tokens": prompt, "input_length": _spread([r.input_length for r in requests]),
        "output_tokens": sum(r.output_length for r in requests),
        "output_length": _spread([r.output_length for r in requests]),
        "block_size": block_size,
        "unbounded_hit_ratio": sum(hits) * block_size / prompt if prompt else 0.0,
        # every block a cache that never forgets holds: prompts' and outputs' (kvd caches both)
        "working_set_tokens": (len(prompt_blocks) + len(output_blocks)) * block_size,
        "output_working_set_tokens": len(output_blocks) * block_size,
        # an LRU cache of each share of the working set (at the trace's own ids)
        "lru_hit_ratios": lru_hit_ratios(requests, *((keys, outputs) if block_size == requests[0].block_tokens
                                                     else ())),
        "openings": len(openings),  # distinct first blocks (a tenant's own)
        "shared_openings": sum(1 for count in openings.values() if count > 1),
        "shared_opening_share": sum(count for count in openings.values() if count > 1) / len(requests),
        "top_openings": [{"tenant": tenant, "first_id": first, "requests": count, "share": count / len(requests)}
                         for (tenant, first), count in openings.most_common(TOP_OPENINGS) if count > 1],
        "served": None,
    }
    served = [r for r in requests if r.served is not None]
    if served:  # what bench serve prints as kvd's own timings, with the live hit ratio and the rates
        rates = measured_rates(requests)
        figures["served"] = {
            **timing_figures([r.served.to_object() for r in served]), "cached_token_ratio": live_cached_ratio(served),
            "prefill_rate": rates.prefill_rate, "decode_rate": rates.decode_rate,
            "decode_batch_cost": rates.decode_batch_cost, "decode_context_cost": rates.decode_context_cost,
            "prefill_overhead": rates.prefill_overhead, "prefill_context_cost": rates.prefill_context_cost,
        }
    figures["fleet"] = fleet_figures(requests)
    return figures


def prefill_cost_text(overhead: float | None, context_cost: float | None) -> str:
    """What follows a prefill rate the trace's timings give, where they fit its overhead and context
    cost (service_rates.fit_prefill); '' where not."""
    if overhead is None:
        return ""
    return ((" with no context" if context_cost else "") + f", {overhead * 1000:.2f} ms more a prompt"
            + (f", a token {context_cost:.1%} longer for each 1,024 tokens before it" if context_cost else ""))


def batch_cost_text(cost: float | None, context_cost: float | None = None) -> str:
    """What follows a decode rate the trace's timings give, where they fit a decode batch cost
    (service_rates.fit_decode_costs) and a context cost; '' where not."""
    if cost is None:
        return ""
    return (f" alone, a step {cost:.1%} longer for each other request in service"
            + ("" if not context_cost else f" and {context_cost:.1%} for each 1,024 tokens of context it holds"))


def fleet_figures(requests: Sequence[TraceRequest]) -> dict | None:
    """For a fleet's trace (lines that name their replica; None when none does): each replica's
    requests, prompt tokens, those it turned away and its own cached-token ratio; and of the
    openings two requests or more share, how many the live router served on more than one replica
    (prefix routing keeps each on one while it can; round robin spreads every one)."""
    named = [r for r in requests if r.replica is not None]
    if not named:
        return None
    by_replica: dict[str, list[TraceRequest]] = defaultdict(list)
    places: dict[tuple, set[str]] = defaultdict(set)
    opened: Counter = Counter()
    for r in named:
        by_replica[r.replica].append(r)
        if r.hash_ids:
            places[opening(r)].add(r.replica)
            opened[opening(r)] += 1
    shared = [first for first, count in opened.items() if count > 1]
    return {
        "replicas": {name: {"requests": len(rs), "input_tokens": sum(r.input_length for r in rs),
                            "turned_away": sum(1 for r in rs if r.served is None),
                            "cached_token_ratio": live_cached_ratio(rs)}
                     for name, rs in sorted(by_replica.items())},
        "shared_openings": len(shared),
        "split_openings": sum(1 for first in shared if len(places[first]) > 1),
    }


def stats_lines(figures: dict) -> list[tuple[str, str]]:
    """(label, value) rows for the table `kvctl trace stats` prints."""
    def lengths(spread: dict) -> str:
        return f"p50 {spread['p50']:,}, p95 {spread['p95']:,}, max {spread['max']:,}"

    rate = figures["requests_per_second"]
    tenants = figures["tenants"]
    rows = [("requests", f"{figures['requests']:,} over {seconds(figures['seconds'])}"
             + (f" ({rate:,.1f} a second)" if rate else "")),
            ("tenants", ", ".join(f"{t} {n:,}" for t, n in list(tenants.items())[:5])
             + (f" and {len(tenants) - 5} more" if len(tenants) > 5 else "")),
            ("prompt tokens", f"{figures['input_tokens']:,}: {lengths(figures['input_length'])}"),
            ("output tokens", f"{figures['output_tokens']:,}: {lengths(figures['output_length'])}"),
            ("ids cover", f"{figures['block_tokens']} tokens each"),
            (f"hit, unbounded cache (block {figures['block_size']})", f"{figures['unbounded_hit_ratio']:.1%}"),
            ("working set", f"{figures['working_set_tokens']:,} tokens"
             + (f" ({figures['output_working_set_tokens']:,} of them outputs')"
                if figures["output_working_set_tokens"] else "")
             + ": a cache this size never forgets a block"),
            (f"hit, LRU cache by size ({figures['block_tokens']}-token ids)",
             ", ".join(f"{row['share']} {row['hit_ratio']:.1%}" for row in figures["lru_hit_ratios"])
             + " of the working set (1/4 is " + f"{figures['lru_hit_ratios'][2]['tokens']:,} tokens)")]
    top = figures["top_openings"]
    rows.append(("openings (first blocks)",
                 f"{figures['openings']:,} distinct; {figures['shared_openings']:,} shared by two requests or more, "
                 f"opening {figures['shared_opening_share']:.0%} of them"
                 + ("; the most shared open " + ", ".join(f"{o['requests']:,}" for o in top) + " requests"
                    if top else "")))
    served = figures["served"]
    if served:
        rows += [("kvd served", f"{served['requests']:,} requests, cached-token ratio {served['cached_token_ratio']:.3f}"),
                 ("kvd's queue, prefill", f"queued p50 {served['queued_p50_s'] * 1000:.1f} ms, p95 "
                                          f"{served['queued_p95_s'] * 1000:.1f} ms; admission to first token p50 "
                                          f"{served['prefill_p50_s'] * 1000:.1f} ms"
                                          + ("" if served["prefill_cached_over_uncached"] is None else
                                             f", cached ÷ uncached {served['prefill_cached_over_uncached']:.3f}")),
                 ("rates (--rates-from-trace)",
                  ("-" if served["prefill_rate"] is None else f"prefill {served['prefill_rate']:,.0f} tokens/s"
                   + prefill_cost_text(served.get("prefill_overhead"), served.get("prefill_context_cost")))
                  + ", " + ("-" if served["decode_rate"] is None else
                            f"decode {served['decode_rate']:,.0f} tokens/s a request"
                            + batch_cost_text(served.get("decode_batch_cost"), served.get("decode_context_cost"))))]
    fleet = figures["fleet"]
    if fleet:
        def replica_row(name: str, row: dict) -> str:
            ratio = row["cached_token_ratio"]
            return (f"{name} {row['requests']:,} ({row['requests'] / figures['requests']:.0%}), cached "
                    + ("-" if ratio is None else f"{ratio:.3f}")
                    + (f", {row['turned_away']:,} turned away" if row["turned_away"] else ""))

        rows += [("replicas", "; ".join(replica_row(name, row) for name, row in fleet["replicas"].items())),
                 ("shared openings across replicas",
                  f"{fleet['split_openings']:,} of {fleet['shared_openings']:,} served on more than one replica")]
    return rows


def live_cached_ratio(requests: Sequence[TraceRequest]) -> float | None:
    """The share of prompt tokens kvd's cache gave the requests it says it served (None: none)."""
    served = [r for r in requests if r.served is not None]
    return sum(r.served.cached_tokens for r in served) / sum(r.input_length for r in served) if served else None


def live_timings(requests: Sequence[TraceRequest]) -> dict | None:
    """kvd's own account of the requests it says it served, in the replay's terms (arrival to first
    token, arrival to last, each request's mean seconds an output token after the first), for setting
    beside a replay of the trace (None: the trace does not say)."""
    served = [r for r in requests if r.served is not None]
    if not served:
        return None
    ttft = sorted((r.served.queued_ms + r.served.prefill_ms) / 1000.0 for r in served)
    e2e = sorted((r.served.queued_ms + r.served.prefill_ms + r.served.decode_ms) / 1000.0 for r in served)
    itl = sorted(r.served.decode_ms / 1000.0 / (r.output_length - 1) for r in served if r.output_length > 1)
    return {"requests": len(served), "cached_token_ratio": live_cached_ratio(served),
            "ttft_p50_s": percentile(ttft, 0.50), "ttft_p95_s": percentile(ttft, 0.95),
            "e2e_p50_s": percentile(e2e, 0.50), "e2e_p95_s": percentile(e2e, 0.95),
            "itl_p50_s": percentile(itl, 0.50), "itl_p95_s": percentile(itl, 0.95)}


def coarse_ids(block_tokens: int, live_ratio: float | None, ceiling: float) -> str | None:
    """What to say when kvd cached more of a trace's prompts (`live_ratio`) than a replay of its
    ids can (`ceiling`: a cache that never forgets): the ids are coarser than the prefixes the
    prompts share, or kvd held prefixes from before the trace (None: neither shows, or kvd did
    not say)."""
    if live_ratio is None or live_ratio <= ceiling + 0.01:
        return None
    finer = [size for size in (64, 16) if size < block_tokens]
    return (f"kvd cached {live_ratio:.1%} of these prompts, more than a replay of these ids can ({ceiling:.1%}): "
            f"its ids of {block_tokens} tokens are coarser than the prefixes the prompts share"
            + (f" (kvd's trace_block_tokens {' or '.join(map(str, finer))} traces them finer)" if finer else "")
            + ", or kvd's cache held prefixes from before the trace's first request")
