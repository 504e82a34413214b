"""The HTTP app: `create_app(service, metrics, front=...)` builds one FastAPI app per front end.

Front ends: "unix" (the socket; its file mode restricts who connects; the tenant comes
from X-KVD-Tenant, else "default"; callers act as admin) and "tcp" (every request but the
probes, /healthz, /readyz and vLLM's /health and /version, needs a bearer token, which names
tenant and role; X-KVD-Tenant is honoured only when the front end is configured as a trusted
proxy).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import anyio.to_thread
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field, StrictInt
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvctl import __version__ as kvctl_version
from kvctl.daemon.cache.events import KINDS, TIERS
from kvctl.daemon.engine.engine import AdmissionRejected
from kvctl.daemon.engine.sampling import ContextLengthExceeded, RequestError, SamplingParams

from kvctl.daemon.model.chat_template import ChatTemplateError
from kvctl.daemon.model.tokenizer import first_outside_vocab
from kvctl.daemon.store import StoreUnavailable

from . import (cache_questions, calibrate_ops, event_feed, evict_ops, inflight, invalid_request, pin_ops, prefix_ops,
               rollout_ops, tier_ops)
from .admin_bodies import (CalibrateRequest, CancelRequest, DrainRequest, EvictRequest, ExplainRequest, PinRequest,
                           RolloutAdvance, RolloutRollback, RolloutStart, SwapRequest, VerifyRequest)
from .admin_slots import AdminWriteSlots
from .auth import TENANT_PATTERN, BearerRefused, TokenTable, bearer_entry
from .body_limit import BodyLimit
from .calls import Principal, ServiceError
from .chat import (CHAT_HINTS, UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest, ChatShape, CompletionShape, Count,
                   GenerationFields)
from .chat_messages import MessagesError, chat_messages, messages_size
from .durations import parse_duration
from .logprobs import PromptParts, TokenNames, echo_texts, joined
from .metrics import Metrics
from .request_trace import ROUTER_ATTEMPT_HEADER, RouterAttempt
from .service import EngineService, LoopSink
from .strict_json import StrictJSONRoute
from .tenants import list_tenants
from .tokenize_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}
        super().__init__(message)


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _param_of(message: str) -> str | None:
    head = message.split(":", 1)[0].split("[", 1)[0]  # "logit_bias[5]: ..." is about logit_bias
    return head if head.replace("_", "").isalnum() else None


class CompletionRequest(GenerationFields):
    # token ids before lists of strings, strictly, and the first member that fits wins: in
    # pydantic's default ("smart") mode a long list of ids was also tried as strings, one error
    # object per id, 10 s for 10M ids on the event loop (now 1 s, and refused by length at once)
    prompt: Annotated[str | list[StrictInt] | list[list[StrictInt]] | list[str], Field(union_mode="left_to_right")]
    max_tokens: Count = 16
    logprobs: Count | None = None  # each output token's logprob and this many alternatives
    echo: bool | None = False  # the prompt before the output (its tokens' logprobs too, with logprobs)
    prompt_logprobs: Count | None = None  # vLLM's: each prompt token's logprob, rank and alternatives


# Completion fields of OpenAI's API (and vLLM's) that kvd does not implement, with the values
# that ask for nothing. Any other value is refused by name: ignoring it would hand back output the
# client did not ask for (an evaluation harness sending echo and logprobs would score garbage).
# Fields nobody has defined are ignored, as OpenAI-compatible servers do.
UNSUPPORTED_FIELDS = {
    "suffix": (None, ""), "best_of": (None, 1),
    "use_beam_search": (None, False), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "response_format": (None,),
    "cache_salt": (None, ""),
}
# why, where "leave it out" is not the whole answer
UNSUPPORTED_HINTS = {
    "cache_salt": "kvd keeps prefixes apart by tenant (the caller's token, or the tenant header behind a trusted "
                  "proxy), never by a salt the client picks; send requests that must not share as another tenant",
}


def refuse_unsupported(body: BaseModel, unsupported: dict, hints: dict) -> None:
    """A 400 naming the first field kvd would otherwise ignore (best_of equal to n is inert)."""
    for name, value in (body.model_extra or {}).items():
        inert = unsupported.get(name)
        if inert is None or value in inert or (name == "best_of" and value == body.n):
            continue
        shown = "a salt" if name == "cache_salt" else repr(value)  # a salt is the client's secret: never echoed
        raise ApiError(400, f"{name}: not supported by kvd, got {shown}; "
                            + hints.get(name, UNSUPPORTED_HINTS.get(name, "leave it out")), param=name,
                       code="unsupported_parameter")


# Prompts of up to this many tokens in all are hashed on the event loop when they are handed in
# (about 0.3 ms per 1,000 tokens on a CPU core); longer ones in a worker thread, so a long prompt
# does not hold up the streams the loop serves. A worker-thread hop costs 1-2 ms on a busy host.
HAND_IN_ON_LOOP_TOKENS = 4096
DISCONNECT_CHECK_S = 0.5  # how often a non-streamed request looks for its client having left
METRICS_THREADS = 2  # worker threads of /metrics' own, apart from the 40 every sync handler shares


def create_app(service: EngineService, metrics: Metrics, *, front: str = "unix",
               tokens: TokenTable | None = None, trusted_proxy: bool = False) -> FastAPI:
    if front not in ("unix", "tcp"):
        raise ValueError(f"front: unknown value {front!r}")
    if front == "tcp" and tokens is None:
        raise ValueError("front tcp needs a token table")
    app = FastAPI(title="kvd", version="0.1.0",
                  description="KV cache daemon: OpenAI-compatible completions and the kvctl admin API.")
    app.router.route_class = StrictJSONRoute  # NaN and Infinity are not JSON: refused (strict_json.py)
    app.add_middleware(BodyLimit, limit=lambda: service.config.max_request_bytes)
    app.add_middleware(AdminWriteSlots, slots=service.admin_write_slots)  # outermost: waits before its body is read

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError):
        kind = {503: "service_unavailable", 404: "not_found_error", 409: "conflict_error"}.get(
            exc.status, "invalid_request_error")
        return JSONResponse(error_body(str(exc), kind, exc.param, None), status_code=exc.status)

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(_: Request, exc: StoreUnavailable):  # a rollout, a calibration, a record
        return JSONResponse(error_body(str(exc), "service_unavailable", None, "store_unavailable"), status_code=503)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, where = invalid_request.describe(exc.errors())
        return JSONResponse(error_body(message, "invalid_request_error", where, None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind, None, None), status_code=exc.status_code)

    # The dependencies are coroutines: they do no I/O, and a plain function would be run in a
    # worker thread. On a busy host that hop held a completion back 5-7 ms before its handler.
    async def principal(request: Request) -> Principal:
        header = request.headers.get("x-kvd-tenant")
        if header is not None and not TENANT_PATTERN.match(header):
            raise ApiError(400, f"X-KVD-Tenant: invalid value {header!r}; use [A-Za-z0-9._-]{{1,64}}",
                           param="X-KVD-Tenant")
        if front == "unix":
            return Principal(header or "default", "admin", "unix-socket")
        try:
            entry = bearer_entry(tokens, request.headers.get("authorization", ""))
        except BearerRefused as exc:
            raise ApiError(401, str(exc), type_="authentication_error", headers={"WWW-Authenticate": "Bearer"})
        tenant = header if (trusted_proxy and header) else entry.tenant
        return Principal(tenant, entry.role, entry.name)

    async def admin(who: Principal = Depends(principal)) -> Principal:
        if who.role != "admin":
            raise ApiError(403, "this endpoint needs the admin role", type_="permission_error")
        return who

    # ---- health ------------------------------------------------------------------------------
    # NOTE: the probes are `async def`, answered on the event loop: a sync handler waits for a
    # worker thread, and 40 admin calls waiting for a store another process holds locked (30 s
    # each) took them all, so that /healthz timed out and a supervisor would restart a kvd that
    # was serving. They read flags only: nothing in them may wait.
    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        if service.ready.is_set() and service.accepting and not service.draining:
            return {"ready": True}
        reason = service.load_error or ("shutting down" if not service.accepting else
                                        "draining (kvctl resume takes completions again)" if service.draining
                                        else "loading the model")
        return JSONResponse({"ready": False, "reason": reason}, status_code=503)

    scrapers: list = []  # the metrics' own worker threads (an anyio CapacityLimiter, made on the first scrape)

    @app.get("/metrics")
    async def metrics_endpoint(_: Principal = Depends(principal)):
        """Collected in a worker thread (the collectors take the engine's lock, held for a step) from
        a pool of its own: with the shared one taken by admin calls waiting on a locked store, a
        scrape waited too, and the figures that say why were the ones missing."""
        if not scrapers:
            scrapers.append(anyio.CapacityLimiter(METRICS_THREADS))
        text = await anyio.to_thread.run_sync(generate_latest, metrics.registry, limiter=scrapers[0])
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)

    # ---- OpenAI-compatible -------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(_: Principal = Depends(principal)):  # flags and fields only: on the loop, as the probes
        engine = service.require_ready()
        return {"object": "list", "data": [{"id": service.model_name, "object": "model",
                                            "created": int(service.started_at), "owned_by": "kvd",
                                            "max_model_len": engine.loaded.config.max_position_embeddings}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request, who: Principal = Depends(principal)):
        refuse_unsupported(body, UNSUPPORTED_FIELDS, UNSUPPORTED_HINTS)
        engine = ready_for(body.model)
        prompts = _prompts(body.prompt, decoded=bool(body.echo))
        scored = [n for n in (body.prompt_logprobs, body.logprobs if body.echo else None) if n is not None]
        # echo with max_tokens 0 scores the prompt and generates nothing (lm-eval's loglikelihood
        # requests, as OpenAI's legacy completions and vLLM answer them): the engine samples one
        # token to get there, which the answer leaves out
        prompt_only = bool(body.echo) and body.max_tokens == 0
        if body.max_tokens == 0 and not prompt_only:
            raise ApiError(400, "max_tokens: must be an integer >= 1, got 0 (0 only with echo: the prompt is "
                                "scored and nothing generated)", param="max_tokens")
        params = sampling(body, 1 if prompt_only else body.max_tokens, "completions", body.logprobs,
                          max(scored, default=None))
        return await generate(engine, prompts, params, body, http, who, CompletionShape(),
                              echo_texts(body.prompt, prompts, engine.tokenizer) if body.echo else None,
                              prompt_only=prompt_only)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request, who: Principal = Depends(principal)):
        refuse_unsupported(body, UNSUPPORTED_CHAT_FIELDS, CHAT_HINTS)
        try:
            messages = chat_messages(body.messages)
            limit, opens_reply, logprobs = body.output_limit(), body.generation_prompt(), body.logprobs_wanted()
        except MessagesError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        engine = ready_for(body.model)
        chat = (messages, opens_reply, body.continue_final_message)
        try:  # a long conversation is rendered and tokenized off the loop that streams every answer
            ids = service.chat_prompt(*chat) if messages_size(messages) <= HAND_IN_ON_LOOP_TOKENS \
                else await run_in_threadpool(service.chat_prompt, *chat)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param=_param_of(str(exc)), code="chat_template_refused") from None
        if limit is None:  # what the context has left, as vLLM does
            positions = engine.loaded.config.max_position_embeddings
            limit = positions - len(ids)
            if limit < 1:
                raise ApiError(413, f"messages: the conversation is {len(ids)} tokens, which leaves no room for a "
                                    f"reply in the model's {positions} positions", param="messages",
                               code="context_length_exceeded")
        return await generate(engine, [ids], sampling(body, limit, "chat", logprobs, body.prompt_logprobs), body, http,
                              who, ChatShape())

    def ready_for(model: str | None):
        """The engine, once it takes completions for `model` (None: whichever is served)."""
        engine = service.require_ready()
        if service.draining:  # before it is started: a router passes it to another replica
            raise ApiError(503, "kvd is draining: it takes no new completion until `kvctl resume`",
                           type_="service_unavailable", code="draining", headers={"Retry-After": "5"})
        return served(model, engine)

    def served(model: str | None, engine):
        """`engine`, when `model` is the one served (None: whichever is); else a 404 naming it."""
        if model is not None and model != service.model_name:
            raise ApiError(404, f"model: {model!r} is not served here; GET /v1/models lists "
                                f"{service.model_name!r}", param="model", code="model_not_found")
        return engine

    # ---- vLLM's server extras: its probe, version, and token counting --------------------------
    @app.get("/health")
    async def health():
        """vLLM's liveness probe: 200 while the model is loaded (draining or not), else 503 with why."""
        if service.ready.is_set() and service.engine is not None:
            return {}
        return JSONResponse({"healthy": False, "reason": service.load_error or "loading the model"}, status_code=503)

    @app.get("/version")
    async def version():
        return {"version": kvctl_version}

    @app.post("/tokenize")
    def tokenize_endpoint(body: TokenizeRequest, _: Principal = Depends(principal)):
        """A prompt's or a chat's token ids (a chat rendered as /v1/chat/completions renders it)."""
        return with_tokenizer(tokenize, body)

    @app.post("/detokenize")
    def detokenize_endpoint(body: DetokenizeRequest, _: Principal = Depends(principal)):
        """The text of token ids."""
        return with_tokenizer(detokenize, body)

    def with_tokenizer(work, body):
        """`work(service, body)` for the model `body` names; a bad message or id is a 400 naming it."""
        served(body.model, service.require_ready())
        try:
            return work(service, body)
        except MessagesError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param=_param_of(str(exc)), code="chat_template_refused") from None

    def sampling(body, max_tokens: int, api: str, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """The request's sampling fields (checked by the engine, which names a bad one)."""
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        try:
            controls = body.sampling_controls()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="logit_bias") from None
        if body.top_k < -1:  # -1 is vLLM's "no cut", as 0 is
            raise ApiError(400, f"top_k: must be -1 or 0 (no cut) or a whole number >= 1, got {body.top_k}",
                           param="top_k")
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=max(body.top_k, 0), seed=body.seed, n=body.n, stop=stop,
                              stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, extra={"api": api}, **controls)

    async def generate(engine, prompts: list[list[int]], params: SamplingParams, body, http: Request,
                       who: Principal, shape: CompletionShape, echo_texts: list[str] | None = None,
                       prompt_only: bool = False):
        """Run `prompts` (n samples each) and answer in `shape`: streamed as server-sent events, or
        whole once every sample has finished. A client that leaves cancels them. `echo_texts`: each
        prompt's text, put before its choices' text (completions' `echo`)."""
        routed = http.headers.get(ROUTER_ATTEMPT_HEADER.lower())
        if routed is not None:  # kvd router's name for the request: its trace line carries it
            try:
                params.extra["router"] = RouterAttempt.parse(routed)
            except ValueError as exc:
                raise ApiError(400, str(exc), param=ROUTER_ATTEMPT_HEADER) from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        sink = LoopSink(loop, events)

        try:
            priority = service.queue_priority(who.tenant, body.priority)
        except ServiceError as exc:
            raise ApiError(exc.status, str(exc), param=exc.param) from None

        async def hand_in():  # queued by the engine thread before its next step, with no wait for this one
            if sum(map(len, prompts)) <= HAND_IN_ON_LOOP_TOKENS:
                return await asyncio.wrap_future(service.submit_nowait(prompts, params, who, sink, priority))
            handed = await run_in_threadpool(service.submit_nowait, prompts, params, who, sink, priority)
            return await asyncio.wrap_future(handed)

        submitting = asyncio.ensure_future(hand_in())
        try:
            requests = await asyncio.shield(submitting)
        except asyncio.CancelledError:
            # The client left while its requests were being queued: cancel them once they are.
            submitting.add_done_callback(lambda done: None if done.cancelled() or done.exception() else [
                service.cancel(r.request_id) for r in done.result()])
            raise
        except ContextLengthExceeded as exc:
            raise ApiError(413, str(exc), param="max_tokens", code="context_length_exceeded") from None
        except RequestError as exc:
            raise ApiError(400, str(exc), param=_param_of(str(exc))) from None
        except AdmissionRejected as exc:
            if exc.kind in ("queue_full", "tenant_limit"):
                raise ApiError(429, str(exc), type_="rate_limit_error", code=exc.kind,
                               headers={"Retry-After": "1"}) from None
            raise ApiError(400, str(exc), code="cache_capacity_exceeded") from None
        head = {"id": shape.id_prefix + uuid.uuid4().hex[:24], "created": int(time.time()),
                "model": service.model_name}
        # the engine's ids, which `kvctl requests` lists and `kvctl cancel` takes
        named = {"X-KVD-Request-Id": ",".join(r.request_id for r in requests)}
        n = params.n
        index_of = {(r.request_id, i): p * n + i for p, r in enumerate(requests) for i in range(n)}
        by_id = {r.request_id: r for r in requests}

        def cancel_all():
            for request in requests:
                service.cancel(request.request_id)

        names = TokenNames(engine.tokenizer.token_text, bool(body.return_tokens_as_token_ids))
        prompt_parts = PromptParts(names, params, body.prompt_logprobs, echo_texts,
                                   shape.prompt_logprobs_on, prompt_only)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(
                _stream(engine, events, requests, by_id, index_of, head, shape, include_usage, cancel_all,
                        params.logprobs is not None, prompt_parts),
                media_type="text/event-stream", headers=named)
        pending = set(index_of)
        checked = loop.time()
        try:
            while pending:
                try:
                    async with asyncio.timeout(DISCONNECT_CHECK_S):  # not wait_for: test_import_rules says why
                        event = await events.get()
                except TimeoutError:
                    event = None
                # every so often, tokens flowing or not: a client that left must not keep the model busy
                if loop.time() - checked >= DISCONNECT_CHECK_S:
                    checked = loop.time()
                    if await http.is_disconnected():
                        cancel_all()
                        return JSONResponse({}, status_code=499)
                if event is not None and event.finish_reason is not None:
                    pending.discard((event.request_id, event.index))
        except asyncio.CancelledError:
            cancel_all()
            raise
        choices = []
        for p, request in enumerate(requests):
            for seq in sorted(request.sequences, key=lambda s: s.index):
                text, logprobs = prompt_parts.text(p), None
                output_ids, output_logprobs = ([], []) if prompt_only else (list(seq.output_ids), seq.logprobs)
                if params.logprobs is not None:
                    before, offset = prompt_parts.logprobs(p, request)
                    logprobs, _ = shape.logprobs(names, output_ids, output_logprobs, offset)
                    logprobs = joined(before, logprobs) if before is not None else logprobs
                choice = shape.choice(index_of[(request.request_id, seq.index)],
                                      text + ("" if prompt_only else engine.text_of(seq)),
                                      output_ids, seq.finish_reason, logprobs)
                choices.append(prompt_parts.add_to_choice(choice, request))
        choices.sort(key=lambda c: c["index"])
        answer = {"id": head["id"], "object": shape.object, "created": head["created"], "model": head["model"],
                  "choices": choices, "usage": _usage(requests, counted=not prompt_only)}
        return JSONResponse(prompt_parts.add_to_answer(answer, requests[0]), headers=named)

    def _prompts(prompt: Any, decoded: bool) -> list[list[int]]:
        """The prompt's token ids, one list per prompt. `decoded` (echo decodes token-id prompts
        before they are submitted): their ids are checked here; else submitting checks them once."""
        if isinstance(prompt, str):
            return [service.tokenize(prompt)]
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        if all(isinstance(p, str) for p in prompt):
            return [service.tokenize(p) for p in prompt]
        flat = all(isinstance(p, int) for p in prompt)
        prompts = [list(prompt)] if flat else [list(p) for p in prompt]
        if decoded:
            engine = service.require_ready()
            for i, ids in enumerate(prompts):
                _checked_ids(ids, "prompt" if flat else f"prompt[{i}]", engine)
        return prompts

    def _checked_ids(ids: list[int], field: str, engine) -> list[int]:
        """`ids`, once each is a token id of the model (before echo decodes them or a pin warms
        them); else a 400 naming `field` and the first id outside."""
        vocab = engine.loaded.config.vocab_size
        bad = first_outside_vocab(ids, vocab)
        if bad is not None:
            raise ApiError(400, f"{field}: token ids must lie in [0, {vocab}), found {ids[bad]}", param=field)
        return ids

    # ---- admin -------------------------------------------------------------------------------
    @app.get("/admin/status")
    def status(blocks: bool = Query(False), cells: int | None = Query(None, ge=1), _: Principal = Depends(admin)):
        """kvd's state; `blocks`: the block map too, a character per block, or per cell of
        consecutive blocks (their most common state) when `cells` caps how many."""
        return service.status(with_blocks=blocks, cells=cells)

    @app.get("/admin/prefixes")
    def prefixes(tenant: str | None = None, pinned: bool = False, sort: str = "recent", limit: int = 0,
                 under: str | None = None, _: Principal = Depends(admin)):
        rows, total = prefix_ops.prefixes(service, tenant, pinned, sort, limit, under)
        return {"prefixes": rows, "total": total, "sort": sort}

    @app.get("/admin/events")
    async def events(since: int = 0, limit: int = 1000, kind: str | None = None, tier: str | None = None,
                     wait: float = 0.0, tail: int | None = None, key: str | None = None,
                     _: Principal = Depends(admin)):
        """The cache's events after `since` (blocks stored in and removed from each tier, with why);
        with `wait`, held open up to that many seconds until there is one. `tail`: the newest
        that many instead. `key`: only events naming a block whose key starts with these hex digits."""
        event_feed.check_page(since, limit, wait, tail)
        kinds = event_feed.parse_filter(kind, KINDS, "kind")
        tiers = event_feed.parse_filter(tier, TIERS, "tier")
        prefix = event_feed.parse_key(key)
        log = service.require_ready().events
        if tail is not None:
            return event_feed.read_tail(log, tail, kinds, tiers, prefix)
        return await event_feed.wait_for_events(log, since, limit, kinds, tiers, wait, prefix)

    @app.get("/admin/events/snapshot")
    def events_snapshot(_: Principal = Depends(admin)):
        return event_feed.snapshot(service)

    @app.get("/admin/tokenizer")
    def tokenizer(_: Principal = Depends(admin)):
        """The model's tokenizer files as text, with the digest the cache keys' namespace records,
        and the chat template (text and digest; null when there is none): a router that computes
        prompts' keys itself (`kvd router --view events`) loads them from here."""
        tok = service.require_ready().tokenizer
        tokenizer_json, config_json = tok.texts
        template = service.chat_template
        return {"digest": tok.digest, "tokenizer_json": tokenizer_json, "tokenizer_config_json": config_json,
                "chat_template": None if template is None else template.text,
                "chat_template_digest": service.chat_template_digest}

    @app.get("/admin/pins")
    def pins(keys: bool = False, _: Principal = Depends(admin)):
        """Every pin; `keys`: with its block keys and the block space they belong to, for a copy on
        another replica (`kvd router`'s sync-pins)."""
        if not keys:
            return {"pins": pin_ops.list_pins(service)}
        return {"pins": pin_ops.list_pins(service, with_keys=True), "space": service.block_space()}

    @app.post("/admin/pins")
    def pin(body: PinRequest, who: Principal = Depends(admin)):
        if sum(x is not None for x in (body.text, body.tokens, body.messages, body.prefix, body.keys)) > 1:
            raise ApiError(400, "give exactly one of text, tokens, messages, prefix and keys", param="prefix")
        if body.keys is not None and body.tenant is None:
            raise ApiError(400, "tenant: a pin by keys names its tenant (the keys were made under it)", param="tenant")
        try:
            ttl = parse_duration(body.ttl)
        except ValueError:
            raise ApiError(400, f"ttl: must be a finite number of seconds > 0 (or 30m, 1h, 2d), got {body.ttl!r}",
                           param="ttl") from None
        if body.prefix is not None:
            return pin_ops.pin_prefix(service, body.prefix, who, body.tenant, ttl, body.note)
        if body.keys is not None:
            return pin_ops.pin_copy(service, [bytes.fromhex(k) for k in body.keys], body.tenant, who, ttl, body.note,
                                    body.owner)
        token_ids = _tokens_of(body, opens_reply=False)
        target = Principal(body.tenant or who.tenant, who.role, who.actor)
        return pin_ops.pin(service, token_ids, target, ttl, body.note)

    @app.delete("/admin/pins/{pin_id}")
    def unpin(pin_id: str, who: Principal = Depends(admin)):
        return pin_ops.unpin(service, pin_id, who)

    @app.post("/admin/evict")
    def evict(body: EvictRequest, who: Principal = Depends(admin)):
        return evict_ops.evict(service, prefix_id=body.prefix, tenant=body.tenant, model_revision=body.model_revision,
                               all_unpinned=body.all_unpinned, principal=who, purge_once=body.purge_once)

    @app.post("/admin/explain")
    def explain(body: ExplainRequest, who: Principal = Depends(admin)):
        return cache_questions.explain(service, _tokens_of(body), body.tenant or who.tenant)

    @app.get("/admin/tenants")
    def tenants(_: Principal = Depends(admin)):
        """Each tenant's prompt and hit tokens, requests in flight, cached blocks, share and pins
        (counts only)."""
        return list_tenants(service)

    @app.get("/admin/requests")
    def requests_in_flight(tenant: str | None = None, _: Principal = Depends(admin)):
        """Every request in flight, oldest first: who, which API, where it stands, for how long,
        what the cache gave it and the blocks it holds (never its tokens or text)."""
        return inflight.list_requests(service, tenant)

    @app.get("/admin/trace")
    def request_trace(last: int | None = Query(None, ge=1), ids: Literal["numbered", "keyed"] = "numbered",
                      _: Principal = Depends(admin)):
        """The last finished requests (`last` of them, else every one kept) as a Mooncake trace:
        arrivals, prompt and output lengths, tenants, and chained ids of 512-token prompt blocks
        (HMACs under a key kvd never shows, numbered from 0); never tokens or text. `ids=keyed`:
        the ids as keyed and Unix arrivals, for kvd router to merge replicas' traces."""
        return service.trace_report(last, keyed=ids == "keyed")

    @app.post("/admin/cancel")
    def cancel(body: CancelRequest, who: Principal = Depends(admin)):
        """Cancel requests in flight by id (the X-KVD-Request-Id of their answers), or all of a
        tenant's: as if their clients had left. Audited."""
        return inflight.cancel_requests(service, who, body.request_ids, body.tenant)

    @app.post("/admin/drain")
    def drain(body: DrainRequest, who: Principal = Depends(admin)):
        return service.drain(body.drain, who)

    @app.post("/admin/route-facts")
    def route_facts(body: ExplainRequest, who: Principal = Depends(admin)):
        """What a router weighs for this prompt, in one call: how much of it the device cache
        holds, and how busy this replica is (its predicted wait, running and waiting requests).
        `tenant_header`: whether this front serves a request under the X-KVD-Tenant it names (else
        under the caller's token's tenant, `tenant` here when the body names none)."""
        facts = cache_questions.route_facts(service, _tokens_of(body), body.tenant or who.tenant)
        return {**facts, "tenant_header": front == "unix" or trusted_proxy}

    @app.post("/admin/rollouts")
    def rollout_start(body: RolloutStart, who: Principal = Depends(admin)):
        if body.baseline != "current":
            raise ApiError(400, f"baseline: only 'current' is supported, got {body.baseline!r}", param="baseline")
        return rollout_ops.start_rollout(service, body.policy, body.cohort, body.stops, body.adr, who.actor)

    @app.get("/admin/rollouts")
    def rollout_latest(_: Principal = Depends(admin)):
        return rollout_ops.rollout_status(service)

    @app.get("/admin/rollouts/history")
    def rollout_history(limit: int = Query(50, ge=1, le=10_000), _: Principal = Depends(admin)):
        return {"rollouts": service.rollouts.history(limit)}

    @app.get("/admin/rollouts/{rollout_id}")
    def rollout_status(rollout_id: int, _: Principal = Depends(admin)):
        return rollout_ops.rollout_status(service, rollout_id)

    @app.post("/admin/rollouts/{rollout_id}/advance")
    def rollout_advance(rollout_id: int, body: RolloutAdvance, who: Principal = Depends(admin)):
        return service.rollouts.advance(rollout_id, body.to, who.actor)

    @app.post("/admin/rollouts/{rollout_id}/pause")
    def rollout_pause(rollout_id: int, who: Principal = Depends(admin)):
        return service.rollouts.pause(rollout_id, who.actor)

    @app.post("/admin/rollouts/{rollout_id}/resume")
    def rollout_resume(rollout_id: int, who: Principal = Depends(admin)):
        return service.rollouts.resume(rollout_id, who.actor)

    @app.post("/admin/rollouts/{rollout_id}/rollback")
    def rollout_rollback(rollout_id: int, body: RolloutRollback, who: Principal = Depends(admin)):
        return service.rollouts.rollback(rollout_id, body.reason, who.actor)

    @app.post("/admin/rollouts/{rollout_id}/complete")
    def rollout_complete(rollout_id: int, who: Principal = Depends(admin)):
        return rollout_ops.complete_rollout(service, rollout_id, who)

    @app.post("/admin/calibrate")
    def calibrate(body: CalibrateRequest, who: Principal = Depends(admin)):
        service.require_ready()
        prompts = None if body.prompts is None else [
            service.tokenize(p) if isinstance(p, str) else list(p) for p in body.prompts]
        return calibrate_ops.calibrate(service, dtype=body.dtype, prompts=prompts, greedy_tokens=body.max_tokens,
                                       max_kl=body.max_kl, margin=body.margin, slices=body.slices,
                                       if_older_than=body.if_older_than, apply=body.apply, principal=who)

    @app.get("/admin/tiers")
    def tiers(_: Principal = Depends(admin)):
        return tier_ops.report(service)

    @app.post("/admin/tiers/verify")
    def verify_tiers(body: VerifyRequest, who: Principal = Depends(admin)):
        """Read the disk tier through and verify every block, in the background (tier_verify.py)."""
        return tier_ops.start_verify(service, body.rate, who, unpaced=body.unpaced)

    @app.delete("/admin/tiers/verify")
    def stop_verifying_tiers(who: Principal = Depends(admin)):
        return tier_ops.stop_verify(service, who)

    @app.post("/admin/swap")
    async def swap(body: SwapRequest, who: Principal = Depends(admin)):
        return await run_in_threadpool(tier_ops.swap, service, body.prefix, body.to, body.keep_source, who)

    @app.get("/admin/config")
    def config(_: Principal = Depends(admin)):
        return {"config": service.config.shown(), "effective": service.effective_settings(),
                "from_rollouts": service.rollout_settings,
                "sources": {name: service.config.sources.get(name, "default") for name in service.config.describe()},
                "precedence": "flag > KVD_* env > YAML file > default",
                # where kvctl's store commands (adr, db, runs) find this daemon's records
                "store_path": str(Path(service.store.path).resolve())}

    @app.post("/admin/reload")
    def reload(who: Principal = Depends(admin)):
        return service.reload_from_source(who.actor)

    @app.get("/admin/audit")
    def audit(since: float = 0.0, action: str | None = None, _: Principal = Depends(admin)):
        return {"entries": service.store.audit_since(since, action=action)}

    def _tokens_of(body: ExplainRequest | PinRequest, opens_reply: bool = True) -> list[int]:
        """The prompt an admin request names: its text, its token ids, or its chat messages rendered
        by the chat template (`opens_reply`: ending with the assistant's turn opening, as a chat
        request's prompt does)."""
        text, token_ids, messages = body.text, body.tokens, body.messages
        if sum(x is not None for x in (text, token_ids, messages)) != 1:
            raise ApiError(400, "give exactly one of text, tokens and messages", param="text")
        engine = service.require_ready()
        if text is not None:
            return service.tokenize(text)
        if messages is not None:
            try:
                return service.chat_prompt(chat_messages(messages), add_generation_prompt=opens_reply)
            except MessagesError as exc:
                raise ApiError(400, str(exc), param=exc.param) from None
            except ChatTemplateError as exc:
                raise ApiError(400, str(exc), param="messages", code="chat_template_refused") from None
        return _checked_ids(list(token_ids), "tokens", engine)

    return app


def _usage(requests, counted: bool = True) -> dict:
    """`counted`: False where the answer shows no output token (echo with max_tokens 0)."""
    prompt = sum(len(r.prompt_ids) for r in requests)
    completion = sum(len(s.output_ids) for r in requests for s in r.sequences) if counted else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.metrics.cached_tokens for r in requests)}}


class IncrementalText:
    """Text of a growing token sequence, decoding only a short window per token (not the whole
    output each time): the tokens since the last emitted text, with the ones before them as
    context, so tokenizers that space words by their neighbours decode as they would in full."""

    __slots__ = ("decode", "ids", "prefix", "read")

    def __init__(self, decode) -> None:
        self.decode, self.ids, self.prefix, self.read = decode, [], 0, 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


async def _stream(engine, events, requests, by_id, index_of, head: dict, shape, include_usage, cancel_all,
                  with_logprobs: bool, prompt_parts: PromptParts):
    """Server-sent events ending with [DONE]; a disconnect cancels.

    A chunk carries one choice's new tokens: one token per chunk while the client keeps up,
    and every token that waited in the queue once it falls behind (one chunk instead of many,
    so a slow reader costs the serving loop less, not more)."""
    sent_text = {key: "" for key in index_of}
    offsets = dict.fromkeys(index_of, 0)  # where each choice's next token starts in its text (logprobs)
    prompt_of = {r.request_id: p for p, r in enumerate(requests)}
    opened: set = set()  # choices whose first chunk went out (it carries what comes from the prompt)
    texts = {key: IncrementalText(engine.tokenizer.decode) for key in index_of}
    pending = set(index_of)
    finished_cleanly = False
    try:
        while pending:
            ready = [await events.get()]
            while not events.empty():
                ready.append(events.get_nowait())
            merged: dict = {}  # key -> [token ids, text, finish reason, logprobs], in arrival order
            for event in ready:
                key = (event.request_id, event.index)
                entry = merged.setdefault(key, [[], "", None, []])
                request = by_id[event.request_id]
                seq = next((s for s in request.sequences if s.index == event.index), None)
                delta = ""
                if event.finish_reason is not None and seq is not None:
                    text = engine.text_of(seq)  # whole, once: a stop string may cut it
                    delta = text[len(sent_text[key]):] if text.startswith(sent_text[key]) else ""
                    sent_text[key] = text
                elif event.token_id is not None:
                    delta = texts[key].add(event.token_id)
                    sent_text[key] += delta
                if prompt_parts.prompt_only:
                    delta = ""  # the prompt alone is the answer (echo, max_tokens 0)
                elif event.token_id is not None:
                    entry[0].append(event.token_id)
                    if event.logprob is not None:
                        entry[3].append(event.logprob)
                entry[1] += delta
                if event.finish_reason is not None:
                    entry[2] = event.finish_reason
                    pending.discard(key)
            for key, (token_ids, delta, finish_reason, entries) in merged.items():
                first = key not in opened
                opened.add(key)
                p, request = prompt_of[key[0]], by_id[key[0]]
                before = None
                if first:
                    delta = prompt_parts.text(p) + delta
                    if with_logprobs:
                        before, offsets[key] = prompt_parts.logprobs(p, request)
                logprobs = None
                if with_logprobs:
                    logprobs, offsets[key] = shape.logprobs(prompt_parts.names, token_ids, entries,
                                                            offsets[key])
                    logprobs = joined(before, logprobs) if before is not None else logprobs
                choice = shape.chunk_choice(index_of[key], delta, token_ids, finish_reason, logprobs)
                chunk = {"id": head["id"], "object": shape.chunk_object, "created": head["created"],
                         "model": head["model"], "choices": [choice]}
                if first:
                    prompt_parts.add_to_choice(choice, request)
                    prompt_parts.add_to_answer(chunk, request, once=True)
                yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage:
            usage_chunk = {"id": head["id"], "object": shape.chunk_object, "created": head["created"],
                           "model": head["model"], "choices": [],
                           "usage": _usage(requests, counted=not prompt_parts.prompt_only)}
            yield f"data: {json.dumps(usage_chunk)}\n\n"
        yield "data: [DONE]\n\n"
        finished_cleanly = True
    finally:
        if not finished_cleanly:
            cancel_all()
