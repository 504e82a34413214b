"""What this daemon's cache holds of a prompt, asked two ways: by a router weighing where to
send it (`route_facts`), and by an operator asking why it missed (`explain`: the first block
not on the device and the reason, with what the next request would do about it).
"""

from __future__ import annotations

import time

from kvctl.daemon.cache import PrefixHasher, chain_keys
from kvctl.daemon.cache.events import KeyPrefix
from kvctl.daemon.engine.engine import Engine
from kvctl.policies.queue_order import by_priority
from kvctl.policies.tiering import restore_seconds

from .service_tiers import deferral, served_tier

REMOVAL_WORDS = {"capacity": "to make room", "tenant_share": "to make room, its tenant holding more idle blocks than "
                 "its cache share", "filesystem": "to make room on a filesystem running short of space",
                 "operator": "by an operator", "corrupt": "after it failed verification",
                 "unwritten": "(the step that was to write it never ran)",
                 "gone": "(deleted outside this daemon: on the shared Redis by its memory policy or another "
                         "daemon, or its disk segment from the folder)",
                 "space": "(written under scales or a format this daemon no longer serves)",
                 "sleep": "as kvd went to sleep and gave back its cache's memory",
                 "private": "as the request that wrote it ended (explicit prompt cache mode: no other request "
                            "could read it)"}


def route_facts(service, token_ids: list[int], tenant: str, adapter: str = "", requested: int | None = None,
                tier: str | None = None) -> dict:
    """This replica for this prompt, as a router weighs it: the prompt's tokens its device
    cache holds, and its load (see `Engine.predicted_wait`; under queue_order lpm, the work that
    would go before this prompt; under priority, before a request of `tenant`, and each tenant's
    place, `tenant_places`, for a router's view; the queue wait limit `tenant`'s). Also the tenant
    it looked in, the
    namespace's other fields (a router that computes keys itself notices a change: new
    scales, say) and the model it serves (a router sends a request naming one only where it is
    served, and its LoRA adapters by name with their ids in the namespace). `adapter`: the prompt
    is for that LoRA adapter (its own blocks). `requested`: the request's own priority (vLLM's; it
    may defer itself behind its tenant's place), which the wait counts from, refused (ServiceError
    400) as kvd refuses the request itself; `tier`: its service_tier, "flex" deferring it further
    where the queue goes by priority, as kvd serves it (service_tiers.py). Hashes before taking the lock."""
    engine = service.require_ready()
    keys = engine.prefix_keys(tenant, token_ids, adapter)[2]
    size = engine.settings.block_size
    # a prompt's wait under a priority queue, and its queue wait limit, are its tenant's; with none
    # (a router's load poll), the wait of the last place and max_queue_wait, which a router's view
    # makes each tenant's by `priority_waiting` (`priority_lpm_waiting`) and `tenant_queue_waits`
    ranked = by_priority(engine.settings.queue_order)
    place = service.queue_priority(tenant, requested)  # (checked whatever the order: kvd would refuse it)
    place -= deferral(served_tier(tier, engine.settings.queue_order))  # (flex: behind those that do not defer)
    priority = place if ranked and token_ids else None
    with service.engine_lock():
        hits = engine.cache.lookup(keys, len(token_ids)) if token_ids else 0
        limit = engine.cache.cacheable_blocks(len(token_ids))
        queue = engine.queue_figures(hits, priority, tenant if token_ids else None)
    if ranked:
        queue["tenant_places"] = dict(service.config.tenant_priorities)  # tenants not named: 0
    # the run after the device's part that lower tiers hold, per tier (the next block's tier
    # first), and what restoring it costs: the tiers have locks of their own
    run = service.tiers.lower_run(keys[hits:limit]) if service.tiers is not None else {}
    rates = service.tiers.read_rates() if service.tiers is not None else {}
    block_bytes = service.tiers.layout.block_bytes if service.tiers is not None else 0
    return {"prompt_tokens": len(token_ids), "cached_tokens": hits * size,
            # where the next block is, when a lower tier holds it (a restore, not a recompute)
            "lower_tier": next(iter(run), None), **queue, "tenant": tenant,
            "namespace": engine.namespace_fields(), "model": service.model_name,
            "adapters": {name: served.digest for name, served in service.adapters().items()},
            "lower_tier_tokens": {tier: blocks * size for tier, blocks in run.items()},
            "restore_seconds": restore_seconds(run, block_bytes, rates), "restore_rates": rates,
            "block_bytes": block_bytes, "draining": service.draining or service.asleep is not None,
            "asleep": service.asleep is not None, "chat_template": service.chat_template_digest}


def explain(service, token_ids: list[int], tenant: str, adapter: str = "",
            private: tuple[str, int] | None = None) -> dict:
    """How much of the prompt hits the device cache for `tenant` (under LoRA adapter `adapter`:
    its own blocks), and why its first missing block misses. `private`: the request is served in
    explicit prompt cache mode (cache_breakpoints.private_start: why, and the first block it hashes
    as its own), so nothing from that block on hits. Hashes outside the service lock (the engine
    steps meanwhile)."""
    engine = service.require_ready()
    size = engine.settings.block_size
    keys = chain_keys(engine.namespace(tenant, adapter), token_ids)
    shared = len(keys) if private is None else private[1]  # the blocks it may read from the cache
    with service.engine_lock():
        cache = engine.cache
        cacheable = cache.cacheable_blocks(len(token_ids))
        hits = min(cache.lookup(keys, len(token_ids)), shared)
        body = {"prompt_tokens": len(token_ids), "block_size": size, "full_blocks": len(keys),
                "hit_blocks": hits, "hit_tokens": hits * size, "tenant": tenant, "adapter": adapter or None,
                "prompt_cache": {"mode": "implicit"} if private is None else
                {"mode": "explicit", "why": private[0], "shared_blocks": min(shared, cacheable)}}
        if len(token_ids) < size:
            body["first_miss"] = {"block": 0, "reason": "shorter_than_a_block",
                                  "detail": f"{len(token_ids)} tokens is less than one block of {size}; "
                                            "only full blocks are cached"}
        elif hits >= shared < cacheable:
            body["first_miss"] = {"block": hits, "reason": "explicit_mode",
                                  "detail": explicit_detail(private[0], tenant, shared, size)}
        elif hits >= cacheable and len(token_ids) % size:
            rest = len(token_ids) % size
            body["first_miss"] = {"block": hits, "reason": "partial_block",
                                  "detail": f"every full block hit; the last {rest} tokens fill only part "
                                            f"of a block of {size}, and only full blocks are cached"}
        elif hits >= cacheable:
            body["first_miss"] = {"block": hits, "reason": "last_token_computed",
                                  "detail": f"every block but the last hit; the last token is always computed, "
                                            f"so its block of {size} is computed again"}
        else:
            key = keys[hits]
            logged = cache.pool.eviction_log.get(key)
            lower = service.tiers.location(key) if service.tiers is not None else "evicted"
            roots = {root: info.tenant for root, info in cache.roots.items() if info.tenant != tenant}
            device_clock = engine.clock()
    if "first_miss" not in body:  # outside the lock: reading the event log does not hold up the engine
        other = _other_tenants_holding(service, engine, token_ids, hits, roots, adapter)
        models = _other_models_holding(service, engine, token_ids, hits, tenant, adapter)
        body["first_miss"] = _cached_miss(service, engine, hits, key, lower, logged, other, device_clock, models)
        if lower != "evicted":
            body["first_miss"].update(_lower_tier_run(service, engine, keys[hits:min(cacheable, shared)]))
    return body


def explicit_detail(why: str, tenant: str, shared: int, block_size: int) -> str:
    """Why a request in explicit prompt cache mode reads nothing from the cache past block `shared`."""
    mode = (f"tenant {tenant!r} is served in explicit prompt cache mode (prompt_cache_explicit_tenants)"
            if why == "tenant" else "the request asks for explicit prompt cache mode (prompt_cache_options.mode)")
    if not shared:
        return (mode + ", and it marks no prompt cache breakpoint: none of its prompt is read from the cache, "
                       "or left there for another request")
    return (mode + f": only its longest marked prefix's {shared} full blocks ({shared * block_size} tokens) are read "
                   "from the cache; what follows is its own, and leaves the cache as it ends")


def _other_tenants_holding(service, engine: Engine, token_ids: list[int], block: int, roots: dict,
                           adapter: str = "") -> list[str]:
    """The other tenants whose device cache holds the prompt's block `block` (the same text is
    cached apart for each tenant). `roots`: the cache's prefix trees' first blocks, each with its
    tenant. Hashed outside the service lock, and a tenant's chain only past its first block where
    that block begins one of those trees (a cached block's tree is always among them)."""
    size = engine.settings.block_size
    wanted: dict[str, bytes] = {}
    for other in sorted(set(roots.values())):
        hasher = PrefixHasher(engine.namespace(other, adapter))
        keys = hasher.feed(token_ids[:size])
        if roots.get(keys[0]) == other:  # the rest of its chain, from where the first block left it
            wanted[other] = (keys + hasher.feed(token_ids[size:(block + 1) * size]) if block else keys)[block]
    if not wanted:
        return []
    with service.engine_lock():
        return [other for other, key in wanted.items() if engine.cache.pool.block_of(key) is not None]


def _other_models_holding(service, engine: Engine, token_ids: list[int], block: int, tenant: str,
                          adapter: str) -> list[str]:
    """The model or LoRA adapters, other than `adapter` ("": the model), whose blocks of `tenant`
    hold the prompt's block `block` on the device (an adapter's blocks are its own). Hashed outside
    the service lock; nothing to hash where kvd serves no adapter."""
    if not service.adapters():
        return []
    names = [name for name in ("", *service.adapters()) if name != adapter]
    end = (block + 1) * engine.settings.block_size
    wanted = {name: chain_keys(engine.namespace(tenant, name), token_ids[:end])[block] for name in names}
    with service.engine_lock():
        return [name or service.model_name for name, key in wanted.items()
                if engine.cache.pool.block_of(key) is not None]


def _lower_tier_run(service, engine: Engine, keys: list[bytes]) -> dict:
    """What the next request would do with the run of blocks lower tiers hold after the device's
    part: restore or recompute it (the tiering policy, at the measured rates), and how long it
    would wait for the disk's or Redis's part to come up (the prefetch policy)."""
    tiers, size = service.tiers, engine.settings.block_size
    run = tiers.lower_run(keys)
    blocks = sum(run.values())
    if not blocks:
        return {}
    restore = restore_seconds(run, tiers.layout.block_bytes, tiers.read_rates())
    recompute = blocks * size / engine.prefill_rate.rate
    slowest = next(t for t in ("remote", "disk", "host") if t in run)
    restores = tiers.policy.should_restore(blocks * size, sum(n * tiers.block_bytes_in(t) for t, n in run.items()),
                                           tiers.stats[slowest].read)
    fetched = (run.get("disk", 0) + run.get("remote", 0)) * size
    policy = engine.prefetch
    wait = policy.deadline(0.0, fetched) if fetched else 0.0
    where = ", ".join(f"{n} on {t}" for t, n in run.items())
    measured = tiers.stats[slowest].read.samples > 0 and engine.prefill_rate.samples > 0
    rates = "the measured rates" if measured else "assumed rates (nothing measured yet)"
    detail = (f"{blocks} blocks from here are in lower tiers ({where}): restoring them takes about "
              f"{restore * 1e3:,.1f} ms at {rates}, recomputing them about {recompute * 1e3:,.1f} ms, "
              f"so the next request {'restores' if restores else 'recomputes'} them")
    part = " and ".join(name for tier, name in (("disk", "disk"), ("remote", "Redis")) if run.get(tier))
    if restores and fetched:
        detail += (f"; it is admitted at once with what has come up from {part} (prefetch_policy best_effort)"
                   if policy.policy == "best_effort" else
                   f"; it waits until the {part} reads end (prefetch_policy wait_complete)"
                   if wait == float("inf") else
                   f"; it waits up to {wait:,.2f} s for the {part} part to come up (prefetch_policy timeout)")
    return {"detail": detail, "lower_tier_blocks": run, "restore_seconds": restore,
            "recompute_seconds": recompute, "restores": restores,
            "prefetch_wait_seconds": None if wait == float("inf") or not (restores and fetched) else wait}


def _cached_miss(service, engine: Engine, block: int, key: bytes, lower: str, logged, other: list[str],
                 device_clock: float, models: list[str] = ()) -> dict:
    """Why a block that could be cached is not on the device: in a lower tier; dropped from
    one (the event log says which and why); evicted from the device (its eviction log);
    another tenant's; the model's or another LoRA adapter's (`models`); or unknown to kvd since it
    started. Names the block for `kvctl events --key`."""
    removal = engine.events.last(1, ("removed",), key=KeyPrefix(key, None)).events
    if lower != "evicted":
        miss = {"reason": "in_lower_tier", "tier": lower,
                "detail": f"on the {lower} tier; the next request restores it instead of recomputing"}
    elif removal and removal[0].tier != "device":  # it left the device, then a lower tier too
        event = removal[0]
        ago = max(0.0, time.time() - event.at)
        miss = {"reason": "evicted", "tier": event.tier,
                "detail": f"evicted from the {event.tier} tier {now_minus(ago, 0.0)} ago "
                          f"{REMOVAL_WORDS[event.reason]}",
                "evicted_by": event.reason, "seconds_ago": ago}
    elif logged is not None:
        at, reason = logged
        miss = {"reason": "evicted", "tier": "device",
                "detail": f"evicted {now_minus(device_clock, at)} ago " + (
                    "to make room: its tenant held more idle blocks than its cache share" if reason == "tenant_share"
                    else f"by {'an operator' if reason == 'operator' else reason + ' eviction'}"),
                "evicted_by": reason, "seconds_ago": device_clock - at}
    elif other:
        miss = {"reason": "other_namespace", "detail": f"cached for tenant {other[0]!r}; tenants never share blocks"}
    elif models:
        whose = f"the model {models[0]!r}" if models[0] == service.model_name else f"LoRA adapter {models[0]!r}"
        miss = {"reason": "other_namespace", "detail": f"cached for {whose}; a LoRA adapter's blocks are its own "
                                                       "(its K and V are not the model's)"}
    else:
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(service.started_at))
        miss = {"reason": "never_cached",
                "detail": f"no request has filled this block under this namespace since kvd started ({started})"}
    return {"block": block, **miss, "key": key.hex()[:16]}  # the key: its life in `kvctl events --key`


def now_minus(now: float, then: float) -> str:
    seconds = max(0.0, now - then)
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"
