"""A waiting request's prefix from the lower tiers (daemon/cache/tiers): fetched from disk or
Redis into staging while it queues, and put back on the device from host memory or staging at
its turn for admission, where restoring beats recomputing it.

A fetch starts when the request comes (`start`) and again, at its turn, for blocks the device
held then and lost while it queued (`fetch_what_was_lost`). While the fetch runs, the request
waits as the prefetch policy says (policies.tiering.PrefetchWait) and the requests behind it go
ahead (`holds`); admitted or cancelled, its fetch stops and how its wait ended is counted (`end`).

Under a sliding window (a model whose every layer slides one: KVCacheManager's `window`), a prompt
takes from the cache only the blocks its next token's window reaches, so only those are fetched
and restored: not the prefix from its root, whose first blocks a sliding sequence gives back
first (and the eviction policy takes first). Restoring those would take the room of the blocks
the window needs, and the request would compute them again.

Functions of the Engine (engine.py), which calls them only with tiers attached; they read its
cache, tiers, prefetch policy and clock, and add to its stats.
"""

from __future__ import annotations

import bisect
import math

from .requests import Request, Sequence


def start(engine, request: Request, missing: list | None = None, blind: bool = True) -> bool:
    """Bring the part of the prompt's prefix that sits on disk or in Redis (`missing`: what the
    device lacks of it, by default) up to staging while the request waits, when restoring beats
    recomputing it. With `blind`, Redis is asked for blocks no tier is known to hold (another
    daemon may have written them). Returns whether a fetch was judged at all."""
    if missing is None:
        keys, _ = engine._prefix_keys(request.sequences[0])
        missing = off_device(engine.cache, keys, engine.cache.cacheable_blocks(len(request.prompt_ids)))
    tiers = engine.tiers
    held = tiers.lower_run(missing[:1]) if missing else {}
    if not missing or not (held or (blind and tiers.remote is not None)):
        return False  # nothing below to fetch
    source = next(iter(held), "remote")  # judged at the tier its first block would come from
    size = engine.settings.block_size
    if tiers.policy.should_fetch(len(missing) * size, len(missing) * tiers.block_bytes_in(source),
                                 tiers.stats[source].read, tiers.clock()):
        if tiers.start_prefetch(request.request_id, missing):
            request.metrics.prefetch_started = engine.clock()
            request.metrics.prefetch_tokens = len(missing) * size
    return True


def holds(engine, seq: Sequence, keys: list, num_tokens: int) -> bool:
    """At `seq`'s turn for admission: whether it keeps waiting for its prefix's fetch (its turn
    passes to the requests behind it meanwhile). A request no fetch holds first has what it
    lost while it queued fetched (which may hold it after all), then its prefix put back on the
    device from host memory or staging (`restore`)."""
    request = seq.request
    if not waits(engine, request):
        fetch_what_was_lost(engine, request, keys, num_tokens)
    if waits(engine, request):
        return True
    restore(engine, seq, keys, num_tokens)
    return False


def fetch_what_was_lost(engine, request: Request, keys: list, num_tokens: int) -> None:
    """At its turn for admission: blocks of the prefix that the device held when the request
    came (so nothing was fetched for them then) may have been evicted while it queued, as happens
    whenever more prefixes are in use than the device holds. Fetch the run that lower tiers hold
    of them now, rather than recompute it; the request then waits for that fetch under the
    prefetch policy, as for the fetch started when it came."""
    tiers = engine.tiers
    if tiers.prefetch_pending(request.request_id):
        return
    missing = off_device(engine.cache, keys, engine.cache.cacheable_blocks(num_tokens))
    if engine.cache.window is None:
        ready, _ = tiers.available_run(missing)  # in host memory or staged already
        lost = missing[ready:]
    else:
        ready = tiers.in_memory(missing)
        lost = [key for key in missing if key not in ready]
    if lost and lost[0] != request.lost_judged and start(engine, request, lost, blind=False):
        request.lost_judged = lost[0]


def off_device(cache, keys: list, limit: int) -> list:
    """The keys of the prompt's first `limit` blocks that a hit of them all needs and the device
    lacks, in chain order: from the first block not cached, or under a sliding window those of
    the blocks the last one's window reaches."""
    if cache.window is None:
        return keys[len(cache.pool.match(keys, limit)):limit]
    block_of = cache.pool.block_of
    return [key for key in keys[cache.first_needed(limit * cache.block_size):limit] if block_of(key) is None]


def fetching(engine, request: Request) -> bool:
    """Whether the request waits while its prefix comes up from disk or Redis right now."""
    metrics = request.metrics
    return (engine.tiers is not None and metrics.prefetch_started is not None and metrics.prefetch_outcome is None
            and engine.tiers.prefetch_pending(request.request_id))


def waits(engine, request: Request) -> bool:
    """Whether the request keeps waiting for its prefix's fetch from disk or Redis: the fetch is
    still running and the prefetch policy says to wait (policies.tiering.PrefetchWait)."""
    metrics = request.metrics
    if metrics.prefetch_started is None or not engine.tiers.prefetch_pending(request.request_id):
        return False
    return engine.prefetch.waits(metrics.prefetch_started, metrics.prefetch_tokens, engine.clock())


def wait_for(engine, request: Request, poll: float) -> None:
    """With nothing to run: wait up to `poll` seconds (less where the policy's deadline comes
    first) for the fetch of `request`, the first one held, instead of spinning."""
    metrics = request.metrics
    left = engine.prefetch.deadline(metrics.prefetch_started, metrics.prefetch_tokens) - engine.clock()
    engine.tiers.wait_prefetch(request.request_id, max(0.0, min(poll, left)))


def end(engine, request: Request, outcome: str | None = None) -> None:
    """Stop the request's fetch (it was admitted, or `outcome` "cancelled") and drop what it
    staged; the first time, count how its wait ended and how long it was."""
    tiers, metrics, stats = engine.tiers, request.metrics, engine.stats
    if metrics.prefetch_started is not None and metrics.prefetch_outcome is None:
        job = tiers.prefetches.get(request.request_id)
        if outcome is None:
            outcome = engine.prefetch.outcome(not tiers.prefetch_pending(request.request_id))
            if outcome == "complete" and job is not None and not job.staged:
                outcome = "miss"  # it ended finding none of the blocks
        metrics.prefetch_outcome = outcome
        stats.prefetch_outcomes[outcome] = stats.prefetch_outcomes.get(outcome, 0) + 1
        if outcome != "cancelled":
            stats.prefetch_staged_blocks += len(job.staged) if job is not None else 0
            # held for the fetch: until it stopped or the policy's deadline, not while the request
            # also queued for room (admission may come long after its fetch ended)
            fetched = job.seconds() if job is not None else None
            waited = min(engine.clock() - metrics.prefetch_started,
                         math.inf if fetched is None else fetched,
                         engine.prefetch.deadline(metrics.prefetch_started, metrics.prefetch_tokens)
                         - metrics.prefetch_started)
            stats.prefetch_waits.append(waited)
            stats.recent_prefetch_waits.append(waited)
    tiers.finish_prefetch(request.request_id)


def restore(engine, seq: Sequence, keys: list, num_tokens: int) -> None:
    """Before admitting `seq`, put its prefix back on the device from host or staging.

    Either way the blocks are in memory as the device holds them (a fetch from disk or Redis was
    judged worth it, at that tier's rate and stored bytes, before it started): what is left is a
    copy, judged at the rate such copies are measured at (the host tier's)."""
    tiers, cache = engine.tiers, engine.cache
    limit = cache.cacheable_blocks(num_tokens)
    if cache.window is not None:
        return _restore_window(engine, seq, keys, num_tokens, limit)
    hits = len(cache.pool.match(keys, limit))
    run, nbytes = tiers.available_run(keys[hits:limit])
    if not run:
        return
    if not tiers.policy.should_restore(run * engine.settings.block_size, nbytes, tiers.stats["host"].read):
        return
    restored = tiers.restore_into(cache, keys, hits, run, seq.request.tenant, seq.request.priority)
    seq.request.metrics.installed_tokens += restored * engine.settings.block_size


def _restore_window(engine, seq: Sequence, keys: list, num_tokens: int, limit: int) -> None:
    """`restore` under a sliding window. The longest hit the device and memory can give together
    is one of `length` blocks whose window (blocks first_needed to length-1) the device holds or
    host memory and staging do: restore the blocks of that window the device lacks. Nothing when
    the device gives that hit already."""
    tiers, cache, size = engine.tiers, engine.cache, engine.settings.block_size
    hit = cache.lookup(keys, num_tokens)
    if hit >= limit:
        return
    low = cache.first_needed((hit + 1) * size)  # a longer hit's window starts here or after
    block_of = cache.pool.block_of
    lacking = [i for i in range(low, limit) if block_of(keys[i]) is None]
    ready = tiers.in_memory([keys[i] for i in lacking])
    absent = [i for i in lacking if keys[i] not in ready]  # neither on the device nor in memory
    for length in range(limit, hit, -1):
        first = cache.first_needed(length * size)
        last_absent = bisect.bisect_left(absent, length) - 1
        if last_absent < 0 or absent[last_absent] < first:  # its window is all here or in memory
            break
    else:
        return
    wanted = sum(1 for i in lacking if first <= i < length)
    if not wanted or not tiers.policy.should_restore(wanted * size, wanted * tiers.layout.block_bytes,
                                                     tiers.stats["host"].read):
        return
    restored = tiers.restore_window_into(cache, keys, first, length, seq.request.tenant, seq.request.priority)
    seq.request.metrics.installed_tokens += restored * size
