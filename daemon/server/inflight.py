"""The requests in flight, as an operator sees and stops them (`kvctl requests`, `kvctl cancel`).

A row says who asked (tenant, API), where the request stands (waiting for admission, and whether
for its prefix to come up from disk or Redis; computing its prompt, decoding; preempted and how
often), for how long, what the cache gave it (cached and restored prompt tokens), what it holds
(blocks) and which field holds its reply to a shape: never its prompt or output tokens, nor text.
Cancelling one does what a client that leaves does: its samples finish as `cancelled` (a
streaming client gets that finish reason), its blocks come back exactly once, and the call is
audited with the request's tenant.
"""

from __future__ import annotations

from kvctl.daemon.engine.requests import Request, SeqStatus

from .calls import Principal, ServiceError
from .service import EngineService


def request_state(request: Request) -> str:
    """waiting (none of its samples admitted), prefill (some computing its prompt) or decode."""
    statuses = {s.status for s in request.sequences}
    if SeqStatus.PREFILL in statuses:
        return "prefill"
    if SeqStatus.DECODE in statuses:
        return "decode"
    return "waiting"


def request_row(service: EngineService, request: Request, now: float,
                in_line: dict[str, tuple[int, int]] | None = None) -> dict:
    """One request in flight (engine thread's lock held). `in_line`: `queue_places`'s answer, for
    where a waiting request stands in the queue."""
    cache, metrics = service.engine.cache, request.metrics
    position, cached_now = (in_line or {}).get(request.request_id, (None, None))
    left = None  # seconds before queue_timeout turns it away, while it waits unadmitted under a limit
    if position is not None and metrics.admitted is None:  # (a preempted one waits on)
        limit = service.engine.queue_wait_limit(request.tenant)  # its tenant's, else max_queue_wait (0: none)
        left = round(max(limit - (now - metrics.arrival), 0.0), 3) if limit > 0 else None
    blocks = sum(cache.sequence(s.seq_id).held_blocks for s in request.sequences if s.seq_id in cache)
    reserved = sum(cache.holding(s.seq_id)[1] for s in request.sequences)  # for output it has not written yet
    waited_until = metrics.admitted if metrics.admitted is not None else now
    private = request.params.cache_private
    return {"request_id": request.request_id, "tenant": request.tenant,
            "api": request.params.extra.get("api", "completions"), "state": request_state(request),
            "age_seconds": round(now - metrics.arrival, 3), "queued_seconds": round(waited_until - metrics.arrival, 3),
            "prompt_tokens": len(request.prompt_ids), "cached_tokens": metrics.cached_tokens,
            "restored_tokens": metrics.restored_tokens,
            "output_tokens": sum(len(s.output_ids) for s in request.sequences),
            "max_tokens": request.params.max_tokens, "n": request.params.n,
            "preemptions": metrics.preemptions, "blocks": blocks, "reserved_blocks": reserved,
            # while it waits: its place in the order the next admission pass tries the queue (1: first),
            # the prompt tokens the device cache holds of it now (what queue_order lpm orders by), the
            # requests that arrived after it and were admitted meanwhile, and the seconds left before its
            # queue wait limit turns it away (None: no limit)
            "queue_position": position, "cached_prefix_tokens": cached_now, "passed_over": metrics.passed_over,
            "queue_wait_left_seconds": left,
            # speculative decoding (speculative_config): draft tokens its steps carried, and those kept
            "drafted_tokens": metrics.drafted_tokens, "kept_draft_tokens": metrics.kept_draft_tokens,
            "fetching_prefix": service.engine.fetching_prefix(request),  # from disk or Redis, while it waits
            "waiting_for_lora_turn": request.request_id in service.engine.lora_turn_waiters,  # max_loras
            "priority": -request.priority,  # as requests and tenant_priorities give it: lower runs first
            "cohort": request.cohort,
            "shape": shape_field(request),
            "adapter": request.adapter or None,  # the LoRA adapter computing it (lora_modules); None: the model
            # explicit prompt cache mode: the prompt tokens the cache may serve it (its marked prefix's full
            # blocks; what follows is its own); None: implicit, as any request
            "explicit_cache_tokens": None if private is None else private[0] * cache.block_size}


def shape_field(request: Request) -> str | None:
    """The request field that holds its reply to a shape (guided_json, response_format, tool_choice,
    ...; structured.Constraint.field, less any part inside it), never the shape itself: shaped
    replies cost a mask a step, and a shape can end a sample with "error"."""
    constraint = request.params.constraint
    return None if constraint is None else constraint.field.split(".")[0].split("[")[0]


def list_requests(service: EngineService, tenant: str | None = None) -> dict:
    """Every request in flight (of `tenant`, if given), oldest first."""
    engine = service.require_ready()
    with service.engine_lock():
        now = engine.clock()
        in_line = queue_places(engine)
        rows = [request_row(service, r, now, in_line) for r in engine.requests.values()
                if not r.finished and (tenant is None or r.tenant == tenant)]
    rows.sort(key=lambda row: -row["age_seconds"])
    return {"requests": rows, "running": sum(r["state"] != "waiting" for r in rows),
            "waiting": sum(r["state"] == "waiting" for r in rows), "queue_order": engine.settings.queue_order}


def queue_places(engine) -> dict[str, tuple[int, int]]:
    """Each waiting request's place in the order the engine tries the queue (1: first; its first
    sample in that order decides) and the tokens of its prefix the device cache holds now, by
    request id (service lock held)."""
    size, places = engine.settings.block_size, {}
    for seq, hits in engine.admission_queue():
        places.setdefault(seq.request.request_id, (len(places) + 1, hits * size))
    return places


def cancel_requests(service: EngineService, principal: Principal, request_ids: list[str] | None = None,
                    tenant: str | None = None) -> dict:
    """Cancel the requests named that are in flight here (`not_found`: the others; a 404 when none
    is), or every request of `tenant` in flight; each is audited under its tenant. Says what each
    was doing and the blocks it held."""
    if (request_ids is None) == (tenant is None):
        raise ServiceError(400, "cancel: give request_ids or a tenant", "request_ids")
    engine = service.require_ready()
    asked = f"tenant={tenant}" if tenant is not None else ",".join(f"request={rid}" for rid in request_ids)
    with service.change_lock(principal, "cancel", asked):
        live = {rid: r for rid, r in engine.requests.items() if not r.finished}
        if request_ids is not None:
            chosen = [live[rid] for rid in dict.fromkeys(request_ids) if rid in live]
            not_found = [rid for rid in dict.fromkeys(request_ids) if rid not in live]
            if not chosen:
                raise ServiceError(404, f"request_ids: {', '.join(repr(r) for r in not_found)} not in flight "
                                        "here (finished, or never here: `kvctl requests` lists those that are)",
                                   "request_ids")
        else:
            chosen, not_found = [r for r in live.values() if r.tenant == tenant], []
        now = engine.clock()
        rows = [request_row(service, r, now) for r in chosen]
    for row in rows:
        service.cancel(row["request_id"])
        service.store.audit(actor=principal.actor, tenant=row["tenant"], action="cancel",
                            target=f"request={row['request_id']}", result="ok",
                            detail={k: row[k] for k in ("state", "age_seconds", "output_tokens", "blocks", "api")})
    return {"cancelled": [{k: row[k] for k in ("request_id", "tenant", "state", "output_tokens", "blocks")}
                          for row in rows],
            "not_found": not_found, "held_blocks": sum(row["blocks"] for row in rows)}
