"""The routes of OpenAI's Files and Batch APIs (`/v1/files`, `/v1/batches`: batch_files.py,
batches.py), each tenant's own, and an operator's view of every tenant's batches
(`/admin/batches`, what `kvctl batches` shows) and files (`/admin/files`, `kvctl files`), with a
cancel and a delete that are audited."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, File, Form, Header, Query, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from .api_errors import ApiError
from .batch_files import FileError, expiry_seconds
from .batches import BatchError
from .calls import Principal
from .chat_messages import MessagesError
from .list_pages import input_items_page
from .responses_input import checked_metadata
from .whole_numbers import whole_number


class BatchBody(BaseModel):
    """`POST /v1/batches`."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: Any = None
    endpoint: Any = None
    completion_window: Any = None
    metadata: Any = None
    output_expires_after: Any = None  # {"anchor": "created_at", "seconds": N}: its output files' expiry


def list_page(rows: list[dict], after: str | None, limit: str | None) -> dict:
    """OpenAI's list of `rows` (the latest first): `limit` of them after the id `after`, paged as
    a response's input items are (list_pages.py)."""
    try:
        return input_items_page(rows, after, None, limit, "asc", whose="tenant")
    except MessagesError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None


# kvd router's word, on an upload or a new batch it relays: the bytes the tenant's files take at its other
# replicas, which the tenant's budget counts with its files here (tenant_files_bytes is the fleet's)
ELSEWHERE_HEADER = "X-KVD-Tenant-Files-Elsewhere"


def files_elsewhere(who: Principal, said: str | None) -> int:
    """The bytes ELSEWHERE_HEADER says, where an admin caller (kvd router) says it; else 0 (a
    caller's own word would only shrink its own room, but it is the router's to say)."""
    if said is None or who.role != "admin":
        return 0
    elsewhere = whole_number(said)
    if elsewhere is None:
        raise ApiError(400, f"{ELSEWHERE_HEADER}: invalid value {said[:40]!r}; use a whole number of bytes",
                       param=ELSEWHERE_HEADER)
    return elsewhere


def batch_routes(service, principal, admin) -> APIRouter:
    router = APIRouter()
    files, runner = service.files, service.batches

    # ---- files ----------------------------------------------------------------------------
    @router.post("/v1/files")
    async def upload(file: UploadFile = File(...), purpose: str = Form(...),
                     anchor: str | None = Form(None, alias="expires_after[anchor]"),
                     seconds: str | None = Form(None, alias="expires_after[seconds]"),
                     elsewhere: str | None = Header(None, alias=ELSEWHERE_HEADER),
                     who: Principal = Depends(principal)):
        expires_in = None if anchor is None and seconds is None else \
            expiry_seconds({"anchor": anchor, "seconds": seconds})
        # (the form's file, spooled to disk as it came: copied a piece at a time, never held whole)
        stored = await run_in_threadpool(files.add, who.tenant, file.filename or "upload.jsonl", purpose, file.file,
                                         None, expires_in, files_elsewhere(who, elsewhere))
        return files.public(stored)

    @router.get("/v1/files")
    async def list_files(purpose: str | None = Query(None), who: Principal = Depends(principal)):
        return {"object": "list", "data": [files.public(f) for f in files.listed(who.tenant, purpose)],
                "has_more": False}

    @router.get("/v1/files/{file_id}")
    async def get_file(file_id: str, who: Principal = Depends(principal)):
        return files.public(files.get(who.tenant, file_id))

    @router.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, who: Principal = Depends(principal)):
        content = await run_in_threadpool(files.content, who.tenant, file_id)
        return Response(content, media_type="application/octet-stream")

    def deleted(tenant: str, file_id: str):
        """`tenant`'s file gone; a 409 FileError, nothing removed, where a batch not ended reads it."""
        files.get(tenant, file_id)
        reading = runner.holds_input(file_id)
        if reading is not None:
            raise FileError(f"file_id: file {file_id!r} is the input of batch {reading.id}, which is "
                            f"{reading.status}; cancel the batch or let it end first", "file_id", 409)
        return files.delete(tenant, file_id)

    @router.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, who: Principal = Depends(principal)):
        deleted(who.tenant, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches --------------------------------------------------------------------------
    @router.post("/v1/batches")
    async def create_batch(body: BatchBody, who: Principal = Depends(principal),
                           elsewhere: str | None = Header(None, alias=ELSEWHERE_HEADER)):
        try:
            metadata = checked_metadata(body.metadata)
            output_expiry = expiry_seconds(body.output_expires_after, "output_expires_after")
            batch = await run_in_threadpool(runner.create, who.tenant, body.input_file_id, body.endpoint,
                                            body.completion_window, metadata, output_expiry,
                                            files_elsewhere(who, elsewhere))
        except MessagesError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        runner.start()  # (on the event loop: the lines are served from it)
        return batch.public()

    @router.get("/v1/batches")
    async def list_batches(after: str | None = Query(None), limit: str | None = Query(None),
                           who: Principal = Depends(principal)):
        return list_page([b.public() for b in runner.listed(who.tenant)], after, limit)

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, who: Principal = Depends(principal)):
        return runner.get(who.tenant, batch_id).public()

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, who: Principal = Depends(principal)):
        return runner.cancel(who.tenant, batch_id).public()

    # ---- an operator's view ---------------------------------------------------------------
    @router.get("/admin/batches")
    async def admin_batches(_: Principal = Depends(admin)):
        """Every tenant's batches, the latest first, and the requests served since kvd started."""
        return {"batches": [{**b.public(), "tenant": b.tenant, "in_flight": b.in_flight}
                            for b in runner.listed(None)],
                "served": dict(runner.served), "concurrency": runner.concurrency(), "via": runner.via_target(),
                "via_unsent": runner.unsent}

    @router.get("/admin/files")
    async def admin_files(tenant: str | None = Query(None), _: Principal = Depends(admin)):
        """Every tenant's files (or `tenant`'s), the latest first; what each tenant's take of its
        budget, and of files_store_bytes all of them together; uploads refused since kvd started."""
        config = service.config
        return {"files": [{**files.public(f), "tenant": f.tenant} for f in files.listed(tenant)],
                "tenants": {name: row for name, row in files.tenants().items() if tenant in (None, name)},
                "bytes": files.held(), "store_bytes": config.files_store_bytes, "max_file_bytes": config.max_file_bytes,
                "max_age": config.files_max_age,
                "refused": {"tenant": files.refused["tenant"], "store": files.refused["store"]}}

    @router.delete("/admin/files/{file_id}")
    async def admin_delete_file(file_id: str, who: Principal = Depends(admin)):
        """Delete any tenant's file (not one a batch not ended reads: 409); audited under its tenant."""
        owner = files.files.get(file_id)
        try:
            gone = deleted(owner.tenant if owner else "", file_id)
        except FileError as exc:
            await run_in_threadpool(service.store.audit, actor=who.actor, tenant=owner.tenant if owner else who.tenant,
                                    action="file_delete", target=file_id, result="refused",
                                    detail={"error": str(exc)})
            raise
        await run_in_threadpool(service.store.audit, actor=who.actor, tenant=gone.tenant, action="file_delete",
                                target=file_id, result="ok", detail={"bytes": gone.bytes, "purpose": gone.purpose})
        return {"id": file_id, "object": "file", "deleted": True, "tenant": gone.tenant, "bytes": gone.bytes}

    @router.post("/admin/batches/{batch_id}/cancel")
    async def admin_cancel_batch(batch_id: str, who: Principal = Depends(admin)):
        """Cancel any tenant's batch; audited under the batch's tenant."""
        try:
            batch = runner.cancel(None, batch_id)
            answer = {**batch.public(), "tenant": batch.tenant}  # (as it stands now: it may end at the next turn)
        except BatchError as exc:
            await run_in_threadpool(service.store.audit, actor=who.actor, tenant=who.tenant, action="batch_cancel",
                                    target=batch_id, result="refused", detail={"error": str(exc)})
            raise
        await run_in_threadpool(service.store.audit, actor=who.actor, tenant=batch.tenant, action="batch_cancel",
                                target=batch_id, result="ok", detail={"counts": answer["request_counts"]})
        return answer

    return router
