"""kvd router: one OpenAI-compatible front for several kvd replicas, sending each completion
where a routing policy (kvctl.policies.routing) says it will be served best.

How it learns what each replica holds of a prompt and how busy it is is the `view` (`ask`, or
`events`, the default): router_service.py says how each works, and holds the router's books
and its choice of a replica for each request. This module is the HTTP front.

The policy chooses, and the router forwards the request's body to that replica unchanged,
streaming the answer back as it comes. The answer names the replica (`X-KVD-Replica`) and the
reason (`X-KVD-Route`). A replica that does not answer is left out of that choice; when none
answers, the request gets a 503 that names them.

    kvd router --replica /run/kvd-a/kvd.sock --replica /run/kvd-b/kvd.sock --socket /run/kvd/router.sock [--view events]

The front is a Unix socket (mode 0660), like kvd's own: its callers are trusted, and
X-KVD-Tenant passes through to the replica. With `--listen` the router also serves TCP, where
each caller presents a bearer token of `--clients-file` (kvd's TOKEN TENANT ROLE format) and is
routed and served under that token's tenant. Replicas are Unix sockets, or http(s) URLs reached
with a bearer token that has the admin role (the questions are admin calls); such a replica
honours the passed X-KVD-Tenant only with `trusted_proxy: true`, else the token's tenant counts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import tempfile
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import quote, urlencode

import httpx
from fastapi import Depends, FastAPI, Query, Request
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.exposition import choose_encoder
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvctl import __version__ as kvctl_version
from kvctl.daemon.config import MAX_FILE_BYTES
from kvctl.policies.routing import ROUTING_POLICIES

from .replica_errors import answer_described, described, kvd_json
from .whole_numbers import whole_number
from .api_errors import ApiError
from .auth import BearerRefused, TokenTable, bearer_entry
from .batch_routes import list_page as batch_page
from .body_limit import BodyLimit
from .event_relay import relay_events
from .fleet_admin import (RESET_WAIT_MAX_S, UPDATE_WAIT_MAX_S, bodies_or_errors, combine, merge_audit_lists,
                          merge_cancels,
                          merge_event_lists, merge_evictions, merge_lora_changes, merge_many_unpins, merge_pin_lists,
                          merge_pins,
                          merge_prefix_lists, merge_profiles, merge_request_lists, merge_response_purges, merge_sleeps,
                          merge_tenant_lists, merge_unpins, merge_verifies, merge_webhook_retries,
                          merge_weight_updates, replica_reports)
from .fleet_differences import fleet_differences
from .fleet_files import TenantTurns, bytes_by_replica, elsewhere_header
from . import fleet_rollouts
from .fleet_pins import sync_pins
from .health_checks import fleet_report
from .fleet_trace import merge_traces, trace_query
from .log_throttle import EveryFewSeconds
from .request_log import logfmt
from .request_trace import ROUTER_ATTEMPT_HEADER, RouterAttempt
from .route_spans import NO_ROUTE_SPAN
from .router_metrics import RouterMetrics
from .router_service import (ASK_TIMEOUT_S, KEPT_NOUNS, KeeperUnavailable, ModelNotServed, NoneInTime, Replica,
                             RouterService, Weighed)
from .silent_replicas import ReplicaSilent, watched
from .step_failures import ENGINE_ERROR
from .usage_report import CALLER_ROLE_HEADER

log = logging.getLogger("kvd.router")


def said_in(body: bytes) -> str:
    """The message of a replica's JSON error body, else its first line."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace").splitlines()[0][:200] if body.strip() else "no message"


def log_route(route_id: str, tenant: str | None, path: str, replica: str, upstream: httpx.Response, reason: str,
              tried: list[str], prefilled: str | None, client_id: str | None = None) -> None:
    """kvd router's line for a request it passed to a replica (log_requests): its route id, tenant
    and path, the replica, its answer's status and X-KVD-Request-Id there, why it went there, the
    replicas that turned it away first, and where its prompt was computed; never its body."""
    fields = {"route_id": route_id, "tenant": tenant or "default", "path": path, "replica": replica,
              "status": upstream.status_code, "request_id": upstream.headers.get("x-kvd-request-id"),
              "reason": reason, "tried": "; ".join(tried) or None, "prefill": prefilled,
              **({"client_request_id": client_id} if client_id else {})}
    log.info("route %s", logfmt(fields), extra={"fields": {"event": "route", **fields}})


def log_refused(route_id: str, tenant: str | None, path: str, status: int, tried: list[str], why: str,
                client_id: str | None = None) -> None:
    """kvd router's line for a request no replica took (log_requests): the refusal it returns (the
    last replica's, or its own 503), the replicas that turned it away, and why it went no further;
    never its body."""
    fields = {"route_id": route_id, "tenant": tenant or "default", "path": path, "status": status,
              "tried": "; ".join(tried) or None, "why": why, **({"client_request_id": client_id} if client_id else {})}
    log.info("refused %s", logfmt(fields), extra={"fields": {"event": "route_refused", **fields}})


# disaggregated prefill and decode (prefill_first): vLLM's request field for a KV transfer (kv_transfer.FIELD,
# not imported: the router imports no torch), and the fields the prefill's request leaves out (it makes
# one token, not streamed, for no one to read)
TRANSFER_FIELD = "kv_transfer_params"
PREFILL_DROPPED = ("stream_options", "echo", "logprobs", "top_logprobs", "prompt_logprobs", "min_tokens", "n",
                   "best_of", "max_completion_tokens", TRANSFER_FIELD)
ENGINE_ERROR_EVENT = f'"code": "{ENGINE_ERROR}"'.encode()  # in a stream's error event (kvd's json.dumps)
FLEET_ADMIN_TIMEOUT_S = 150.0  # an eviction may search the shared Redis for 30 s; a pin may warm for 120 s
# and X-KVD-Tenant, as the front resolved it; W3C trace context, so a replica's span has the caller's as parent
PASSED_HEADERS = ("content-type", "traceparent", "tracestate", "x-request-id")  # (a gateway's id: logged there)
# on a refusal returned without trying further: why (no replica left predicted to start it within its max_queue_wait)
NOT_REROUTED_HEADER = "X-KVD-Not-Rerouted"
DISCONNECT_CHECK_S = 0.5  # how often a forwarded non-streamed request looks for its caller having left
# a forward's failures before any byte of an answer came, where the connection itself ended
CLOSED_BEFORE_ANSWER = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# What to ask the router instead, for replica paths that have a fleet counterpart
ROUTER_INSTEAD = {"/admin/drain": "drain or resume one replica through it with kvctl fleet drain (or resume) "
                                  "REPLICA (POST /router/drain)"}


def json_object(raw: bytes) -> dict | None:
    """A request body that is a JSON object, or None."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python recurses
        return None
    return body if isinstance(body, dict) else None


def refusal_code(content: bytes) -> str | None:
    """The `error.code` of a replica's refusal in OpenAI's shape, or None."""
    body = json_object(content)
    error = body.get("error") if body is not None else None
    return error.get("code") if isinstance(error, dict) else None


class CallerLeft(Exception):
    """The caller disconnected before its answer came."""


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # None: the replica's default (a Unix caller that named none)
    role: str


class Refused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


UPLOAD_PIECE = 2**20  # an upload's bytes the router holds in memory, and sends at a time


async def file_pieces(spooled):
    """`spooled`'s bytes from its start, UPLOAD_PIECE at a time (an upload sent on)."""
    spooled.seek(0)
    while piece := spooled.read(UPLOAD_PIECE):
        yield piece


def create_router_app(service: RouterService, max_request_bytes: int = 32 * 2**20, *, front: str = "unix",
                      tokens: TokenTable | None = None, metrics: RouterMetrics | None = None,
                      max_file_bytes: int = MAX_FILE_BYTES) -> FastAPI:
    """The router's front; a body over `max_request_bytes` (an upload to /v1/files: over
    `max_file_bytes`) is refused (413) before it is read whole, as kvd refuses it.

    front "unix": callers are trusted (the socket's mode says who may connect), act as admin, and
    their X-KVD-Tenant passes through. front "tcp": every request but /healthz needs a bearer
    token of `tokens` (TOKEN TENANT ROLE, as kvd's), whose tenant the request is routed and served
    under (a caller's own X-KVD-Tenant is replaced, unless `service.trusted_proxy` or the token's role
    is proxy: then the tenant it names, as kvd's); /router/status, /admin/status and /metrics need the admin
    role. Fronts of one router share `metrics`."""
    if front not in ("unix", "tcp"):
        raise ValueError(f"front: unknown value {front!r}; use unix or tcp")
    if front == "tcp" and tokens is None:
        raise ValueError("front: a tcp front needs the callers' tokens")
    app = FastAPI(title="kvd router", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=lambda: max_request_bytes, file_limit=lambda: max_file_bytes)
    metrics = metrics or RouterMetrics(service)
    prefill_warnings = EveryFewSeconds(log)  # (one a request while no prefill replica answers)
    tenant_turns = TenantTurns()  # a tenant's uploads and new batches, one at a time (fleet_files.py)

    def error(status: int, message: str, code: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "router_error", "param": None, "code": code}},
                            status_code=status, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)

    @app.exception_handler(Refused)
    async def _refused(_: Request, exc: Refused):
        return error(exc.status, str(exc), exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code != 404:
            return error(exc.status_code, str(exc.detail), "invalid_request")
        served = list(dict.fromkeys(r.path for r in app.routes if isinstance(r, APIRoute)))  # as registered
        instead = ROUTER_INSTEAD.get(request.url.path)
        return error(404, f"kvd router does not serve {request.url.path}: "
                          + (f"{instead}; " if instead else "")
                          + f"it serves {', '.join(served[:-1])} and {served[-1]}; ask a replica for the rest "
                            f"(kvctl --socket REPLICA_SOCKET ...)", "not_found")

    async def caller(request: Request) -> Caller:
        if front == "unix":
            return Caller(request.headers.get("x-kvd-tenant"), "admin")
        try:
            entry = bearer_entry(tokens, request.headers.get("authorization", ""))
        except BearerRefused as exc:
            raise Refused(401, str(exc), "unauthenticated") from None
        named = request.headers.get("x-kvd-tenant") if service.trusted_proxy or entry.role == "proxy" else None
        return Caller(named or entry.tenant, entry.role)

    async def admin(who: Caller = Depends(caller)) -> Caller:
        if who.role != "admin":
            raise Refused(403, "this endpoint needs the admin role", "forbidden")
        return who

    @app.get("/healthz")
    async def healthz():  # on the event loop, as kvd's: never waits for a worker thread
        return {"ok": True}

    @app.get("/readyz")
    async def readyz():
        """200 while some replica can take a request: with the events view, one whose feed is
        followed and whose load is current; with ask, one whose own /readyz says so. A prefill
        replica answers no caller itself: it does not count."""
        now = service.clock()
        deciding = [r for r in service.replicas if r.role != "prefill"]
        if service.view == "events":
            ready = [r.name for r in deciding if r.takes_requests and r.view.synced and r.view.load is not None
                     and r.view.load_age(now) <= service.load_stale_seconds]
        else:
            async def one(replica: Replica) -> bool:
                if id(replica) in passed:  # resting unanswering: not ready, known without waiting its timeout
                    return False
                try:
                    return (await service.heard(replica, replica.client.get("/readyz", timeout=ASK_TIMEOUT_S))
                            ).status_code == 200
                except httpx.HTTPError:
                    return False
            taking = [r for r in deciding if r.takes_requests]
            passed = service.not_asked(taking)
            answers = await asyncio.gather(*(one(r) for r in taking))
            ready = [r.name for r, ok in zip(taking, answers) if ok]
        if ready:
            return {"ready": True, "replicas": ready}
        return JSONResponse({"ready": False, "reason": "no replica can take a request"}, status_code=503)

    @app.get("/router/status")
    def router_status(_: Caller = Depends(admin)):
        return service.status()

    @app.post("/router/drain")
    async def drain(http: Request, _: Caller = Depends(admin)):
        """Send a replica no new request (`drain`: true, the default) while its open ones answer,
        or take new ones there again (false): what a replica's restart or upgrade needs. The
        replica is told too (its /admin/drain), so that other routers in front of it leave it out;
        `at_replica` is its answer (its queue), or why it could not take it."""
        body = json_object(await http.body())
        if body is None or not isinstance(body.get("replica"), str):
            return error(400, "replica: expected {\"replica\": NAME, \"drain\": true|false}", "invalid_request")
        on = body.get("drain", True)
        if not isinstance(on, bool):
            return error(400, f"drain: expected true or false, got {on!r}", "invalid_request")
        try:
            replica = service.drain(body["replica"], on)
        except LookupError as exc:
            return error(404, str(exc), "not_found")
        except ValueError as exc:
            return error(409, str(exc), "conflict")
        try:  # and at the replica itself, so that every router in front of it leaves it out
            answer = await replica.client.post("/admin/drain", json={"drain": on}, timeout=ASK_TIMEOUT_S)
            there = kvd_json(answer) if answer.status_code == 200 else {"error": answer_described(answer)}
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            there = {"error": described(exc)}
        if "error" not in there:
            replica.drained_there = bool(there.get("draining"))
            load = replica.view.load if replica.view is not None else None
            if load is not None:  # its answer is newer than the last load poll, which may say the opposite
                load["draining"] = replica.drained_there
        log.info("replica %s %s (%d open here)%s", replica.name, "drained" if on else "taking requests again",
                 replica.open, f"; the replica did not take it: {there['error']}" if "error" in there else "")
        return {"replica": replica.name, "draining": replica.draining, "open": replica.open, "at_replica": there}

    each_replica = service.ask_each  # a resting replica passed over, what came of each call noted

    # ---- operator actions every replica carries out (daemon/server/fleet_admin.py); drained
    # replicas too: they still hold blocks and pins
    async def everywhere(method: str, path: str, content: bytes | None, merge, lacking: str | None = None
                         ) -> JSONResponse:
        """`path` on every replica, their answers merged (fleet_admin.combine). `lacking`: for a path
        kvd always answers where it has it, what a replica's 404 says instead (a kvd without it),
        counted as a refusal rather than as "nothing of it"."""
        replicas = service.replicas
        answers = await each_replica(replicas, method, path, content, FLEET_ADMIN_TIMEOUT_S)
        if lacking is not None:
            answers = [(501, {"error": {"message": lacking}}) if status == 404 else (status, body)
                       for status, body in answers]
        status, body = combine([r.name for r in replicas], answers, merge)
        return JSONResponse(body, status_code=status)

    @app.post("/admin/evict")
    async def evict_everywhere(http: Request, _: Caller = Depends(admin)):
        raw = await http.body()
        body = json_object(raw)
        if body is not None and "purge_once" not in body:  # one search per shared Redis (fleet_admin.py)
            raw = json.dumps({**body, "purge_once": secrets.token_hex(16)}).encode()
        return await everywhere("POST", "/admin/evict", raw, merge_evictions)

    @app.post("/reset_prefix_cache", operation_id="reset_prefix_cache")
    @app.post("/flush_cache", operation_id="flush_cache")
    @app.get("/flush_cache", operation_id="flush_cache_get")
    async def reset_everywhere(timeout: float = Query(0.0, ge=0.0, le=RESET_WAIT_MAX_S),
                               _: Caller = Depends(admin)):
        """vLLM's and SGLang's cache resets: every replica's unpinned blocks (`kvctl evict
        --all-unpinned` at the router), after waiting up to `timeout` seconds for the requests
        this router sent to finish; a 409 when some blocks stayed (in use, or a replica not
        reached), the body saying which."""
        deadline = time.monotonic() + timeout
        while any(r.open for r in service.replicas) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        answer = await everywhere("POST", "/admin/evict", b'{"all_unpinned": true}', merge_evictions)
        if answer.status_code == 200 and json.loads(answer.body)["result"] != "ok":
            answer.status_code = 409
        return answer

    @app.post("/admin/evict/preview")
    async def evict_preview_everywhere(http: Request, _: Caller = Depends(admin)):
        """What every replica would evict (kvctl evict --dry-run): nothing goes, nothing is searched."""
        return await everywhere("POST", "/admin/evict/preview", await http.body(), merge_evictions)

    # LoRA adapters at runtime (vLLM's endpoints): every replica loads or unloads it, each under its own
    # lora_runtime_updates; the router sends the adapter's requests where it is served from its next poll
    def relayed(path: str, merge):
        """POST `path`: the caller's body to every replica, the answers merged by `merge`."""
        async def everywhere_post(http: Request, _: Caller = Depends(admin)) -> JSONResponse:
            return await everywhere("POST", path, await http.body(), merge)

        app.add_api_route(path, everywhere_post, methods=["POST"], name=f"{path.rsplit('/', 1)[-1]}_everywhere")

    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        relayed(path, merge_lora_changes)
    relayed("/admin/responses/purge", merge_response_purges)  # each replica keeps its own responses
    relayed("/admin/webhooks/retry", merge_webhook_retries)  # ... and sends its own webhooks
    # sleep (kvctl sleep and wake; vLLM's names below): every replica gives back its memory, or takes it again
    for path in ("/admin/sleep", "/admin/wake"):
        relayed(path, merge_sleeps)

    # new weights in place (kvctl update-weights; SGLang's name, whose router sends it to every worker too)
    relayed("/admin/weights", merge_weight_updates)

    @app.post("/update_weights_from_disk", operation_id="update_weights_from_disk")
    async def update_weights_everywhere(http: Request, _: Caller = Depends(admin)):
        body = json_object(await http.body()) or {}
        asked = {"model_path": body.get("model_path"), "timeout": UPDATE_WAIT_MAX_S,
                 "abort_running": bool(body.get("abort_all_requests", False))}
        return await everywhere("POST", "/admin/weights", json.dumps(asked).encode(), merge_weight_updates)

    @app.post("/sleep", operation_id="sleep")
    async def sleep_everywhere(level: int = Query(1), timeout: float = Query(0.0), _: Caller = Depends(admin)):
        body = json.dumps({"level": level, "timeout": timeout}).encode()
        return await everywhere("POST", "/admin/sleep", body, merge_sleeps)

    @app.post("/wake_up", operation_id="wake_up")
    async def wake_everywhere(tags: list[str] | None = Query(None), _: Caller = Depends(admin)):
        return await everywhere("POST", "/admin/wake", json.dumps({"tags": tags}).encode(), merge_sleeps)

    @app.get("/is_sleeping", operation_id="is_sleeping")
    async def is_sleeping_everywhere(_: Caller = Depends(admin)):
        """Asleep while any replica is; each one's answer in its row."""
        replicas = service.replicas
        answers = await each_replica(replicas, "GET", "/is_sleeping")
        status, body = replica_reports([r.name for r in replicas], answers)
        if status == 200:
            body["is_sleeping"] = any(row.get("report", {}).get("is_sleeping") for row in body["replicas"])
        return JSONResponse(body, status_code=status)
    # profiles (kvctl profile; vLLM's and SGLang's names, which AIPerf's --server-profiler calls):
    # each replica profiles its own engine thread and writes its own trace
    for path in ("/admin/profile/start", "/admin/profile/stop", "/start_profile", "/stop_profile"):
        relayed(path, merge_profiles)

    def merged_listing(path: str, merge):
        """GET `path`: every replica's listing there (with the caller's query), merged by `merge`."""

        async def listing(http: Request, _: Caller = Depends(admin)) -> JSONResponse:
            replicas = service.replicas
            query = f"?{http.url.query}" if http.url.query else ""
            answers = await each_replica(replicas, "GET", path + query)
            status, body = merge([r.name for r in replicas], answers)
            return JSONResponse(body, status_code=status)

        app.add_api_route(path, listing, methods=["GET"], name=f"{path.rsplit('/', 1)[-1]}_everywhere")

    for path, merge in (("/admin/requests", merge_request_lists), ("/admin/tenants", merge_tenant_lists),
                        ("/admin/tiers", replica_reports), ("/admin/prefixes", merge_prefix_lists),
                        ("/admin/pins", merge_pin_lists), ("/admin/profile", replica_reports),
                        ("/admin/responses", replica_reports), ("/admin/audit", merge_audit_lists),
                        ("/admin/batches", replica_reports), ("/admin/files", replica_reports),
                        ("/admin/webhooks", replica_reports), ("/admin/rollouts", replica_reports),
                        ("/admin/rollouts/history", replica_reports)):
        merged_listing(path, merge)

    # fleet rollouts (fleet_rollouts.py): one rollout at every replica, named by its fleet id here
    @app.post("/admin/rollouts")
    async def fleet_rollout_start(http: Request, _: Caller = Depends(admin)):
        status, body = await fleet_rollouts.start_everywhere(service.replicas, service.ask_each, await http.body())
        return JSONResponse(body, status_code=status)

    @app.get("/admin/rollouts/{rollout_id}")
    async def fleet_rollout_status(rollout_id: str, _: Caller = Depends(admin)):
        status, body = fleet_rollouts.fleet_named(rollout_id) or \
            await fleet_rollouts.status_everywhere(service.replicas, service.ask_each, rollout_id)
        return JSONResponse(body, status_code=status)

    @app.post("/admin/rollouts/{rollout_id}/{action}")
    async def fleet_rollout_move(rollout_id: str, action: str, http: Request, _: Caller = Depends(admin)):
        if action not in fleet_rollouts.MOVES:
            return error(404, f"action: a rollout moves by {', '.join(fleet_rollouts.MOVES)}, got {action[:40]!r}",
                         "not_found")
        status, body = fleet_rollouts.fleet_named(rollout_id) or await fleet_rollouts.move_everywhere(
            service.replicas, service.ask_each, rollout_id, action, await http.body())
        return JSONResponse(body, status_code=status)

    @app.get("/admin/events")
    async def events_everywhere(http: Request, _: Caller = Depends(admin)):
        """Every replica's newest cache events, merged by time (`kvctl events` at the router). Not
        `since` or `wait`: each replica numbers its own events, so following is one replica's."""
        for name in ("since", "wait"):
            if name in http.query_params:
                return error(400, f"{name}: kvd router has no sequence of events of its own (each replica numbers "
                             "its own): ask one replica to follow or page its events (kvctl --socket REPLICA "
                             "events --follow)", "invalid_request")
        tail = http.query_params.get("tail", "30")
        try:
            count = int(tail)
        except ValueError:
            return error(400, f"tail: expected an integer, got {tail!r}", "invalid_request")
        query = urlencode({**{k: v for k, v in http.query_params.items() if k != "tail"}, "tail": count})
        replicas = service.replicas
        answers = await each_replica(replicas, "GET", "/admin/events?" + query)
        status, body = merge_event_lists([r.name for r in replicas], answers, count)
        return JSONResponse(body, status_code=status)

    @app.post("/admin/tiers/verify")
    async def verify_everywhere(http: Request, _: Caller = Depends(admin)):
        return await everywhere("POST", "/admin/tiers/verify", await http.body(), merge_verifies)

    @app.delete("/admin/tiers/verify")
    async def stop_verifying_everywhere(_: Caller = Depends(admin)):
        return await everywhere("DELETE", "/admin/tiers/verify", None, merge_verifies)

    @app.post("/admin/cancel")
    async def cancel_everywhere(http: Request, _: Caller = Depends(admin)):
        return await everywhere("POST", "/admin/cancel", await http.body(), merge_cancels)

    @app.post("/admin/pins")
    async def pin_everywhere(http: Request, _: Caller = Depends(admin)):
        return await everywhere("POST", "/admin/pins", await http.body(), merge_pins)

    @app.delete("/admin/pins")
    async def unpin_stranded_everywhere(http: Request, _: Caller = Depends(admin)):
        """Every replica unpins its stranded pins (stranded=true; each replica refuses anything else)."""
        query = f"?{http.url.query}" if http.url.query else ""
        return await everywhere("DELETE", "/admin/pins" + query, None, merge_many_unpins)

    @app.delete("/admin/tenants/{tenant}/pins")
    async def unpin_tenant_everywhere(tenant: str, http: Request, _: Caller = Depends(admin)):
        """Every replica unpins the tenant's pins (stranded=true: its stranded ones)."""
        query = f"?{http.url.query}" if http.url.query else ""
        # (kvd answers a tenant without pins with none unpinned: a 404 is a kvd without the path)
        return await everywhere("DELETE", f"/admin/tenants/{quote(tenant, safe='')}/pins" + query, None,
                                merge_many_unpins, lacking="this kvd has no DELETE /admin/tenants/{tenant}/pins (an "
                                                           "older kvd): unpin the tenant's pins there by id")

    @app.delete("/admin/pins/{pin_id}")
    async def unpin_everywhere(pin_id: str, _: Caller = Depends(admin)):
        return await everywhere("DELETE", f"/admin/pins/{quote(pin_id, safe='')}", None, merge_unpins)

    @app.get("/admin/trace")
    async def fleet_trace(http: Request, _: Caller = Depends(admin)):
        """The replicas' traces as one, in arrival order (daemon/server/fleet_trace.py); refused
        when the replicas key their block ids apart."""
        raw = http.query_params.get("last")
        last = whole_number(raw)
        if raw is not None and not (last or 0) >= 1:
            return error(400, f"last: must be a whole number >= 1, got {raw[:40]!r}", "invalid_request")
        replicas = service.replicas
        answers = await each_replica(replicas, "GET", trace_query(last), timeout=FLEET_ADMIN_TIMEOUT_S)
        status, body = merge_traces([r.name for r in replicas], answers, last, list(service.untraced))
        return JSONResponse(body, status_code=status)

    @app.post("/router/sync-pins")
    async def sync_pins_everywhere(_: Caller = Depends(admin)):
        """Every pin of the fleet on every replica of its block space that lacks it (fleet_pins.py)."""
        status, body = await sync_pins(service.replicas, service.ask_each)
        return JSONResponse(body, status_code=status)

    @app.post("/router/route")
    async def route_what_if(http: Request, who: Caller = Depends(admin)):
        """Where the router would send this request now (a completion's or a chat's body), and where each
        other policy of `routing` (a list of names) would, from the same facts; nothing is sent
        to any replica but questions the view cannot answer."""
        body = json_object(await http.body())
        if body is None:
            return error(400, "body: expected a JSON object", "invalid_json")
        others = body.pop("routing", None) or []
        if not isinstance(others, list) or not all(p in ROUTING_POLICIES for p in others):
            return error(400, f"routing: expected a list of {', '.join(ROUTING_POLICIES)}, got {others!r}",
                         "invalid_routing")
        policies = [service.router.name] + [p for p in dict.fromkeys(others) if p != service.router.name]
        try:
            return await service.what_if(body, who.tenant, policies)
        except ModelNotServed as exc:
            return error(404, str(exc), "model_not_found")
        except LookupError as exc:
            return error(503, str(exc), "no_replica")

    @app.get("/metrics")
    def metrics_endpoint(http: Request, _: Caller = Depends(admin)):
        encoder, media = choose_encoder(http.headers.get("accept", ""))  # OpenMetrics: with exemplars
        return Response(encoder(metrics.registry), media_type=media)

    @app.get("/admin/status")
    async def fleet_status(_: Caller = Depends(admin)):
        """The replicas' statuses, with the figures a fleet adds up (model steps, queue) summed:
        what `kvctl bench serve` reads of the daemon it drives."""
        replicas = service.replicas
        statuses = bodies_or_errors(await each_replica(replicas, "GET", "/admin/status"))
        live = [st for st in statuses if "error" not in st]
        if not live:
            return error(503, "no replica answered", "no_replica")
        steps: dict[str, dict[str, float]] = {}
        for st in live:
            for kind, figures in st.get("steps", {}).items():
                summed = steps.setdefault(kind, {"count": 0, "seconds": 0.0})
                summed["count"] += figures["count"]
                summed["seconds"] += figures["seconds"]
        queue = {k: sum(st["queue"][k] for st in live) for k in ("waiting", "running")}
        answering = [(r.name, st) for r, st in zip(replicas, statuses) if "error" not in st]
        return {"model": live[0]["model"], "steps": steps, "queue": queue, **service.status(),
                # where the answering replicas' software, weights or formats differ (fleet_differences.py)
                "differences": fleet_differences(answering),
                "replica_status": [{"replica": r.name, **st} for r, st in zip(replicas, statuses)]}

    @app.get("/admin/checks")
    async def fleet_checks(_: Caller = Depends(admin)):
        """Each replica's checks, under its name, and the fleet's own (health_checks.fleet_report):
        what `kvctl check` at the router shows."""
        replicas = service.replicas
        answers = await each_replica(replicas, "GET", "/admin/checks")
        return fleet_report([(r.name, code, body) for r, (code, body) in zip(replicas, answers)], service.status())

    async def fleet_models() -> list[dict] | None:
        """Every model some replica serves, once each; its max_model_len the least of theirs, so a
        request sized to it fits whichever replica it is sent to. None: no replica answered."""
        listed = [body["data"] for status, body in await each_replica(service.replicas, "GET", "/v1/models")
                  if status == 200 and isinstance(body, dict) and isinstance(body.get("data"), list)]
        if not listed:
            return None
        data = {}
        for models_of_one in listed:
            for model in models_of_one:
                seen = data.setdefault(model["id"], dict(model))
                if isinstance(model.get("max_model_len"), int) and isinstance(seen.get("max_model_len"), int):
                    seen["max_model_len"] = min(seen["max_model_len"], model["max_model_len"])
        return list(data.values())

    @app.get("/v1/models")
    async def models(_: Caller = Depends(caller)):
        data = await fleet_models()
        return error(503, "no replica answered", "no_replica") if data is None else {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, _: Caller = Depends(caller)):
        """One model of the fleet's, as /v1/models lists it; a 404 where no replica serves it."""
        data = await fleet_models()
        if data is None:
            return error(503, "no replica answered", "no_replica")
        for listed in data:
            if listed["id"] == model_id:
                return listed
        return error(404, f"model: {model_id!r} is not served by any replica; GET /v1/models lists "
                          f"{', '.join(sorted(repr(m['id']) for m in data))}", "model_not_found")

    @app.get("/health")
    async def health():
        """vLLM's liveness probe: the router is up (/readyz says whether a replica can serve)."""
        return {}

    @app.get("/version")
    async def version():
        return {"version": kvctl_version}

    @app.post("/tokenize")
    async def tokenize(http: Request, _: Caller = Depends(caller)):
        return await ask_any("/tokenize", await http.body())

    @app.post("/detokenize")
    async def detokenize(http: Request, _: Caller = Depends(caller)):
        return await ask_any("/detokenize", await http.body())

    async def ask_any(path: str, raw: bytes) -> JSONResponse:
        """The answer of the first replica taking requests that gives one (every replica of a fleet
        serves one model, so one tokenizer): its refusal of a bad body too; a replica that cannot
        be reached or is not ready is passed over, and one resting unanswering is not asked."""
        why = "no replica takes requests"
        taking = [r for r in service.replicas if r.takes_requests]
        passed = service.not_asked(taking)
        for replica in [r for r in taking if id(r) not in passed]:
            try:
                answer = await service.heard(replica, replica.client.post(
                    path, content=raw, timeout=ASK_TIMEOUT_S, headers={"Content-Type": "application/json"}))
            except httpx.HTTPError as exc:
                why = f"{replica.name}: {described(exc)}"
                continue
            if answer.status_code == 503:
                why = f"{replica.name}: {answer_described(answer)}"
                continue
            try:
                return JSONResponse(answer.json(), status_code=answer.status_code)
            except ValueError:
                why = f"{replica.name}: answered {answer.status_code} without JSON"
        return error(503, f"no replica answered: {why}", "no_replica")

    @app.post("/v1/completions")
    async def completions(http: Request, who: Caller = Depends(caller)):
        return await forward("/v1/completions", http, who)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request, who: Caller = Depends(caller)):
        return await forward("/v1/chat/completions", http, who)

    @app.post("/v1/responses")
    async def responses(http: Request, who: Caller = Depends(caller)):
        return await forward("/v1/responses", http, who)

    @app.post("/v1/responses/input_tokens")  # (at the replica that keeps what it continues, where it does)
    async def count_input_tokens(http: Request, who: Caller = Depends(caller)):
        return await forward("/v1/responses/input_tokens", http, who)

    @app.get("/v1/responses/{response_id}")
    async def kept_response(response_id: str, http: Request, who: Caller = Depends(caller)):
        return await at_home(response_id, "GET", who, "", http.query_params)  # (?stream=true: its events again)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, who: Caller = Depends(caller)):
        return await at_home(response_id, "POST", who, "/cancel")

    @app.get("/v1/responses/{response_id}/input_items")
    async def kept_input_items(response_id: str, http: Request, who: Caller = Depends(caller)):
        return await at_home(response_id, "GET", who, "/input_items", http.query_params)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, who: Caller = Depends(caller)):
        return await at_home(response_id, "DELETE", who)

    @app.post("/v1/conversations")
    async def create_conversation(http: Request, who: Caller = Depends(caller)):
        return await made_at_home("/v1/conversations", http, who)

    async def made_at_home(path: str, http: Request, who: Caller, spooled=None,
                           headers_for: Callable[[Replica], dict] = lambda replica: {}) -> Response:
        """A conversation (or a file, /v1/files) made at `conversation_home`'s choice, its id noted
        as kept there. One that cannot be reached, closes the connection before answering (once,
        as forward) or is stopping (503) has made none: the next is tried. `spooled`: the body,
        in a file (an upload), sent from its start to each replica tried; `headers_for`: the
        router's own headers for the replica it is sent to."""
        content = await http.body() if spooled is None else spooled
        excluded, tried, closed_retried = set(), [], False
        media = http.headers.get("content-type")
        while (replica := service.conversation_home(excluded)) is not None:
            try:
                answer = await relayed_or_raise(replica, "POST", path, who, content=content, media=media,
                                                extra=headers_for(replica))
            except (httpx.ConnectError, httpx.ConnectTimeout, *CLOSED_BEFORE_ANSWER) as exc:
                replica.last_error = described(exc)
                if not isinstance(exc, CLOSED_BEFORE_ANSWER):
                    service.went_unanswered(replica, replica.last_error)
                elif closed_retried:
                    replica.failed_forwards += 1
                    return error(502, f"replica {replica.name} failed: {replica.last_error}", "replica_failed")
                closed_retried = closed_retried or isinstance(exc, CLOSED_BEFORE_ANSWER)
                replica.rerouted += 1
                tried.append(f"{replica.name} ({replica.last_error})")
                excluded.add(id(replica))
                continue
            except httpx.HTTPError as exc:
                replica.last_error = described(exc)
                replica.failed_forwards += 1
                return error(502, f"replica {replica.name} failed: {replica.last_error}", "replica_failed")
            if answer.status_code == 503:
                replica.rerouted += 1
                tried.append(f"{replica.name} (503: {said_in(answer.body)})")
                excluded.add(id(replica))
                continue
            if answer.status_code == 200:  # its turns, and every request about it, go there
                service.response_homes.note(json.loads(answer.body)["id"], replica.name)
            return answer
        if not tried:
            return error(503, "no replica takes requests now", "no_replica")
        return error(503, "no replica answered: " + "; ".join(tried), "no_replica")

    # ---- /v1/files and /v1/batches: a file is kept where it was uploaded, and a batch is made and
    # served where its input file is kept (its output files are written there too)
    @app.post("/v1/files")
    async def upload_file(http: Request, who: Caller = Depends(caller)):
        """An upload, kept in a file as it comes (a MiB in memory at most: 200 MiB uploads at once
        would otherwise sit in the router's memory), then sent on a piece at a time."""
        with tempfile.SpooledTemporaryFile(max_size=UPLOAD_PIECE) as spooled:
            async for piece in http.stream():
                spooled.write(piece)
            async with tenant_turns.of(files_tenant(who)):  # (its budget is the fleet's: fleet_files.py)
                held = await files_held(who)
                return await made_at_home("/v1/files", http, who, spooled,
                                          headers_for=lambda replica: elsewhere_header(held, replica))

    def files_tenant(who: Caller) -> str:
        return who.tenant if who.tenant is not None else "default"  # (a replica's, for a caller naming none)

    async def files_held(who: Caller) -> dict[int, int]:
        """What the caller's tenant's files take at each replica that keeps files and answers."""
        tenant, keepers = files_tenant(who), [r for r in service.replicas if r.role != "prefill"]
        answers = await each_replica(keepers, "GET", "/admin/files?" + urlencode({"tenant": tenant}))
        return bytes_by_replica(keepers, tenant, answers)

    @app.api_route("/v1/files/{file_id}", methods=["GET", "DELETE"])
    async def kept_file(file_id: str, http: Request, who: Caller = Depends(caller)):
        return await at_home(file_id, http.method, who, kind="files")

    @app.get("/v1/files/{file_id}/content")
    async def kept_file_content(file_id: str, who: Caller = Depends(caller)):
        return await at_home(file_id, "GET", who, "/content", kind="files")

    @app.post("/v1/batches")
    async def create_batch(http: Request, who: Caller = Depends(caller)):
        content = await http.body()
        file_id = (json_object(content) or {}).get("input_file_id")
        if not isinstance(file_id, str):
            return error(400, f"input_file_id: must be the id of a file uploaded with purpose 'batch', got "
                         f"{file_id!r}", "invalid_request")
        try:
            replica = await service.find_keeper(file_id, who.tenant, "files")
        except KeeperUnavailable as exc:
            return JSONResponse({"error": {"message": f"input_file_id: {exc}", "type": "router_error",
                                           "param": "input_file_id", "code": "keeper_unavailable"}}, status_code=503)
        if replica is None:
            return JSONResponse({"error": {"message": f"input_file_id: no replica keeps file {file_id!r} (for this "
                                           "tenant)", "type": "not_found_error", "param": "input_file_id",
                                           "code": "file_not_found"}}, status_code=404)
        async with tenant_turns.of(files_tenant(who)):  # (its output's room is the fleet's: fleet_files.py)
            held = await files_held(who)
            answer = await relayed(replica, "POST", "/v1/batches", who, content=content,
                                   extra=elsewhere_header(held, replica))
        if answer.status_code == 200:
            service.response_homes.note(json.loads(answer.body)["id"], replica.name)
        return answer

    @app.get("/v1/batches/{batch_id}")
    async def kept_batch(batch_id: str, who: Caller = Depends(caller)):
        return await at_home(batch_id, "GET", who, kind="batches")

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_kept_batch(batch_id: str, who: Caller = Depends(caller)):
        return await at_home(batch_id, "POST", who, "/cancel", kind="batches")

    @app.get("/v1/files")
    async def files_everywhere(http: Request, who: Caller = Depends(caller)):
        """The caller's files at every replica, the latest first."""
        rows, status, body = await lists_everywhere("/v1/files", who, dict(http.query_params))
        return JSONResponse({"object": "list", "data": rows, "has_more": False} if rows is not None else body,
                            status_code=status)

    @app.get("/v1/batches")
    async def batches_everywhere(after: str | None = Query(None), limit: str | None = Query(None),
                                 who: Caller = Depends(caller)):
        """The caller's batches at every replica, the latest first, paged as one kvd pages them
        (each replica's latest 100 at most)."""
        rows, status, body = await lists_everywhere("/v1/batches", who, {"limit": "100"})
        if rows is None:
            return JSONResponse(body, status_code=status)
        try:
            return batch_page(rows, after, limit)
        except ApiError as exc:
            return error(400, str(exc), "invalid_request")

    async def lists_everywhere(path: str, who: Caller, params: dict) -> tuple[list | None, int, dict]:
        """(every replica's `data` at `path` for the caller, the latest first, 200, {}); where none
        answered, (None, 503, the error naming each)."""
        replicas = [r for r in service.replicas if r.role != "prefill"]

        async def asked(replica):
            try:
                answer = await relayed_or_raise(replica, "GET", path, who, params=params)
            except httpx.HTTPError as exc:
                return f"{replica.name} ({described(exc)})"
            if answer.status_code != 200:
                return f"{replica.name} (answered {answer.status_code})"
            return json.loads(answer.body)["data"]

        answers = await asyncio.gather(*(asked(r) for r in replicas))
        lists = [a for a in answers if isinstance(a, list)]
        if replicas and not lists:
            return None, 503, {"error": {"message": "no replica answered: " + "; ".join(answers),
                                         "type": "router_error", "param": None, "code": "no_replica"}}
        rows = sorted((row for listed in lists for row in listed), key=lambda row: (row["created_at"], row["id"]),
                      reverse=True)
        return rows, 200, {}

    async def at_keeper(method: str, path: str, content: bytes | None) -> JSONResponse:
        """An operator's request about one batch or file, at the replica that keeps it: each is
        asked (the others answer 404); the answer of the one that keeps it, its name added."""
        replicas = service.replicas
        answers = await each_replica(replicas, method, path, content, FLEET_ADMIN_TIMEOUT_S)
        ranked = sorted(zip(replicas, answers), key=lambda pair: (pair[1][0] != 200, pair[1][0] == 404))
        replica, (status, body) = ranked[0]
        return JSONResponse({**body, "replica": replica.name} if status == 200 else body, status_code=status or 502)

    @app.post("/admin/batches/{batch_id}/cancel")
    async def cancel_batch_everywhere(batch_id: str, _: Caller = Depends(admin)):
        return await at_keeper("POST", f"/admin/batches/{quote(batch_id, safe='')}/cancel", b"{}")

    @app.delete("/admin/files/{file_id}")
    async def delete_file_everywhere(file_id: str, _: Caller = Depends(admin)):
        return await at_keeper("DELETE", f"/admin/files/{quote(file_id, safe='')}", None)

    @app.post("/admin/webhooks/resend/{object_id}")
    async def resend_webhook_where_kept(object_id: str, _: Caller = Depends(admin)):
        return await at_keeper("POST", f"/admin/webhooks/resend/{quote(object_id, safe='')}", b"{}")

    @app.api_route("/v1/conversations/{conversation_id}", methods=["GET", "POST", "DELETE"])
    async def conversation(conversation_id: str, http: Request, who: Caller = Depends(caller)):
        return await at_home(conversation_id, http.method, who, params=http.query_params,
                             content=await http.body(), kind="conversations")

    @app.api_route("/v1/conversations/{conversation_id}/items", methods=["GET", "POST"])
    async def conversation_items(conversation_id: str, http: Request, who: Caller = Depends(caller)):
        return await at_home(conversation_id, http.method, who, "/items", http.query_params, await http.body(),
                             kind="conversations")

    @app.api_route("/v1/conversations/{conversation_id}/items/{item_id}", methods=["GET", "DELETE"])
    async def conversation_item(conversation_id: str, item_id: str, http: Request, who: Caller = Depends(caller)):
        return await at_home(conversation_id, http.method, who, f"/items/{quote(item_id, safe='')}",
                             http.query_params, kind="conversations")

    async def at_home(response_id: str, method: str, who: Caller, below: str = "", params=None,
                      content: bytes | None = None, kind: str = "responses") -> Response:
        """The answer of the replica that keeps the response (response_homes.py), as it came: it
        alone says whether the caller's tenant may read it. `below`: a path under the response's
        (its input items, its cancel), asked with the caller's query `params`. A stream (a background
        response's events again) is relayed as it comes, with no time limit between its events.
        `kind` "conversations": a conversation's, `content` the caller's body; "files" or "batches"
        (/v1/files, /v1/batches) a file's or a batch's."""
        noun = KEPT_NOUNS[kind]
        try:
            replica = await service.find_keeper(response_id, who.tenant, kind)
        except KeeperUnavailable as exc:  # none said it keeps it, and some could not say
            return JSONResponse({"error": {"message": f"{noun}_id: {exc}", "type": "router_error",
                                           "param": f"{noun}_id", "code": "keeper_unavailable"}}, status_code=503)
        if replica is None:
            return JSONResponse({"error": {
                "message": f"{noun}_id: no replica keeps {noun} {response_id!r} (for this tenant)",
                "type": "not_found_error", "param": f"{noun}_id", "code": f"{noun}_not_found"}}, status_code=404)
        answer = await relayed(replica, method, f"/v1/{kind}/{quote(response_id, safe='')}{below}", who, params,
                               content)
        if method == "DELETE" and not below and answer.status_code == 200:
            service.response_homes.forget(response_id)
        return answer

    async def relayed(replica, method: str, path: str, who: Caller, params=None,
                      content: bytes | None = None, extra: dict | None = None) -> Response:
        """`replica`'s answer to `method path` as the caller's tenant, as it came (a stream as its
        events come); a 502 where the replica failed to answer."""
        try:
            return await relayed_or_raise(replica, method, path, who, params, content, extra=extra)
        except httpx.HTTPError as exc:
            return error(502, f"replica {replica.name} failed: {described(exc)}", "replica_failed")

    async def relayed_or_raise(replica, method: str, path: str, who: Caller, params=None,
                               content=None, media: str | None = None, extra: dict | None = None) -> Response:
        """relayed's work; httpx.HTTPError where the replica failed to answer. `content`: the body,
        bytes or a file (sent from its start, a piece at a time); `media`: its content type where it
        is not JSON (a file uploaded as multipart form data); `extra`: headers of the router's own."""
        headers = {"X-KVD-Tenant": who.tenant} if who.tenant is not None else {}
        headers.update(extra or {})
        if content is not None and not isinstance(content, bytes):
            headers["Content-Length"] = str(content.seek(0, 2))
            content = file_pieces(content)
        if content:
            headers["Content-Type"] = media or "application/json"
        streamed = params is not None and str(params.get("stream", "")).lower() in ("true", "1")
        request = replica.client.build_request(
            method, path, params=params, headers=headers, content=content or None,
            timeout=httpx.Timeout(ASK_TIMEOUT_S, read=None) if streamed else ASK_TIMEOUT_S)
        answer = await replica.client.send(request, stream=True)
        media = answer.headers.get("content-type", "application/json")
        if media.startswith("text/event-stream"):
            async def relay():
                try:
                    async for piece in answer.aiter_raw():
                        yield piece
                finally:
                    await answer.aclose()
            return StreamingResponse(relay(), status_code=answer.status_code, media_type=media,
                                     headers={"X-KVD-Replica": replica.name})
        try:
            content = await answer.aread()
        finally:
            await answer.aclose()
        return Response(content, status_code=answer.status_code, headers={"X-KVD-Replica": replica.name},
                        media_type=media)

    async def prefill_first(path: str, body: dict, headers: dict, route_id: str, routed_at: float,
                            unless_caller_leaves, span) -> tuple[dict | None, str | None, int, Weighed | None]:
        """Disaggregated prefill and decode (daemon/server/kv_transfer.py): have a prefill replica
        compute the prompt (one token of output, not streamed) and write its blocks to the shared
        Redis, unless the replica that decodes it is to compute it (RouterService.local_prefill).

        Returns (the kv_transfer_params the prefill's answer gives the decode, or None when the
        decode replica computes the prompt; what X-KVD-Prefill says: the prefill replica, or why
        none, or None when no replica decodes the request; how many prefill replicas were asked;
        the weighing of the replicas that decode when it stands for the decode's choice, else None).
        Each prefill replica asked is a try of the route's `span` (route_spans.py).
        A prefill replica that refuses (429, 503), cannot be reached or fails is passed over for
        the next: a prefill twice costs time, never a wrong answer. CallerLeft when the caller
        leaves meanwhile."""
        tenant = headers.get("X-KVD-Tenant")
        try:
            local, weighed = await unless_caller_leaves(service.local_prefill(body, tenant))
        except LookupError:  # no replica decodes it: the forward says why, with nothing computed for it
            return None, None, 0, None
        if local is not None:
            service.pd_outcomes["local"] += 1
            return None, local, 0, weighed
        asked = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
        asked.update(max_tokens=1, stream=False)
        asked[TRANSFER_FIELD] = {"do_remote_decode": True}
        content, excluded, tried = json.dumps(asked).encode(), set(), []
        while True:
            try:
                replica, _ = await service.choose(asked, tenant, excluded, phase="prefill", exemplar=span.exemplar)
            except LookupError as exc:
                outcome, why = "no_prefill_replica", "; ".join(tried) or str(exc)
                break
            headers[ROUTER_ATTEMPT_HEADER] = RouterAttempt(route_id, len(tried) + 1, routed_at).header()
            span.attempt(replica.name, "prefill", headers)
            replica.open += 1
            try:
                answer = await unless_caller_leaves(replica.client.post(path, content=content, headers=headers),
                                                    replica, service.clock())
            except httpx.HTTPError as exc:  # (silent: its one token is asked of the next prefill replica)
                if isinstance(exc, ReplicaSilent):
                    replica.given_up += 1
                    said = f"given up: {exc}"
                else:
                    said = replica.last_error = described(exc)
                if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                    service.went_unanswered(replica, replica.last_error)
                replica.failed_forwards += 1
                span.attempt_failed(said)
                tried.append(f"{replica.name} ({said})")
                excluded.add(id(replica))
                continue
            finally:
                replica.open -= 1
            span.answered(answer.status_code, whole=True)
            if answer.status_code in (429, 503):  # full or stopping: the next prefill replica
                replica.rerouted += 1
                tried.append(f"{replica.name} ({answer.status_code})")
                excluded.add(id(replica))
                continue
            params = None
            if answer.status_code == 200:
                try:
                    params = kvd_json(answer).get(TRANSFER_FIELD)
                except (ValueError, AttributeError):  # not kvd's JSON object: no transfer
                    params = None
            if isinstance(params, dict):
                service.pd_outcomes["transferred"] += 1
                return params, replica.name, len(tried) + 1, None
            # refused (a bad request, which the decode replica then refuses to the caller itself; no
            # Redis tier there, 409) or no transfer in its answer: the decode replica computes it all
            outcome = "prefill_failed"
            tried.append(f"{replica.name} (" + (answer_described(answer) if answer.status_code != 200 else
                                                f"answered without {TRANSFER_FIELD}") + ")")
            why = tried[-1]
            break
        service.pd_outcomes[outcome] += 1
        prefill_warnings.warning("disaggregated prefill not done (%s): the decode replica computes the whole prompt",
                                 why)
        return None, f"none: {why}", len(tried), None

    async def forward(path: str, http: Request, who: Caller):
        """Route the request, send it to the chosen replica's `path` as it came, and stream the
        answer back; refusals before a start are passed to the next best replica. Traced where the
        router sends spans (route_spans.py): the route's span ends with the answer's last byte."""
        spans = service.route_spans
        span = spans.begin(path, http.headers, who.tenant) if spans is not None else NO_ROUTE_SPAN
        try:
            answer = await routed(path, http, who, span)
        except asyncio.CancelledError:  # the caller left (or the router stops): no answer, no failure
            span.end(None)
            raise
        except BaseException as exc:
            span.end(None, error=f"the router failed: {type(exc).__name__}")
            raise
        return span.ended_with(answer)

    async def routed(path: str, http: Request, who: Caller, span) -> Response:
        """forward's work, each try at a replica a try of `span`."""
        async def unless_caller_leaves(step, replica: Replica | None = None, sent_at: float = 0.0):
            """Await `step`, looking every DISCONNECT_CHECK_S for the caller having left: then it is
            cancelled (closing the replica's connection, which cancels the request there) and
            CallerLeft raised. With `replica` (the request sent there at `sent_at`), for it having gone
            silent too: then ReplicaSilent (silent_replicas.py)."""
            task = asyncio.ensure_future(step)
            while not (await asyncio.wait({task}, timeout=DISCONNECT_CHECK_S))[0]:
                silent = service.given_up_on(replica, sent_at) if replica is not None else None
                if silent is not None or await http.is_disconnected():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    raise ReplicaSilent(silent) if silent is not None else CallerLeft
            return task.result()

        def given_up(replica: Replica, exc: ReplicaSilent) -> Response:
            """The answer to a request whose replica went silent: a 504, not sent elsewhere (it may
            have run there)."""
            replica.failed_forwards += 1
            replica.given_up += 1
            span.attempt_failed(f"given up: {exc}")
            log.warning("replica %s %s: gave up a request sent to it", replica.name, exc)
            return error(504, f"replica {replica.name} {exc}: the router stopped waiting for this answer (it may "
                         "have run there, so it was not sent elsewhere)", "replica_timeout")

        raw = await http.body()
        body = json_object(raw)
        if body is None:
            return error(400, "body: expected a JSON object", "invalid_json")
        if TRANSFER_FIELD in body:  # the router decides KV transfers: a caller's own is not passed on
            del body[TRANSFER_FIELD]
            raw = json.dumps(body).encode()
        tenant = who.tenant
        headers = {k: v for k, v in http.headers.items() if k.lower() in PASSED_HEADERS}
        if tenant is not None:
            headers["X-KVD-Tenant"] = tenant
        if who.role != "admin":  # the replica reports to this caller as to a user of its own (usage_report.py)
            headers[CALLER_ROLE_HEADER] = who.role
        route_id = secrets.token_hex(8)  # each try names it: the fleet's trace keeps its last (fleet_trace.py)
        routed_at = None  # when the first replica was chosen: the fleet's trace is in this order, on this clock
        hops, prefilled, weighed = 0, None, None
        # the prompt is computed at a prefill replica first (prefill_first); not a response's, which
        # may continue a conversation that only the replica that answered it keeps
        if service.disaggregated and not path.startswith("/v1/responses"):
            routed_at = time.time()
            try:
                params, prefilled, hops, weighed = await prefill_first(path, body, dict(headers), route_id,
                                                                       routed_at, unless_caller_leaves, span)
            except CallerLeft:
                return Response(status_code=499)
            if params is not None:
                body = {**body, TRANSFER_FIELD: params}
                raw = json.dumps(body).encode()
        phase = "decode" if TRANSFER_FIELD in body else "whole"
        # A replica that refuses before starting the request (429: its queue is full; 503: it is
        # stopping or loading) or cannot be connected to has not run it: the next best one is tried.
        tried, excluded, refusal, closed_retried, timed_out = [], set(), None, False, False
        traced = hops > 0  # whether a replica ran a try or turned it away (429): it keeps a trace line of it
        while True:
            try:
                replica, reason = await service.choose(body, tenant, excluded, weighed=weighed, timed_out=timed_out,
                                                       exemplar=span.exemplar)
                weighed = None  # (a retry weighs again, without the replicas that refused)
            except LookupError as exc:  # ModelNotServed too: on a retry, none left that serves its model
                if refusal is None and isinstance(exc, ModelNotServed):
                    return error(404, str(exc), "model_not_found")
                if not traced:
                    service.gave_up(routed_at or time.time())
                # every replica that could take it refused, or (NoneInTime) none left would start it in
                # time: the last refusal, as it came, saying why it went no further
                alone = isinstance(exc, (NoneInTime, KeeperUnavailable))  # nowhere else to go
                answer = refusal if refusal is not None else error(
                    503, str(exc), "keeper_unavailable" if isinstance(exc, KeeperUnavailable) else "no_replica")
                why = str(exc) if alone or refusal is None else "no replica left to try"
                if alone:
                    answer.headers[NOT_REROUTED_HEADER] = why
                span.chose(tried="; ".join(tried) or None, refused=why)
                if service.log_requests:
                    log_refused(route_id, tenant, path, answer.status_code, tried, why,
                                http.headers.get("x-request-id"))
                return answer
            routed_at = routed_at or time.time()
            headers[ROUTER_ATTEMPT_HEADER] = RouterAttempt(route_id, hops + len(tried) + 1, routed_at).header()
            span.attempt(replica.name, phase, headers)
            request = replica.client.build_request("POST", path, content=raw, headers=headers)
            sent_at = service.clock()
            try:  # a non-streamed answer's headers come only when it is whole: the caller may leave first
                upstream = await unless_caller_leaves(replica.client.send(request, stream=True), replica, sent_at)
            except CallerLeft:
                return Response(status_code=499)
            except ReplicaSilent as exc:
                return given_up(replica, exc)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached it
                service.went_unanswered(replica, described(exc))
                span.attempt_failed(f"unreachable: {replica.last_error}")
                replica.rerouted += 1
                refusal = error(502, f"replica {replica.name} failed: {replica.last_error}", "replica_failed")
                tried.append(f"{replica.name} (unreachable)")
                excluded.add(id(replica))
                continue
            except CLOSED_BEFORE_ANSWER as exc:
                # The connection ended before any byte of an answer: a pooled keep-alive connection the
                # replica closed as the request went out (a restart), or the replica went down. The
                # caller has nothing yet, so it may go elsewhere, once: a replica that was running it
                # has stopped, or cancels it on seeing the connection gone. Not a second time (a
                # request that brings replicas down would take a third).
                replica.last_error = described(exc)
                span.attempt_failed(f"closed before answering: {replica.last_error}")
                if closed_retried:
                    replica.failed_forwards += 1
                    if not traced:
                        service.gave_up(routed_at)
                    return error(502, f"replica {replica.name} failed: {replica.last_error}", "replica_failed")
                closed_retried = True
                replica.rerouted += 1
                refusal = error(502, f"replica {replica.name} failed: {replica.last_error}", "replica_failed")
                tried.append(f"{replica.name} (closed before answering)")
                excluded.add(id(replica))
                continue
            except httpx.HTTPError as exc:  # it may be running the request (a timeout): not sent twice
                replica.last_error = described(exc)
                replica.failed_forwards += 1
                span.attempt_failed(replica.last_error)
                return error(502, f"replica {replica.name} failed: {replica.last_error}", "replica_failed")
            span.answered(upstream.status_code)
            traced = traced or upstream.status_code != 503  # a 503 (stopping, loading, draining) keeps none
            if upstream.status_code not in (429, 503):
                break
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
            # but a 503 for pins (it could never fit beside them there) or for a wait past max_queue_wait
            # is a turn-away: it keeps a line
            code = refusal_code(content)
            traced = traced or code in ("pinned_out", "queue_timeout")
            timed_out = code == "queue_timeout"  # it goes on only where it would start in time (NoneInTime)
            replica.rerouted += 1
            kept = {k: v for k, v in upstream.headers.items() if k.lower() == "retry-after"}
            refusal = Response(content, status_code=upstream.status_code, headers={
                **kept, "X-KVD-Replica": replica.name, "X-KVD-Tried": "; ".join(tried + [
                    f"{replica.name} ({upstream.status_code})"])},
                media_type=upstream.headers.get("content-type", "application/json"))
            tried.append(f"{replica.name} ({upstream.status_code})")
            excluded.add(id(replica))
        replica.open += 1
        answer_headers = {"X-KVD-Replica": replica.name}
        if who.role == "admin" or replica.tells_users_cached_tokens:  # the reason may name its cached tokens
            answer_headers["X-KVD-Route"] = reason
            if prefilled is not None:  # and so may why no prefill replica computed the prompt ("local: N ...")
                answer_headers["X-KVD-Prefill"] = prefilled
        if "x-kvd-request-id" in upstream.headers:  # the replica's ids: kvctl requests / cancel there
            answer_headers["X-KVD-Request-Id"] = upstream.headers["x-kvd-request-id"]
        if "x-request-id" in upstream.headers:  # the caller's own id, echoed by the replica
            answer_headers["X-Request-Id"] = upstream.headers["x-request-id"]
        if "x-kvd-response-id" in upstream.headers:  # a response (/v1/responses): its next turn goes there
            service.response_homes.note(upstream.headers["x-kvd-response-id"], replica.name)
            answer_headers["X-KVD-Response-Id"] = upstream.headers["x-kvd-response-id"]
        if tried:
            answer_headers["X-KVD-Tried"] = "; ".join(tried)
        span.chose(replica=replica.name, route_id=route_id, route_reason=reason, tried="; ".join(tried) or None,
                   prefill=prefilled, request_id=upstream.headers.get("x-kvd-request-id"))
        if service.log_requests:
            log_route(route_id, tenant, path, replica.name, upstream, reason, tried, prefilled,
                      http.headers.get("x-request-id"))
        media = upstream.headers.get("content-type", "application/json")
        # the events view keeps a chat's replies' ids as the replica does (router_replies.py)
        watch = None
        if upstream.status_code == 200 and path == "/v1/chat/completions":
            watch = service.reply_watch(replica, tenant)
        elif upstream.status_code == 200 and path == "/v1/responses":
            watch = service.response_reply_watch(replica, tenant)

        def failed_mid_answer(exc: Exception, events: int) -> str:
            replica.failed_forwards += 1
            if isinstance(exc, ReplicaSilent):
                replica.given_up += 1
                log.warning("replica %s %s: gave up a streamed answer after %d events", replica.name, exc, events)
                span.broke_off(f"given up: {exc}")
                return f"replica {replica.name} {exc}: the router stopped waiting for the rest of this answer"
            replica.last_error = described(exc)
            log.warning("replica %s failed after %d event%s of a streamed answer: %s", replica.name, events,
                        "" if events == 1 else "s", replica.last_error)
            why = f"replica {replica.name} failed during the answer: {replica.last_error}"
            span.broke_off(why)
            return why

        async def relay():
            engine_failed = False
            try:
                chunks = watched(upstream.aiter_raw(), lambda: service.given_up_on(replica, sent_at),
                                 DISCONNECT_CHECK_S)
                async for event in relay_events(chunks, failed_mid_answer):
                    if watch is not None:
                        watch.events(event)
                    if ENGINE_ERROR_EVENT in event:  # its engine failed the request once the stream had begun
                        engine_failed = True
                        service.answered_with(replica, 500, f"a stream ended in {ENGINE_ERROR}")
                    yield event
                if not engine_failed:  # (a stream's 200 says nothing of how it ends)
                    service.answered_with(replica, upstream.status_code, f"answered {upstream.status_code}")
            finally:
                replica.open -= 1
                await upstream.aclose()

        if media.startswith("text/event-stream"):
            return StreamingResponse(relay(), status_code=upstream.status_code, media_type=media,
                                     headers=answer_headers)
        try:
            content = await unless_caller_leaves(upstream.aread(), replica, sent_at)
        except CallerLeft:
            return Response(status_code=499)
        except ReplicaSilent as exc:
            return given_up(replica, exc)
        except httpx.HTTPError as exc:  # it ended during the answer: the request ran there, so not again
            replica.last_error = described(exc)
            replica.failed_forwards += 1
            span.attempt_failed(replica.last_error)
            return error(502, f"replica {replica.name} failed during the answer: {replica.last_error}",
                         "replica_failed")
        finally:
            replica.open -= 1
            await upstream.aclose()
        service.answered_with(replica, upstream.status_code,  # (an answer's own JSON is read for a failure only)
                              answer_described(upstream) if upstream.status_code >= 500 else "")
        if watch is not None:
            watch.answer(content)
        return Response(content, status_code=upstream.status_code, media_type=media, headers=answer_headers)

    return app
