"""Each tenant's use of the cache, as an operator reads it (`kvctl tenants`, `GET /admin/tenants`).

A row per tenant that kvd has seen lately (in a request, a pin or a share): its prompt
tokens, how many the prefix cache served and how many were computed again after preemption (the
totals of `kvctl status`, split by tenant); its requests in flight, and those turned away (a full
queue, its limit of requests in flight, a request that can never fit); the device blocks holding its
cached prefixes (in use or idle), and how many of its cached blocks were evicted to make room (whose
blocks pay for the others' requests: what tenant shares and `eviction: priority` change), and how
many blocks its requests asking prompt_cache_retention "24h" wrote to disk and Redis, and how many
of its requests were served in explicit prompt cache mode (whose hits stop at their marks); with
tenant cache shares, its idle blocks against its share; with a host tier, the host slots holding
its blocks (against its share there, with shares); with a disk or Redis tier, the bytes its blocks
take there (this daemon's writes, for Redis) against its share; its pinned blocks against its pin
budget; the p50 and p95 of its latest TTFTs; and, where kvd follows a hit curve, what one LRU cache
of each size (the curve's, daemon/cache/hit_curve.py) would have served it (`hit_curve`: its
prompts and tokens as the curve counted them, and hit tokens by size; `alone`: for a tenant the
curve follows alone, the same in a cache of its own at shares of the device's blocks). Counts only: never
prompts, tokens or keys.

"Lately": the counters are kept for the `max_tracked_tenants` tenants active most recently
(daemon/engine/tenant_book.py); `retired` sums the counters of the others, so that the rows and
`retired` together add up to kvd's totals. A tenant that holds cached blocks, pins, a share or
requests in flight has a row whatever its counters.
"""

from __future__ import annotations

from collections import Counter

from kvctl.daemon.engine.tenant_book import FIELDS
from kvctl.policies.tenant_shares import share_of

from .inflight import request_state
from .service import EngineService


def list_tenants(service: EngineService, only: str | None = None) -> dict:
    """Every tenant's row, by name, and whether shares are set; `only`: that tenant's row alone (none
    where kvd lists no such tenant), its hit-curve figures the only ones made, and `listed`: how many
    tenants kvd lists (a watch of one tenant at 10,000 needs neither the others' rows nor their curves)."""
    engine = service.require_ready()
    with service.engine_lock():
        cache = engine.cache
        book = engine.stats.tenants
        counted, seen = dict(book.items(only)), book.names()  # (one tenant's row copies its counters alone)
        retired = {"tenants": book.retired_tenants, **dict(zip(FIELDS, book.retired)), "tracked": len(book),
                   "limit": book.limit}
        indexed = {tenant: n for tenant, n in cache.pool.tenant_blocks.items() if tenant is not None and n > 0}
        shares = cache.tenant_shares()
        pins = cache.pins
        pinned = {tenant: pins.used(tenant) for tenant in {pin.tenant for pin in pins.all()}}
        flight: Counter[tuple[str, str]] = Counter()
        for request in engine.requests.values():
            if not request.finished:
                flight[(request.tenant, "waiting" if request_state(request) == "waiting" else "running")] += 1
        host = service.tiers.host if service.tiers is not None else None
        if host is not None:
            with service.tiers.lock:
                on_host = {tenant: n for tenant, n in host.tenant_blocks.items() if tenant}
        lower = service.tiers.tenant_bytes() if service.tiers is not None else {}
        total = cache.num_blocks
        hit_curve, block_size = cache.hit_curve, cache.block_size
        snapshot = None if hit_curve is None else hit_curve.tenant_snapshot(only)  # (its figures made after the lock)
    curve = None if hit_curve is None else hit_curve.figures_of(snapshot, block_size)  # (and the tenants alone)
    # the rows are made after the lock (a row per tenant seen lately: up to max_tracked_tenants);
    # budgets and shares are settings, read as they stand
    curves, alone = ({}, {}) if curve is None else (curve["tenants"], curve["alone"])
    names = (seen | set(alone) | set(indexed) | (set(on_host) if host is not None else set())
             | set(shares or ()) | set(pinned) | {t for t, _ in flight}
             | {t for tier in ("disk", "remote") for t in lower.get(tier, {}) if t})
    listed = len(names)
    if only is not None:
        names &= {only}
    # the curve's figures of a tenant it has counted nothing of (made once, where one is listed)
    unseen = hit_curve.no_prompts(block_size) if curve is not None and names - set(curves) else None
    rows = []
    for tenant in sorted(names):
        prompt, hit, recomputed, rejected, evicted, retained, explicit = counted.get(tenant, (0,) * len(FIELDS))
        share = (shares or {}).get(tenant)
        rows.append({"tenant": tenant, "prompt_tokens": prompt, "hit_tokens": hit,
                     "hit_ratio": hit / prompt if prompt else 0.0, "recomputed_tokens": recomputed,
                     "running": flight[(tenant, "running")], "waiting": flight[(tenant, "waiting")],
                     "rejected": rejected,
                     "cached_blocks": indexed.get(tenant, 0), "evicted_blocks": evicted,
                     "retained_blocks": retained, "explicit_requests": explicit,
                     "idle_blocks": None if share is None else share["idle_blocks"],
                     "share_blocks": None if share is None else share["share_blocks"],
                     "pinned_blocks": pinned.get(tenant, 0),
                     "pin_budget_blocks": pins.budget(tenant),
                     "host_blocks": None if host is None else on_host.get(tenant, 0),
                     "host_share_blocks": None if host is None else host.share_of(tenant),
                     **_lower_use(service.tiers, lower, tenant),
                     "hit_curve": None if curve is None else {**(curves.get(tenant) or unseen),
                                                              "alone": alone.get(tenant)}})
    latency = service.tenant_latency(only)  # outside the engine's lock: the metrics keep their own
    for row in rows:
        ttft = latency.get(row["tenant"]) or {}
        row["ttft_p50_s"], row["ttft_p95_s"] = ttft.get("p50"), ttft.get("p95")
    return {"tenants": rows, "listed": listed, "shares": shares is not None, "blocks": total, "retired": retired,
            # the hit curve's sizes (times the device's blocks, and blocks) and its retired tenants' sum
            "hit_curve": None if curve is None else {
                "sizes": hit_curve.size_rows(),
                "retired": curve["retired"], "alone_sizes": curve["alone_sizes"]}}



def _lower_use(tiers, held: dict[str, dict[str, int]], tenant: str) -> dict:
    """The tenant's bytes on disk and in Redis, and its share of each (None where there is no such
    tier, or no shares on it)."""
    out = {}
    for name in ("disk", "remote"):
        tier = getattr(tiers, name, None) if tiers is not None else None
        out[f"{name}_bytes"] = None if tier is None else held[name].get(tenant, 0)
        out[f"{name}_share_bytes"] = share_of(tier.shares, tenant) if tier is not None and tier.shares else None
    return out
