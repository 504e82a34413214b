"""The operator's view of the responses and conversations kvd keeps (`GET /admin/responses`)
and their purge (`POST /admin/responses/purge`): a tenant's, those older than a span, or every one.

Kept responses and conversations (/v1/conversations) hold conversations' text, so an operator
must be able to remove a tenant's (a customer leaving, a request to forget) or those past a
retention span, and see what is kept where, without reading any of it: counts, bytes and times
only. A purge cancels the tenant's background responses still running first (each would be kept
again as it ended), removes the responses and the conversations from memory and from
`responses_store_file`, and is audited. `dry_run` says what it would remove and changes nothing.
A response's age is since it was made; a conversation's, since it last changed (a turn added,
an item removed, its metadata set).
"""

from __future__ import annotations

import asyncio
import logging
import time

from .api_errors import ApiError
from .durations import format_duration, parse_duration
from .response_runs import settled
from .response_store import tenant_row

log = logging.getLogger("kvd")


def listing(service) -> dict:
    """Each tenant's kept responses (response_store.tenants) and conversations, and the stores'
    figures (the conversations' under `conversations`)."""
    rows = {row["tenant"]: row for row in service.responses.tenants()}
    for tenant, talks in service.conversations.tenants().items():
        rows.setdefault(tenant, tenant_row(tenant)).update(talks)
    for row in rows.values():
        row.setdefault("conversations", 0)
        row.setdefault("conversation_bytes", 0)
    ordered = sorted(rows.values(), key=lambda row: (-row["bytes"] - row["conversation_bytes"], row["tenant"]))
    return {"tenants": ordered, **service.responses.figures(), "conversations": service.conversations.figures()}


async def purge(service, tenant: str | None, older_than, every: bool, dry_run: bool, who,
                ids: list[str] | None = None) -> dict:
    """Removes the kept responses and conversations of `tenant` (None: any tenant's) made more
    than `older_than` ago (a duration: 90, 30m, 7d; None: whenever), or those of `ids` (a user's
    request to forget; with `tenant`, that tenant's only: `ids_not_found` lists the others); `every`
    must be set to name none of them."""
    try:
        span = parse_duration(older_than)
    except (ValueError, KeyError):
        raise ApiError(400, f"older_than: must be a duration (90, 30m, 12h, 7d), got {older_than!r}",
                       param="older_than") from None
    if tenant is None and span is None and not every and not ids:
        raise ApiError(400, "tenant: name a tenant, older_than or ids, or send all: true to purge every kept "
                            "response and conversation", param="tenant")
    if every and (tenant is not None or span is not None or ids):
        raise ApiError(400, "all: purges every kept response and conversation; leave tenant, older_than and ids "
                            "out, or all", param="all")
    if ids and span is not None:
        raise ApiError(400, "ids: purges the responses and conversations named, whatever their age; leave "
                            "older_than out", param="ids")
    named = set(ids) if ids else None
    made_before = None if span is None else time.time() - span
    runs = service.responses.runs_matching(tenant, made_before, named)
    if not dry_run and runs:  # ended, they are kept (cancelled): then purged with the others
        await asyncio.gather(*(settled(run, service.cancel) for run in runs))
    responses = service.responses.purge(tenant, made_before, dry_run, ids=named)
    conversations = service.conversations.purge(tenant, made_before, dry_run, ids=named)
    found = {*responses.pop("ids", ()), *conversations.pop("ids", ()), *(run.now()["id"] for run in runs)}
    body = {**responses, "conversations": conversations,
            "cancelled": 0 if dry_run else len(runs),
            "running": len(runs) if dry_run else 0, "dry_run": dry_run,
            "tenant": tenant, "older_than_s": span, "all": every}
    if named is not None:
        body.update(ids=sorted(named), ids_not_found=sorted(named - found))
    if not dry_run:
        target = "all" if every else ",".join(filter(None, [tenant and f"tenant:{tenant}",
                                                            span and f"older_than:{format_duration(span)}",
                                                            ids and f"ids:{len(named)}"]))
        service.store.audit(actor=who.actor, tenant=tenant or "-", action="responses.purge", target=target,
                            result="ok", detail=body)
    return body


def expire(service) -> int:
    """Housekeeping: lets go of the kept responses older than `responses_max_age` (None: none),
    and the conversations unchanged for as long, from the file too, counted in each store's
    `expired`; how many went."""
    span = service.config.responses_max_age
    if span is None:
        return 0
    gone = service.responses.purge(None, time.time() - span, expired=True)["responses"]
    idle = service.conversations.purge(None, time.time() - span, expired=True)["conversations"]
    if gone or idle:
        log.info("responses: %d kept and %d conversations unchanged longer than responses_max_age (%s) let go", gone,
                 idle, format_duration(span))
    return gone + idle
