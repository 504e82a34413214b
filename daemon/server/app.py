"""The HTTP app: `create_app(service, metrics, front=...)` builds one FastAPI app per front end.

Front ends: "unix" (the socket; its file mode restricts who connects; the tenant comes
from X-KVD-Tenant, else "default"; callers act as admin) and "tcp" (every request but the
probes, /healthz, /readyz and vLLM's /health and /version, needs a bearer token, which names
tenant and role; X-KVD-Tenant is honoured only when the front end is configured as a trusted
proxy).

This module holds the OpenAI-compatible API, the probes and /metrics; the admin API that kvctl
drives is admin_routes.py, mounted on each front behind its `admin` dependency.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import secrets
import time
import uuid
from functools import partial
from typing import Annotated, Any

import anyio
import anyio.to_thread
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.exposition import choose_encoder
from pydantic import Field, StrictInt
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvctl import __version__ as kvctl_version
from kvctl.daemon.config import retention_for
from kvctl.daemon.engine.engine import AdmissionRejected
from kvctl.daemon.engine.sampling import CACHE_PRIVATE, ContextLengthExceeded, RequestError, SamplingParams
from kvctl.daemon.model.chat_template import ChatTemplateError
from kvctl.daemon.store import StoreUnavailable

from . import cache_breakpoints, device_loss, invalid_request, kv_transfer, serve_again, service_tiers
from .admin_routes import admin_routes
from .admin_slots import AdminWriteSlots
from .api_errors import ApiError, checked_ids, error_body, model_served, refuse_unsupported
from .auth import TENANT_PATTERN, BearerRefused, TokenTable, bearer_entry
from .body_limit import BodyLimit
from .calls import Principal, ServiceError
from .chat import (CHAT_HINTS, UNSUPPORTED_CHAT_FIELDS, VLLM_NOT_DONE, ChatCompletionRequest, ChatShape,
                   CompletionShape, Count, GenerationFields)
from .chat_messages import MessagesError, chat_messages, checked_tools, messages_size
from .engine_liveness import one_scrape
from .incremental_text import IncrementalText
from .logprobs import PromptParts, TokenNames, echo_texts, joined
from .metrics import Metrics
from .reasoning import answer_only
from .reply_ids import KEPT_ENDINGS
from .request_spans import trace_context
from .request_trace import ROUTER_ATTEMPT_HEADER, RouterAttempt
from .response_format import asks_for_a_shape, constraint_of
from .batch_routes import batch_routes
from .webhook_routes import webhook_routes
from .conversations_routes import conversations_routes
from .responses_routes import responses_routes
from .service import EngineService, LoopSink
from .step_failures import ENGINE_ERROR
from .strict_json import StrictJSONRoute
from .tokenize_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from .tool_calls import forced_calls, tool_choice_mode
from .usage_report import CALLER_ROLE_HEADER, shows_cached_tokens, usage

CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # X-Request-Id, as gateways and load balancers set it


def echoed_id(http: Request) -> dict:
    """The answer's X-Request-Id header: the caller's own, where it sent a well-formed one."""
    client_id = http.headers.get("x-request-id")
    return {"X-Request-Id": client_id} if client_id is not None and CLIENT_REQUEST_ID.fullmatch(client_id) else {}


def _param_of(message: str) -> str | None:
    head = message.split(":", 1)[0].split("[", 1)[0]  # "logit_bias[5]: ..." is about logit_bias
    return head if head.replace("_", "").replace(".", "").isalnum() else None


def _request_refused(exc: RequestError) -> ApiError:
    """The API's answer to a prompt or its parameters refused: 413 for one over the context, 400
    naming the field for the rest."""
    if isinstance(exc, ContextLengthExceeded):
        return ApiError(413, str(exc), param="max_tokens", code="context_length_exceeded")
    return ApiError(400, str(exc), param=_param_of(str(exc)))


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
    "use_beam_search": (None, False), "cache_salt": (None, ""), "add_special_tokens": (None, True), **VLLM_NOT_DONE,
}
SPECIALS_LEFT_OUT = "kvd's replies leave special tokens out of their text; each choice's token_ids has them"
# why, where "leave it out" is not the whole answer
UNSUPPORTED_HINTS = {
    "skip_special_tokens": SPECIALS_LEFT_OUT, "spaces_between_special_tokens": SPECIALS_LEFT_OUT,
    "truncate_prompt_tokens": "kvd never cuts a prompt short on its own (a cached prefix would be lost to the cut); "
                              "send it shorter, or send a conversation to /v1/responses with truncation auto",
    "bad_words": "for words of one token each, logit_bias -100 bans them; allowed_token_ids keeps to a set",
    "add_special_tokens": "a completion's prompt is tokenized with the tokenizer's special tokens (BOS), a chat's "
                          "as its template writes them; send token ids for any other",
    "cache_salt": "kvd keeps prefixes apart by tenant (the caller's token, or the tenant header behind a trusted "
                  "proxy), never by a salt the client picks; send requests that must not share as another tenant",
}


# OpenAI's prompt_cache_retention: "24h" writes a request's blocks to the persistent tiers (Engine._retain)
RETENTIONS = (None, "in_memory", "in-memory", "24h")
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
    app.add_middleware(BodyLimit, limit=lambda: service.config.max_request_bytes,
                       file_limit=lambda: service.config.max_file_bytes)
    app.add_middleware(AdminWriteSlots, slots=service.admin_write_slots)  # outermost: waits before its body is read

    # error answers echo a gateway's X-Request-Id as answers do (a malformed one is not echoed: it is the error)
    @app.exception_handler(ApiError)
    async def _api_error(http: Request, exc: ApiError):
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                            headers={**(exc.headers or {}), **echoed_id(http)})

    @app.exception_handler(ServiceError)
    async def _service_error(http: Request, exc: ServiceError):
        kind = {503: "service_unavailable", 404: "not_found_error", 409: "conflict_error"}.get(
            exc.status, "invalid_request_error")
        retry = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else {}
        return JSONResponse(error_body(str(exc), kind, exc.param, exc.code), status_code=exc.status,
                            headers={**retry, **echoed_id(http)})

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(http: Request, exc: StoreUnavailable):  # a rollout, a calibration, a record
        return JSONResponse(error_body(str(exc), "service_unavailable", None, "store_unavailable"), status_code=503,
                            headers=echoed_id(http))

    @app.exception_handler(RequestValidationError)
    async def _validation(http: Request, exc: RequestValidationError):
        message, where = invalid_request.describe(exc.errors())
        return JSONResponse(error_body(message, "invalid_request_error", where, None), status_code=400,
                            headers=echoed_id(http))

    @app.exception_handler(StarletteHTTPException)
    async def _http(http: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind, None, None), status_code=exc.status_code,
                            headers=echoed_id(http))

    # The dependencies are coroutines: they do no I/O, and a plain function would be run in a
    # worker thread. On a busy host that hop held a completion back 5-7 ms before its handler.
    async def principal(request: Request) -> Principal:
        given = request.scope.get(serve_again.PRINCIPAL)
        if given is not None:  # kvd's own call, in process (serve_again.py): no client sets a scope's keys
            return given
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
        # the tenant a front end names: any caller's with trusted_proxy, else only a proxy token's
        tenant = header if header and (trusted_proxy or entry.role == "proxy") else entry.tenant
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
        if service.device_lost:  # (a liveness probe restarts it, where no service manager does)
            return JSONResponse({"status": "device_lost", "reason": device_loss.refusal(service.device_lost)},
                                status_code=503)
        stalled = service.engine_loop.stalled()  # (a Kubernetes liveness probe restarts it, as systemd's watchdog)
        if stalled is not None:
            return JSONResponse({"status": "engine_stalled", "reason": stalled}, status_code=503)
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        reason = service.not_ready()
        if reason is None:
            return {"ready": True}
        return JSONResponse({"ready": False, "reason": reason}, status_code=503)

    scrapers: list = []  # the metrics' own worker threads (an anyio CapacityLimiter, made on the first scrape)

    @app.get("/metrics")
    async def metrics_endpoint(http: Request, _: Principal = Depends(principal)):
        """Collected in a worker thread (the collectors take the engine's lock, held for a step) from
        a pool of its own: with the shared one taken by admin calls waiting on a locked store, a
        scrape waited too, and the figures that say why were the ones missing."""
        if not scrapers:
            scrapers.append(anyio.CapacityLimiter(METRICS_THREADS))
        encoder, media = choose_encoder(http.headers.get("accept", ""))  # OpenMetrics: with exemplars

        def scrape() -> bytes:
            with one_scrape():  # the collectors' waits for the engine's lock: 5 s in all (engine_liveness.py)
                return encoder(metrics.registry)

        text = await anyio.to_thread.run_sync(scrape, limiter=scrapers[0])
        return Response(text, media_type=media)

    # ---- OpenAI-compatible -------------------------------------------------------------------
    def served_models() -> list[dict]:
        """The model served, then each LoRA adapter under its own name, its parent the model (as vLLM
        lists them). Flags and fields only: on the loop, as the probes."""
        engine = service.require_ready()
        base = {"id": service.model_name, "object": "model", "created": int(service.started_at), "owned_by": "kvd",
                "root": service.model_name, "parent": None, "max_model_len": engine.context_limit}
        return [base] + [{**base, "id": name, "root": name, "parent": service.model_name}
                         for name in service.adapters()]

    @app.get("/v1/models")
    async def models(_: Principal = Depends(principal)):
        return {"object": "list", "data": served_models()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, _: Principal = Depends(principal)):
        """One of them (`client.models.retrieve`): a 404 naming what is served where it is not."""
        served(model_id, service.require_ready())
        return next(listed for listed in served_models() if listed["id"] == model_id)

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
                          max(scored, default=None), await shape_of(body), who.tenant)
        return await generate(engine, prompts, params, body, http, who, CompletionShape(),
                              echo_texts(body.prompt, prompts, engine.tokenizer) if body.echo else None,
                              prompt_only=prompt_only)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request, who: Principal = Depends(principal)):
        return await serve_chat(body, http, who)

    async def serve_chat(body: ChatCompletionRequest, http: Request, who: Principal, api: str = "chat"):
        """A chat request answered; `api`: the API it came through, as metrics and `kvctl requests` name
        it (responses_routes.py serves /v1/responses through here)."""
        refuse_unsupported(body, UNSUPPORTED_CHAT_FIELDS, {**UNSUPPORTED_HINTS, **CHAT_HINTS})
        constraint = await shape_of(body)
        try:
            messages, tools = chat_messages(body.messages), checked_tools(body.tools)
            parser = service.config.tool_call_parser
            tool_mode, tool_name = tool_choice_mode(body.tool_choice, tools, parser)
            limit, opens_reply, logprobs = body.output_limit(), body.generation_prompt(), body.logprobs_wanted()
            predicted = body.prediction_text()  # (checked whatever predicted_outputs says)
            if service.config.predicted_outputs == "ignore":  # the operator's: served as a chat without one
                predicted = None
            template = service.chat_template
            kwargs = body.template_kwargs(template.request_kwargs if template is not None else frozenset())
            if tool_mode in ("required", "named"):  # the reply is held to calls
                if constraint is not None:
                    raise MessagesError(f"tool_choice: a forced call and {constraint.field} cannot both shape the "
                                        "reply; give one", "tool_choice")
                loaded = service.loaded  # the markers that are special tokens of its tokenizer, by id
                constraint = forced_calls(tools, parser, tool_name, body.parallel_tool_calls is not False,
                                          loaded.tokenizer.kept_specials if loaded is not None else None)
            constraint = answer_only(constraint, service.config.reasoning_parser)
            marked = cache_breakpoints.marks(body.messages, body.prompt_cache_options)
        except MessagesError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        engine = ready_for(body.model)
        # a chat's replies go in as the ids the model made (reply_ids.py), but not across a KV transfer
        splicing = None if kv_transfer.wanted(body) else who.tenant
        chat = partial(service.chat_prompt, messages, opens_reply, body.continue_final_message,
                       kwargs, tools, tenant=splicing, count=True)
        try:  # a long conversation is rendered and tokenized off the loop that streams every answer
            ids = chat() if messages_size(messages, tools) <= HAND_IN_ON_LOOP_TOKENS else await run_in_threadpool(chat)
        except MessagesError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param=_param_of(str(exc)), code="chat_template_refused") from None
        if limit is None:  # what the context has left, as vLLM does
            limit = engine.context_limit - len(ids)
            if limit < 1:
                raise ApiError(413, f"messages: the conversation is {len(ids)} tokens, which leaves no room for a "
                                    f"reply in {engine.context_limit_text()}", param="messages",
                               code="context_length_exceeded")
        shape = chat_shape(body, tool_mode)
        params = sampling(body, limit, api, logprobs, body.prompt_logprobs, constraint, who.tenant)
        if marked and service.config.prompt_cache_breakpoints == "honour":
            params.extra["breakpoints"] = await run_in_threadpool(cache_breakpoints.rendered_lengths, service,
                                                                  body.messages, marked, ids, kwargs, tools, splicing)
        if predicted:  # its tokens, as the model would write them (no special token a prompt starts with)
            prediction = await run_in_threadpool(engine.tokenizer.encode, predicted, False)
            params = dataclasses.replace(params, prediction=tuple(prediction))
        return await generate(engine, [ids], params, body, http, who, shape)

    def chat_shape(body: ChatCompletionRequest, tool_mode: str | None = None) -> ChatShape:
        """A chat answer's shape: kvd's reasoning parser, and its tool-call parser unless the
        request's tool_choice is "none" (`tool_mode`; None: read from the request, which the chat
        has already checked)."""
        parser = service.config.tool_call_parser
        if tool_mode is None:
            tool_mode, _ = tool_choice_mode(body.tool_choice, checked_tools(body.tools), parser)
        return ChatShape(service.config.reasoning_parser, "none" if tool_mode == "none" else parser,
                         parallel_tool_calls=body.parallel_tool_calls is not False)

    def ready_for(model: str | None):
        """The engine, once it takes completions for `model` (None: whichever is served)."""
        engine = service.require_ready()
        if service.draining:  # before it is started: a router passes it to another replica
            service.count_refused("draining")
            raise ApiError(503, "kvd is draining: it takes no new completion until `kvctl resume`",
                           type_="service_unavailable", code="draining", headers={"Retry-After": "5"})
        asleep = service.asleep
        if asleep is not None:  # (sleep_ops.py) a router passes it to another replica too
            service.count_refused("asleep")
            raise ApiError(503, asleep.refusal(), type_="service_unavailable", code="asleep",
                           headers={"Retry-After": "5"})
        return served(model, engine)

    def served(model: str | None, engine):
        """`engine`, when `model` is the one served or one of its LoRA adapters (None: the model);
        else a 404 naming it."""
        model_served(service, model)
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
    def tokenize_endpoint(body: TokenizeRequest, who: Principal = Depends(principal)):
        """A prompt's or a chat's token ids (a chat rendered as /v1/chat/completions renders it for the
        caller's tenant)."""
        return with_tokenizer(partial(tokenize, tenant=who.tenant), body)

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

    async def shape_of(body):
        """The reply's shape the request asks for (response_format.py), or a 400 naming the field;
        built in a worker thread (a GBNF grammar is converted in Python, up to 0.1 s for the longest
        kvd takes), never on the event loop that streams every answer."""
        if not asks_for_a_shape(body):
            return None
        try:
            return await run_in_threadpool(constraint_of, body)
        except MessagesError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None

    def sampling(body, max_tokens: int, api: str, logprobs: int | None, prompt_logprobs: int | None,
                 constraint=None, tenant: str | None = None) -> SamplingParams:
        """The request's sampling fields (checked by the engine, which names a bad one), and the
        shape the reply is held to (`constraint`, checked by the engine too); `tenant`'s own
        prompt_cache_retention setting decides whether its "24h" is kept so."""
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if body.allowed_token_ids == []:  # (None: any token)
            raise ApiError(400, "allowed_token_ids: must name one token or more, got []", param="allowed_token_ids")
        try:
            controls = body.sampling_controls()
        except ValueError as exc:
            raise ApiError(400, str(exc), param="logit_bias") from None
        if body.top_k < -1:  # -1 is vLLM's "no cut", as 0 is
            raise ApiError(400, f"top_k: must be -1 or 0 (no cut) or a whole number >= 1, got {body.top_k}",
                           param="top_k")
        retention = body.prompt_cache_retention
        if retention not in RETENTIONS:
            raise ApiError(400, f"prompt_cache_retention: must be in_memory or 24h, got {retention!r}",
                           param="prompt_cache_retention")
        # (ignore, kvd's or the tenant's own: "24h" is served as "in_memory")
        retains = retention == "24h" and retention_for(service.config, tenant) == "honour"
        chosen = {"temperature": body.temperature, "top_p": body.top_p, "top_k": max(body.top_k, 0),
                  "min_p": controls.pop("min_p"), "repetition_penalty": controls.pop("repetition_penalty")}
        for name, default in service.sampling_defaults.items():  # the checkpoint's, for a field left out
            if name not in body.model_fields_set or getattr(body, name) is None:
                chosen[name] = default
        return SamplingParams(max_tokens=max_tokens, seed=body.seed, n=body.n, stop=stop, **chosen,
                              stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, constraint=constraint,
                              extra={"api": api, **({"retain": True} if retains else {})},
                              **controls)

    async def generate(engine, prompts: list[list[int]], params: SamplingParams, body, http: Request,
                       who: Principal, shape: CompletionShape, echo_texts: list[str] | None = None,
                       prompt_only: bool = False):
        """Run `prompts` (n samples each) and answer in `shape`: streamed as server-sent events, or
        whole once every sample has finished. A client that leaves cancels them. `echo_texts`: each
        prompt's text, put before its choices' text (completions' `echo`)."""
        client_id = http.headers.get("x-request-id")  # a gateway's id for the request: logged, traced, echoed
        if client_id is not None:
            if not CLIENT_REQUEST_ID.fullmatch(client_id):
                raise ApiError(400, f"X-Request-Id: must be 1 to 128 visible ASCII characters, got {client_id[:140]!r}",
                               param="X-Request-Id")
            params.extra["client_request_id"] = client_id
        if service.request_spans is not None:  # the caller's span is its span's parent (request_spans.py)
            carried = trace_context(http.headers)
            if carried is not None:
                params.extra["trace_context"] = carried
        routed = http.headers.get(ROUTER_ATTEMPT_HEADER.lower())
        if routed is not None:  # kvd router's name for the request: its trace line carries it
            try:
                params.extra["router"] = RouterAttempt.parse(routed)
            except ValueError as exc:
                raise ApiError(400, str(exc), param=ROUTER_ATTEMPT_HEADER) from None
        # explicit prompt cache mode: cached up to its marks alone (not across a KV transfer: the decode kvd
        # must find the blocks the prefill wrote)
        private = cache_breakpoints.private_start(getattr(body, "prompt_cache_options", None), who.tenant,
                                                  service.config, params.extra.get("breakpoints", []),
                                                  engine.settings.block_size)
        if private is not None and not kv_transfer.wanted(body):
            params.extra[CACHE_PRIVATE] = (private[1], secrets.token_bytes(16))
            service.explicit_requests[private[0]] += 1
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        sink = LoopSink(loop, events)

        try:
            tier = service_tiers.checked_tier(body.service_tier)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="service_tier") from None
        served = None if tier is None else service_tiers.served_tier(tier, service.config.queue_order)
        deferred = (body.priority or 0) + service_tiers.deferral(served)  # (flex: behind those that do not defer)
        try:  # (the request's own priority checked alone: flex does not make a jump ahead a deferral)
            priority = service.queue_priority(who.tenant, body.priority) - service_tiers.deferral(served)
        except ServiceError as exc:
            raise ApiError(exc.status, str(exc), param=exc.param) from None
        if deferred:  # its own deferral, for the trace (kvctl bench replay's priority queue)
            params.extra["priority"] = deferred
        adapter = service.adapter_named(body.model)  # a LoRA adapter's name, or "" for the model itself
        # a KV transfer with another kvd (kv_transfer.py): a decode's prompt comes up from Redis first
        transfer = kv_transfer.asked(body, who.role, bool(body.stream), service)
        transferred = None
        # a transfer's prompts are hashed once, for the fetch or the publish and the submission alike
        hashed = None
        if transfer:  # (checked first: an oversized prompt fetches nothing and is not hashed)
            try:
                hashed = await run_in_threadpool(service.hash_prompts, prompts, who.tenant, adapter, params)
            except RequestError as exc:
                raise _request_refused(exc) from None
        if transfer == "decode":
            transferred = await run_in_threadpool(kv_transfer.fetch, service, prompts, who.tenant, adapter, hashed)

        async def hand_in():  # queued by the engine thread before its next step, with no wait for this one
            # a reply's shape is compiled when the request is checked (ms; the first one builds the
            # vocabulary's index, up to a second): off the loop that streams every answer
            if sum(map(len, prompts)) <= HAND_IN_ON_LOOP_TOKENS and params.constraint is None:
                return await asyncio.wrap_future(service.submit_nowait(prompts, params, who, sink, priority, adapter,
                                                                       hashed))
            handed = await run_in_threadpool(service.submit_nowait, prompts, params, who, sink, priority, adapter,
                                             hashed)
            return await asyncio.wrap_future(handed)

        submitting = asyncio.ensure_future(hand_in())
        try:
            requests = await asyncio.shield(submitting)
        except asyncio.CancelledError:
            # The client left while its requests were being queued: cancel them once they are.
            submitting.add_done_callback(lambda done: None if done.cancelled() or done.exception() else [
                service.cancel(r.request_id) for r in done.result()])
            raise
        except RequestError as exc:
            raise _request_refused(exc) from None
        except AdmissionRejected as exc:
            if exc.kind in ("queue_full", "tenant_limit"):
                raise ApiError(429, str(exc), type_="rate_limit_error", code=exc.kind,
                               headers={"Retry-After": "1"}) from None
            if exc.kind == "pinned_out":  # the operator's pins, not the request, stand in its way
                raise ApiError(503, str(exc), type_="server_error", code=exc.kind) from None
            raise ApiError(400, str(exc), code="cache_capacity_exceeded") from None
        head = {"id": shape.id_prefix + uuid.uuid4().hex[:24], "created": int(time.time()),
                "model": adapter or service.model_name}
        if served is not None:  # the tier that served it, where it named one (OpenAI's answers say it)
            head["service_tier"] = served
        # the engine's ids, which `kvctl requests` lists and `kvctl cancel` takes
        named = {"X-KVD-Request-Id": ",".join(r.request_id for r in requests)}
        if client_id is not None:
            named["X-Request-Id"] = client_id
        n = params.n
        index_of = {(r.request_id, i): p * n + i for p, r in enumerate(requests) for i in range(n)}
        by_id = {r.request_id: r for r in requests}

        def cancel_all():
            for request in requests:
                service.cancel(request.request_id)

        names = TokenNames(engine.tokenizer.token_text, bool(body.return_tokens_as_token_ids))
        prompt_parts = PromptParts(names, params, body.prompt_logprobs, echo_texts,
                                   shape.prompt_logprobs_on, prompt_only, ids=bool(body.return_token_ids))
        shown = shows_cached_tokens(service.config.report_cached_tokens, who.role,
                                    http.headers.get(CALLER_ROLE_HEADER.lower()))

        def usage_of() -> dict:
            return usage(requests, counted=not prompt_only, cached=shown)

        def finished(seq, text: str) -> None:
            """A sample ended as `text`: a chat reply's ids are kept for the next turn (reply_ids.py)."""
            if isinstance(shape, ChatShape) and seq.finish_reason in KEPT_ENDINGS:
                service.remember_reply(who.tenant, seq.output_ids, text)

        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            # vLLM's continuous_usage_stats: each chunk says the tokens so far (with include_usage, as vLLM)
            running = include_usage and bool((body.stream_options or {}).get("continuous_usage_stats"))
            return StreamingResponse(
                _stream(engine, events, requests, by_id, index_of, head, shape, usage_of if include_usage else None,
                        cancel_all, params.logprobs is not None, prompt_parts, finished, running),
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
        turned_away = next((r for r in requests if r.rejected), None)
        if turned_away is not None:  # in the queue (pins kept it out, or it waited too long), or kvd failed it
            cancel_all()
            retry = {"Retry-After": "1"} if turned_away.rejected_kind == "queue_timeout" else {}
            failed = turned_away.rejected_kind == ENGINE_ERROR  # kvd failed it: a 500, which no router retries
            raise ApiError(500 if failed else 503, turned_away.rejected, type_="server_error",
                           code=turned_away.rejected_kind,
                           headers={**named, **retry})  # its ids: its log line's and kvctl's
        choices = []
        for p, request in enumerate(requests):
            for seq in sorted(request.sequences, key=lambda s: s.index):
                text, logprobs = prompt_parts.text(p), None
                output_ids, output_logprobs = ([], []) if prompt_only else (list(seq.output_ids), seq.logprobs)
                if params.logprobs is not None:
                    before, offset = prompt_parts.logprobs(p, request)
                    logprobs, _ = shape.logprobs(names, output_ids, output_logprobs, offset)
                    logprobs = joined(before, logprobs) if before is not None else logprobs
                reply = "" if prompt_only else engine.text_of(seq)
                if not prompt_only:
                    finished(seq, reply)
                choice = shape.choice(index_of[(request.request_id, seq.index)], text + reply,
                                      output_ids, seq.finish_reason, logprobs)
                choices.append(prompt_parts.add_to_choice(choice, request))
        choices.sort(key=lambda c: c["index"])
        answer = {"id": head["id"], "object": shape.object, "created": head["created"], "model": head["model"],
                  **_tier_of(head), "choices": choices, "usage": usage_of()}
        if transfer == "prefill":  # the prompt's blocks in Redis before the answer names them
            transferred = await run_in_threadpool(kv_transfer.publish, service, requests, hashed)
        if transferred is not None and (transfer == "prefill" or shown):  # what came says what it cached
            answer[kv_transfer.FIELD] = transferred
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
                checked_ids(ids, "prompt" if flat else f"prompt[{i}]", engine)
        return prompts

    app.include_router(responses_routes(service, principal, serve_chat, chat_shape))  # /v1/responses, as a chat turn
    app.include_router(conversations_routes(service, principal))  # /v1/conversations, which responses continue
    app.include_router(admin_routes(service, admin, tenant_header=front == "unix" or trusted_proxy))
    app.include_router(batch_routes(service, principal, admin))  # /v1/files, /v1/batches
    app.include_router(webhook_routes(service, admin))  # /admin/webhooks
    if front == "unix" and service.batches.lines_app is None:
        service.batches.lines_app = app  # (a batch's requests come in as its tenant's, over the socket)

    return app


def _tier_of(head: dict) -> dict:
    """An answer's (or chunk's) `service_tier`, where its request named one (service_tiers.py)."""
    return {"service_tier": head["service_tier"]} if "service_tier" in head else {}


async def _stream(engine, events, requests, by_id, index_of, head: dict, shape, usage_of, cancel_all,
                  with_logprobs: bool, prompt_parts: PromptParts, finished=lambda seq, text: None,
                  running_usage: bool = False):
    """Server-sent events ending with [DONE]; a disconnect cancels. `usage_of`: makes the usage of
    the chunk before [DONE] (stream_options.include_usage); None (or False): no such chunk.
    `finished(seq, text)`: told each sample's whole text once it ends. `running_usage` (vLLM's
    continuous_usage_stats): each chunk carries its prompt's tokens and its choice's so far.

    A chunk carries one choice's new tokens: one token per chunk while the client keeps up,
    and every token that waited in the queue once it falls behind (one chunk instead of many,
    so a slow reader costs the serving loop less, not more)."""
    sent_text = {key: "" for key in index_of}
    made = dict.fromkeys(index_of, 0)  # each choice's output tokens so far (running_usage)
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
                    if not prompt_parts.prompt_only:
                        finished(seq, text)
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
                         "model": head["model"], **_tier_of(head), "choices": [choice]}
                if running_usage:
                    made[key] += len(token_ids)
                    chunk["usage"] = {"prompt_tokens": len(request.prompt_ids), "completion_tokens": made[key],
                                      "total_tokens": len(request.prompt_ids) + made[key]}
                if first:
                    prompt_parts.add_to_choice(choice, request)
                    prompt_parts.add_to_answer(chunk, request, once=True)
                yield f"data: {json.dumps(chunk)}\n\n"
        turned_away = next((r for r in requests if r.rejected), None)
        if turned_away is not None:  # its samples ended "error" in the queue: say why before [DONE]
            body = error_body(turned_away.rejected, "server_error", None, turned_away.rejected_kind)
            yield f"data: {json.dumps(body)}\n\n"
        if usage_of:
            usage_chunk = {"id": head["id"], "object": shape.chunk_object, "created": head["created"],
                           "model": head["model"], **_tier_of(head), "choices": [], "usage": usage_of()}
            yield f"data: {json.dumps(usage_chunk)}\n\n"
        yield "data: [DONE]\n\n"
        finished_cleanly = True
    finally:
        if not finished_cleanly:
            cancel_all()
