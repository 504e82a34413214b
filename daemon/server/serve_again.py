"""Background responses served again after kvd's stop.

A background response (`background: true`) that kvd stops before it ends (its stop's deadline
passed while it ran, a crash, a kill) is written down in the responses file as running, with the
request it was made from (background_file.py). At the next start it is served again from the
start, as its tenant's, under the same id: its client polling it sees `queued` until it runs,
then it ends as any response does, and its tenant's webhook is told then, as a batch's lines are
served again after a stop. Served again once at most (`response_store.SERVED_AGAIN_AT_MOST`): one
cut short a second time is kept `failed` and its webhook says so, so that a request that takes kvd
down cannot do so at every start. Without a responses file nothing outlives the process, and one
kvd's stop cuts short ends `failed`, as before.

The request goes through kvd's own API in process (the Unix socket's app), with its response id,
creation time and caller (tenant and role) in the ASGI scope, which no client can set; refused
there (its LoRA adapter gone, a conversation deleted since), it is kept `failed` with the refusal.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from .calls import Principal
from .response_runs import Run, settled

log = logging.getLogger("kvd")

SERVE_AGAIN = "kvd.serve_again"  # ASGI scope: {"id", "created", "attempts"} of a response served again
PRINCIPAL = "kvd.principal"  # ASGI scope: the Principal a call in process is made as
RETRY_S = 1.0  # how often a response waiting to be served again asks again while kvd cannot take it yet
WAITS_FOR = (429, 503)  # answers that say "not now" (loading, draining, asleep, a tenant's limit): asked again


def start(service, app) -> list[asyncio.Task]:
    """Serve again, on the running event loop, each background response the last stop cut short
    (`ResponseStore.again`), through `app` (kvd's own, in process); until it runs, each answers
    for itself as `queued` (and can be cancelled). The tasks, one per response."""
    loop = asyncio.get_running_loop()
    tasks = []
    for cut in service.responses.take_again():
        placeholder = Run(cut.tenant, "", bool(cut.request.get("stream")),
                          lambda status, opened=cut.response: {**opened, "status": status})
        service.responses.waiting(cut.response["id"], placeholder)
        placeholder.task = loop.create_task(_serve(service, app, cut, placeholder))
        tasks.append(placeholder.task)
    if tasks:
        log.info("%d background responses kvd's last stop cut short are served again from the start", len(tasks))
    return tasks


async def _serve(service, app, cut, placeholder: Run) -> None:
    response_id = cut.response["id"]
    scope = {SERVE_AGAIN: {"id": response_id, "created": cut.response.get("created_at"), "attempts": cut.attempts + 1},
             PRINCIPAL: Principal(cut.tenant, cut.role or "user", "kvd-served-again")}

    async def scoped(asked, receive, send):
        await app({**asked, **scope}, receive, send)

    transport = httpx.ASGITransport(app=scoped, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvd-again", timeout=None) as client:
        while True:
            if placeholder.cancel_asked:  # its client cancelled it before it ran
                _ended(service, cut, placeholder, {**cut.response, "status": "cancelled"}, "response.cancelled")
                return
            if not service.accepting:  # kvd stops before it ran: still written down, served at the next start
                service.responses.set_aside(cut.tenant, response_id)
                placeholder.end(placeholder.now())
                return
            try:
                answer = await client.post("/v1/responses", json=cut.request)
            except httpx.HTTPError as exc:  # (kvd's own app, in process: not expected)
                answer = httpx.Response(500, json={"error": {"message": f"{type(exc).__name__}: {exc}"}})
            if answer.status_code not in WAITS_FOR:
                break
            await asyncio.sleep(RETRY_S)
    if answer.status_code == 200:  # it runs: its own Run answers for it from now on
        run = service.responses.running(cut.tenant, response_id)
        if placeholder.cancel_asked and run is not None:  # cancelled while it was being started
            await settled(run, service.cancel)
        placeholder.end(run.now() if run is not None else answer.json())
        return
    try:
        error = answer.json().get("error") or {}
    except ValueError:
        error = {}
    failed = {**cut.response, "status": "failed", "error": {
        "code": error.get("code") or "server_error",
        "message": f"kvd's stop cut it short, and served again it was refused ({answer.status_code}): "
                   f"{error.get('message') or answer.text[:300]}"}}
    log.warning("background response %s of tenant %s, served again after kvd's stop, was refused (%d): %s",
                response_id, cut.tenant, answer.status_code, failed["error"]["message"])
    _ended(service, cut, placeholder, failed, "response.failed")


def _ended(service, cut, placeholder: Run, response: dict, event_type: str) -> None:
    """It ends before it ran: kept as `response`, struck off as running, its webhook told."""
    service.responses.put(cut.tenant, response, cut.conversation, cut.inputs)
    placeholder.end(response)
    service.responses.ended(cut.response["id"], placeholder, event_type)
