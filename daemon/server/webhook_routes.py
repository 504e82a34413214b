"""An operator's view of kvd's webhooks (webhooks.py): the endpoints webhooks_file names (their
addresses without credentials or query: never a secret), the events not delivered yet, a retry of
those now, and an ended batch's or background response's end told again (`GET /admin/webhooks`,
`POST /admin/webhooks/retry`, `POST /admin/webhooks/resend/{id}`: what `kvctl webhooks` shows and
does)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from .batches import ENDED
from .calls import Principal, ServiceError
from .webhooks import EVENT_TYPES, shown_url


class NotTold(ServiceError):
    """Why an end is not told again (naming `id`); `tenant`: that of the batch or response it names."""

    def __init__(self, status: int, message: str, tenant: str | None = None) -> None:
        super().__init__(status, message, "id")
        self.tenant = tenant


def ended_object(service, object_id: str) -> tuple[str, str]:
    """The tenant of the batch or background response `object_id`, and the event that tells its
    end; NotTold where it is not kept or has not ended."""
    if object_id.startswith("batch_"):
        batch = service.batches.batches.get(object_id)
        if batch is None:
            raise NotTold(404, f"id: no batch {object_id!r} is kept here")
        if batch.status not in ENDED:
            raise NotTold(409, f"id: batch {object_id!r} is {batch.status}: its end is told when it ends", batch.tenant)
        return batch.tenant, f"batch.{batch.status}"
    if object_id.startswith("resp_"):
        kept = service.responses.find(object_id)
        if kept is None:
            raise NotTold(404, f"id: no response {object_id!r} is kept here")
        if not kept.response.get("background"):
            raise NotTold(409, f"id: response {object_id!r} was not made with background: true: no webhook tells "
                          "of its end", kept.tenant)
        event_type = f"response.{kept.response.get('status')}"
        if event_type not in EVENT_TYPES:
            raise NotTold(409, f"id: response {object_id!r} is {kept.response.get('status')}: its end is told when "
                          "it ends", kept.tenant)
        return kept.tenant, event_type
    raise NotTold(400, f"id: a batch's id (batch_...) or a background response's (resp_...), got {object_id!r}")


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

    @router.post("/admin/webhooks/resend/{object_id}")
    async def resend_webhook(object_id: str, who: Principal = Depends(admin)):
        """Tell an ended batch's or background response's end again (its receiver lost it), under
        the event id it was first told with (a receiver that has it dedupes); audited."""
        tenant = who.tenant
        try:
            tenant, event_type = ended_object(service, object_id)
            if hooks.endpoint_for(tenant) is None:
                raise NotTold(409, f"id: tenant {tenant} has no endpoint in webhooks_file: kvd sends it no webhook")
            sent = await run_in_threadpool(hooks.send, tenant, event_type, object_id)
            if sent is None:
                raise NotTold(507, "id: its event could not be written down in state_dir/webhooks (kvd's log says "
                              "why)")
        except NotTold as exc:
            tenant = exc.tenant or tenant
            await run_in_threadpool(service.store.audit, actor=who.actor, tenant=tenant, action="webhook_resend",
                                    target=object_id, result="refused", detail={"error": str(exc)})
            raise
        await run_in_threadpool(service.store.audit, actor=who.actor, tenant=tenant, action="webhook_resend",
                                target=object_id, result="ok", detail={"event": sent.id, "type": event_type})
        return {"id": sent.id, "type": event_type, "tenant": tenant, "object_id": object_id}

    return router
