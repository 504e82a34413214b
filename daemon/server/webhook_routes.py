"""An operator's view of kvd's webhooks (webhooks.py): the endpoints webhooks_file names (their
addresses without credentials or query: never a secret), the events not delivered yet, and a
retry of those now (`GET /admin/webhooks`, `POST /admin/webhooks/retry`, what `kvctl webhooks`
shows and does)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from .calls import Principal
from .webhooks import shown_url


def webhook_routes(service, admin) -> APIRouter:
    router = APIRouter()
    hooks = service.webhooks

    @router.get("/admin/webhooks")
    async def admin_webhooks(_: Principal = Depends(admin)):
        """The endpoints, each event waiting (the oldest first) and the deliveries since kvd started."""
        now = hooks.clock()
        waiting = sorted(list(hooks.pending.values()), key=lambda p: (p.created_at, p.id))
        endpoints = service.webhook_endpoints.values()
        return {"endpoints": [{"tenant": e.tenant, "url": shown_url(e.url)} for e in endpoints],
                "pending": [{"id": p.id, "tenant": p.tenant, "type": p.type, "created_at": p.created_at,
                             "attempts": p.attempts, "next_in": max(0.0, p.next_at - now), "last_error": p.last_error}
                            for p in waiting],
                **{k: v for k, v in hooks.figures().items() if k != "pending"}}

    @router.post("/admin/webhooks/retry")
    async def retry_webhooks(who: Principal = Depends(admin)):
        """Try every event waiting now, not at its backoff's time (an endpoint mended); audited."""
        retried = hooks.retry_now()
        await run_in_threadpool(service.store.audit, actor=who.actor, tenant="-", action="webhooks_retry",
                                target="webhooks", result="ok", detail={"events": retried})
        return {"retried": retried}

    return router
