"""The cache's event log over HTTP: `GET /admin/events` (read, or wait for, the events after a
seq) and `GET /admin/events/snapshot` (every key each tier holds, and the seq it reflects).

A consumer (a router, `kvctl events --follow`) starts from a snapshot, then asks for the events
after its `seq` with `wait`: the answer comes as soon as there is one, or empty after `wait`
seconds. It resynchronises from a new snapshot when an answer says `gap` (it fell behind the
log's bound) or names another `stream_id` (the daemon restarted).
"""

from __future__ import annotations

import asyncio

from kvctl.daemon.cache.events import EventLog, EventPage, KeyPrefix

from .calls import ServiceError

WAIT_LIMIT_S = 30.0  # longest a request may hold the connection open
PAGE_LIMIT = 10_000


def parse_filter(value: str | None, allowed: tuple[str, ...], param: str) -> tuple[str, ...] | None:
    """'device,host' -> ('device', 'host'); None for no filter; a clear 400 for a bad name."""
    if value is None or value == "":
        return None
    names = tuple(v.strip() for v in value.split(","))
    for name in names:
        if name not in allowed:
            raise ServiceError(400, f"{param}: unknown value {name!r}; use {', '.join(allowed)}", param)
    return names


def check_page(since: int, limit: int, wait: float, tail: int | None = None) -> None:
    if tail is not None and not 1 <= tail <= PAGE_LIMIT:
        raise ServiceError(400, f"tail: must be between 1 and {PAGE_LIMIT}, got {tail}", "tail")
    if since < 0:
        raise ServiceError(400, f"since: must be >= 0, got {since}", "since")
    if not 1 <= limit <= PAGE_LIMIT:
        raise ServiceError(400, f"limit: must be between 1 and {PAGE_LIMIT}, got {limit}", "limit")
    if not 0 <= wait <= WAIT_LIMIT_S:
        raise ServiceError(400, f"wait: must be between 0 and {WAIT_LIMIT_S:g} seconds, got {wait:g}", "wait")


def parse_key(value: str | None) -> KeyPrefix | None:
    if value is None or value == "":
        return None
    try:
        return KeyPrefix.parse(value)
    except ValueError as exc:
        raise ServiceError(400, str(exc), "key") from None


def _answer(log: EventLog, page: EventPage, latest: int) -> dict:
    return {"stream_id": log.stream_id, "events": [e.to_json() for e in page.events], "next": page.next_seq,
            "oldest": page.oldest_seq, "latest": latest, "gap": page.gap}


def read_tail(log: EventLog, count: int, kinds, tiers, key: KeyPrefix | None = None) -> dict:
    """The newest `count` events that pass the filters (what `kvctl events` shows first)."""
    page = log.last(count, kinds, tiers, key)
    return _answer(log, page, page.next_seq)


def read_page(log: EventLog, since: int, limit: int, kinds, tiers, key: KeyPrefix | None = None) -> dict:
    return _answer(log, log.since(since, limit, kinds, tiers, key), log.seq)


async def wait_for_events(log: EventLog, since: int, limit: int, kinds, tiers, wait: float,
                          key: KeyPrefix | None = None) -> dict:
    """The events after `since` that pass the filters; waits up to `wait` seconds for one."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    body = await asyncio.to_thread(read_page, log, since, limit, kinds, tiers, key)  # off the loop: a page can be large
    while not body["events"] and not body["gap"] and loop.time() < deadline and not log.stopping:
        arrived = loop.create_future()

        def wake() -> None:  # on the producing thread
            loop.call_soon_threadsafe(lambda: arrived.done() or arrived.set_result(None))

        if log.notify_after(body["next"], wake):
            try:
                async with asyncio.timeout_at(deadline):  # not wait_for: test_import_rules says why
                    await arrived
            except TimeoutError:
                pass
            finally:
                log.forget_waiter(wake)
        body = await asyncio.to_thread(read_page, log, body["next"], limit, kinds, tiers, key)
    return body


def snapshot(service) -> dict:
    """Every key each tier holds now, with the seq of the newest event they reflect: apply the
    events after it to stay current. Also the namespace fields a router needs to compute keys
    itself (`kvctl.daemon.cache.keys.chain_keys(Namespace(**namespace, tenant=...), ids)`), and
    the digest of the chat template it renders chats with (`GET /admin/tokenizer` serves it)."""
    engine = service.require_ready()
    log = engine.events
    with service.engine_lock():  # the engine thread changes the device index only under it
        seq = log.seq  # read before the keys: an event that races the copy is in both, harmlessly
        held = {"device": [b.key for b in engine.cache.pool.blocks if b.key is not None]}
    if service.tiers is not None:
        for tier in service.tiers.tiers():
            with getattr(tier, "lock", service.tiers.lock):  # the host tier has none of its own
                held[tier.name] = list(tier.index)
    tiers = {name: [k.hex() for k in keys] for name, keys in held.items()}
    return {"stream_id": log.stream_id, "seq": seq, "block_size": engine.settings.block_size,
            "namespace": engine.namespace_fields(), "chat_template": service.chat_template_digest, "tiers": tiers}
