"""kvd router: one OpenAI-compatible front for several kvd replicas, sending each completion
where a routing policy (kvctl.policies.routing) says it will be served best.

How it learns what each replica holds of a prompt and how busy it is (its predicted wait,
running and waiting requests, measured prefill rate) is the `view`:

    ask      for each request, every replica is asked at once, one call each
             (`/admin/route-facts`): exact, at the cost of a round trip per replica per request.
    events   (the default) the router follows each replica's event feed (`/admin/events`) and polls its load;
             it tokenizes and hashes the prompt itself and decides with no call on the request's
             path. A prompt it has just sent somewhere counts as cached there until the feed
             confirms it (or `pending_seconds` pass), so a burst sharing a new prefix goes to one
             replica instead of every replica computing it. A replica whose feed or load is not
             current is asked, as with `ask`.

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
import copy
import json
import logging
import secrets
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Callable
from urllib.parse import quote

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvctl import __version__ as kvctl_version
from kvctl.daemon.cache.keys import Namespace, chain_keys
from kvctl.policies.routing import (NEW_PREFIX_SLACK_TOKENS, ROUTING_POLICIES, ReplicaFacts, Router,
                                    facts_from_answer, make_router)

from .replica_errors import answer_described, described, kvd_json
from .auth import BearerRefused, TokenTable, bearer_entry
from .body_limit import BodyLimit
from .event_relay import relay_events
from .fleet_admin import (combine, fan_out, merge_cancels, merge_evictions, merge_pin_lists, merge_pins,
                          merge_prefix_lists, merge_request_lists, merge_tenant_lists, merge_tier_reports,
                          merge_unpins, merge_verifies)
from .fleet_pins import sync_pins
from .fleet_trace import merge_traces, trace_query
from .request_trace import ROUTER_ATTEMPT_HEADER, RouterAttempt
from .gc_pauses import GcPauses
from .replica_feed import Tokenizers, follow_events, poll_load
from .replica_view import ReplicaView
from .route_question import affinity_of, computes_whole_prompt, local_ids, question_of, question_size
from .router_metrics import RouterMetrics

log = logging.getLogger("kvd.router")

ASK_TIMEOUT_S = 2.0  # a replica slower than this to answer the question is left out
FORWARD_TIMEOUT_S = 600.0
WELCOME_TIMEOUT_S = 600.0  # how long a replica that joined may take to answer ready before its pins are copied
FLEET_ADMIN_TIMEOUT_S = 150.0  # an eviction may search the shared Redis for 30 s; a pin may warm for 120 s
PASSED_HEADERS = ("content-type",)  # and X-KVD-Tenant, as the front resolved it
VIEWS = ("ask", "events")
DISCONNECT_CHECK_S = 0.5  # how often a forwarded non-streamed request looks for its caller having left
# a forward's failures before any byte of an answer came, where the connection itself ended
CLOSED_BEFORE_ANSWER = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
UNTRACED_KEPT = 10_000  # times of requests no replica kept a trace line of, for the fleet's trace
# What to ask the router instead, for replica paths that have a fleet counterpart
ROUTER_INSTEAD = {"/admin/drain": "drain or resume one replica through it with kvctl fleet drain (or resume) "
                                  "REPLICA (POST /router/drain)"}
LARGE_PROMPT = 32_768  # characters or token ids: the events view weighs a longer prompt in a worker thread


@dataclass
class Replica:
    """One upstream kvd and the router's own count of what it sent there."""

    name: str  # as given: a socket path or a URL
    client: httpx.AsyncClient
    sent: int = 0
    open: int = 0  # forwarded requests still answering
    last_error: str | None = None
    view: ReplicaView | None = None  # with --view events: what its feed and load polls say
    model: str | None = None  # the model it serves, as its latest answer to a question said
    feed_error: str | None = None
    snapshots: int = 0  # times its feed was (re)started from a snapshot
    # the router's tallies, for /metrics
    prompt_tokens: int = 0  # of the requests sent there (as the router counted them)
    cached_tokens: int = 0  # of those, what the router counted as held there when it chose it
    questions: int = 0  # route-facts asked on a request's path (ask view, or a view not current)
    failed_questions: int = 0
    failed_forwards: int = 0
    rerouted: int = 0  # requests it refused before starting (429, 503) or was unreachable for: tried elsewhere
    draining: bool = False  # takes no new request: an operator's drain, or it is leaving
    drained_there: bool = False  # the replica itself said it is draining (kvctl drain; seen by every router)
    leaving: bool = False  # taken out of the fleet: it goes once its open requests have answered
    welcomed: dict | None = None  # joined while the router ran: the fleet's pins copied to it (fleet_pins.py)
    tasks: list = field(default_factory=list)  # events view: its feed and load followers

    @property
    def known_draining(self) -> bool:
        """Drained here, or draining by its latest load poll (events view): left out unasked."""
        load = self.view.load if self.view is not None else None
        return self.draining or (load is not None and load.get("draining", False))

    @property
    def takes_requests(self) -> bool:
        """Neither drained here nor draining by its own latest word (a load poll, else an answer)."""
        polled = self.view is not None and self.view.load is not None
        return not (self.known_draining or (not polled and self.drained_there))


def replica_client(spec: str, token: str | None = None, transport: httpx.AsyncBaseTransport | None = None
                   ) -> httpx.AsyncClient:
    """A client for a socket path or an http(s) URL (with `token` as its bearer)."""
    timeout = httpx.Timeout(FORWARD_TIMEOUT_S, connect=ASK_TIMEOUT_S)
    if spec.startswith(("http://", "https://")):
        if not token:
            raise ValueError(f"replica: {spec!r} is reached over TCP and needs --token-file (an admin token)")
        return httpx.AsyncClient(base_url=spec, headers={"Authorization": f"Bearer {token}"}, timeout=timeout,
                                 transport=transport)
    return httpx.AsyncClient(base_url="http://kvd", timeout=timeout,
                             transport=transport or httpx.AsyncHTTPTransport(uds=spec))


def json_object(raw: bytes) -> dict | None:
    """A request body that is a JSON object, or None."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


class CallerLeft(Exception):
    """The caller disconnected before its answer came."""


class ModelNotServed(LookupError):
    """The request names a model no live replica serves."""


@dataclass
class Local:
    """One replica weighed from its view: its facts and the prompt's keys under its namespace."""

    facts: ReplicaFacts
    keys: list[bytes]
    prompt_tokens: int


def reusing(body: dict, live: list[tuple[int, ReplicaFacts, int]]) -> list[tuple[int, ReplicaFacts, int]]:
    """The weighed replicas as the request can use them: one that scores its prompt reuses nothing
    (route_question.computes_whole_prompt), so it is weighed as though no replica cached any of it."""
    if not computes_whole_prompt(body):
        return live
    return [(i, replace(f, cached_tokens=0, restorable_tokens=0, restore_seconds=0.0), tokens) for i, f, tokens in live]


@dataclass
class RouterService:
    replicas: list[Replica]
    router: Router
    view: str = "events"  # see the module's docstring
    load_interval: float = 0.25  # events: seconds between load polls of each replica
    pending_seconds: float = 30.0  # events: how long a sent prompt counts as cached before the feed says
    clock: Callable[[], float] = time.monotonic
    tokenizers: Tokenizers = field(default_factory=Tokenizers)
    # Requests the router gave up on with no replica taking them in: none could take one or be
    # reached, or each one asked was stopping, loading or draining (a 503). `unrouted` counts them
    # (kvd_router_unrouted_total); no replica keeps a trace line of them, so the fleet's trace says
    # how many fell in its span from `untraced` (fleet_trace.py): Unix times, the newest UNTRACED_KEPT.
    unrouted: int = 0
    untraced: deque = field(default_factory=lambda: deque(maxlen=UNTRACED_KEPT))
    on_decision: Callable[[float], None] = lambda seconds: None  # each choice's time (the /metrics histogram)
    # the router process's garbage collections (gc_pauses.py): `kvd router` installs and freezes it
    gc_pauses: GcPauses = field(default_factory=lambda: GcPauses(stalls="no request is routed meanwhile"))

    def __post_init__(self) -> None:
        if self.view not in VIEWS:
            raise ValueError(f"view: unknown value {self.view!r}; use {' or '.join(VIEWS)}")
        if not self.load_interval > 0:
            raise ValueError(f"load_interval: must be > 0 seconds, got {self.load_interval!r}")
        if not self.pending_seconds >= 0:
            raise ValueError(f"pending_seconds: must be >= 0, got {self.pending_seconds!r}")
        names = [r.name for r in self.replicas]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"replica: {twice[0]!r} is given twice; each replica once")
        self._following = False
        self._leaving: set[asyncio.Task] = set()  # replicas on their way out (`remove`)
        self._welcoming: set[asyncio.Task] = set()  # replicas joining: the fleet's pins are copied to them
        for replica in self.replicas:
            self._prepare(replica)

    def _prepare(self, replica: Replica) -> None:
        if self.view == "events":
            replica.view = ReplicaView(pending_seconds=self.pending_seconds)

    @property
    def load_stale_seconds(self) -> float:
        """A load answer older than this is not trusted: the replica is asked instead."""
        return max(2.0, 10 * self.load_interval)

    def follow(self) -> list[asyncio.Task]:
        """Start following every replica's feed and load (events view), and those added later;
        cancel the tasks to stop."""
        self._following = True
        return [task for replica in self.replicas for task in self._follow(replica)]

    def _follow(self, replica: Replica) -> list[asyncio.Task]:
        if replica.view is None:
            return []

        def noted(error: str | None) -> None:
            replica.feed_error = error
            replica.snapshots += error is None
        back = asyncio.Event()  # the load poll answered again after failing: the feed need not wait out its pause
        replica.tasks = [asyncio.create_task(follow_events(replica.client, replica.view, self.tokenizers, noted, back)),
                         asyncio.create_task(poll_load(replica.client, replica.view, self.load_interval, self.clock,
                                                       back))]
        return replica.tasks

    # ---- membership: the fleet changes while the router serves --------------------------------
    # `replicas` is replaced, never changed in place: a decision that awaits keeps the list it began with.
    def find(self, name: str) -> Replica:
        """The replica of that name; LookupError naming the ones there are."""
        for replica in self.replicas:
            if replica.name == name:
                return replica
        raise LookupError(f"replica: no replica {name!r}; the router has "
                          + ", ".join(repr(r.name) for r in self.replicas))

    def add(self, replica: Replica) -> None:
        """Take a replica into the fleet (followed at once where the others are)."""
        if any(r.name == replica.name for r in self.replicas):
            raise ValueError(f"replica: {replica.name!r} is in the fleet already")
        self._prepare(replica)
        if self._following:
            self._follow(replica)
        self.replicas = [*self.replicas, replica]
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # not serving yet: a fleet being set up, not a replica joining one
            return
        task = asyncio.create_task(self._welcome(replica))
        self._welcoming.add(task)
        task.add_done_callback(self._welcoming.discard)

    async def _welcome(self, replica: Replica, poll_seconds: float = 1.0) -> None:
        """Once a replica that joined answers ready, give it the fleet's pins it lacks (the
        others' pins, by their keys: fleet_pins.py); `welcomed` says how it went."""
        deadline = time.monotonic() + WELCOME_TIMEOUT_S
        while True:
            try:
                if (await replica.client.get("/readyz", timeout=ASK_TIMEOUT_S)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if replica.leaving or time.monotonic() > deadline:
                replica.welcomed = {"pins_copied": 0, "error": "it did not answer ready"}
                return
            await asyncio.sleep(poll_seconds)
        status, body = await sync_pins(self.replicas, only=replica.name)
        copied = body.get("copied", 0) if status == 200 else 0
        replica.welcomed = {"pins_copied": copied, **({"error": body["message"]} if body.get("message") else {})}
        log.info("replica %s joined: %d of the fleet's pins copied to it%s", replica.name, copied,
                 f" ({body['message']})" if body.get("message") else "")

    def drain(self, name: str, on: bool = True) -> Replica:
        """Send a replica no new request (its open ones answer as usual), or take new ones again."""
        replica = self.find(name)
        if replica.leaving and not on:
            raise ValueError(f"replica: {name!r} is leaving the fleet; add it again instead")
        replica.draining = on
        return replica

    def remove(self, name: str) -> asyncio.Task:
        """Take a replica out of the fleet: drained now, gone (no longer followed, its connections
        closed) once its open requests have answered. Call in the event loop."""
        replica = self.find(name)
        replica.draining = replica.leaving = True
        task = asyncio.get_running_loop().create_task(self._leave(replica))
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)
        return task

    def stay(self, name: str) -> Replica:
        """Keep a replica that was leaving but has not gone yet: it takes requests again."""
        replica = self.find(name)
        replica.draining = replica.leaving = False
        return replica

    async def _leave(self, replica: Replica, poll_seconds: float = 0.05) -> None:
        while replica.open > 0 and replica.leaving:
            await asyncio.sleep(poll_seconds)
        if not replica.leaving:  # it was asked to stay meanwhile
            return
        for task in replica.tasks:
            task.cancel()
        await asyncio.gather(*replica.tasks, return_exceptions=True)
        self.replicas = [r for r in self.replicas if r is not replica]
        await replica.client.aclose()

    async def ask(self, replica: Replica, question: dict | None, tenant: str | None
                  ) -> tuple[ReplicaFacts, int] | None:
        """The replica's facts for this prompt and the prompt's length in its tokens, or None (and
        its error kept) when it cannot say."""
        replica.questions += 1
        try:
            answer = await replica.client.post("/admin/route-facts", json={**(question or {"tokens": []}),
                                                                            "tenant": tenant},
                                               timeout=ASK_TIMEOUT_S)
            if answer.status_code in (400, 413, 422):  # the prompt is bad, not the replica: it says so
                replica.last_error = None  # when the request reaches it
                return ReplicaFacts(0, 0.0, replica.open), 0
            answer.raise_for_status()
            known = kvd_json(answer)
            facts = facts_from_answer(known, replica.open)
            replica.model = known.get("model")
            replica.drained_there = bool(known.get("draining", False))
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            replica.last_error = described(exc)
            replica.failed_questions += 1
            return None
        replica.last_error = None
        return facts, known["prompt_tokens"]

    def weigh_locally(self, replica: Replica, question: dict | None, tenant: str | None, now: float,
                      memo: dict) -> Local | None:
        """The replica's facts from its view, or None when the view is not current (feed not
        synced, load not polled lately) and the replica must be asked. `memo` keeps the prompt's
        tokens and keys across replicas that share a tokenizer and a namespace."""
        view = replica.view
        if view is None or not view.synced or view.load is None or view.load_age(now) > self.load_stale_seconds:
            return None
        namespace = view.namespace
        if question is None:
            ids = None
        elif "tokens" in question:
            ids = question["tokens"]
        else:
            digest, template_digest = namespace["tokenizer_digest"], view.chat_template
            if ("ids", digest, template_digest) not in memo:
                tokenizer = self.tokenizers.by_digest.get(digest)
                template = self.tokenizers.templates.get(template_digest) if template_digest else None
                if tokenizer is None or (template_digest is not None and template is None):
                    return None
                memo["ids", digest, template_digest] = local_ids(question, tokenizer, template)
            ids = memo["ids", digest, template_digest]
        if not ids:  # no prompt it can read: it goes by load, and the replica says what is wrong
            return Local(view.facts(0, replica.open), [], 0)
        tenant = view.tenant_for(tenant)
        name = (tenant, *sorted(namespace.items()))
        if ("keys", name) not in memo:
            try:
                memo["keys", name] = chain_keys(Namespace(**namespace, tenant=tenant), ids)
            except ValueError:  # ids the replica will refuse: it says so when the request reaches it
                memo["keys", name] = []
        keys = memo["keys", name]
        cached = view.cached_tokens(keys, len(ids), now)
        run = view.lower_run(keys[cached // view.block_size:view.cacheable_blocks(len(ids))])
        restorable = sum(run.values()) * view.block_size
        return Local(view.facts(cached, replica.open, restorable, view.restore_seconds(run)), keys, len(ids))

    async def choose(self, body: dict, tenant: str | None, excluded: set[int] = frozenset()
                     ) -> tuple[Replica, str]:
        """The replica for this request, and why; replicas whose id() is in `excluded` (they
        refused it already) are not weighed. LookupError when none can take it."""
        started = time.perf_counter()
        try:
            return await self._choose(body, tenant, excluded)
        finally:
            self.on_decision(time.perf_counter() - started)

    async def weigh(self, body: dict, question: dict | None, tenant: str | None, excluded: set[int] = frozenset()
                    ) -> tuple[list[tuple[int, ReplicaFacts, int]], list[Local | None], float]:
        """Every replica that could take the request, as the policy weighs it: (index, facts,
        prompt tokens it counted) from its view or by asking it, serving the model the body names;
        `question`: the body's prompt as `question_of` reads it. Also each replica's local
        weighing (None where asked) and the clock reading used. LookupError (ModelNotServed)
        when none can."""
        now, memo, replicas = self.clock(), {}, self.replicas
        excluded = set(excluded) | {id(r) for r in replicas if r.known_draining}  # one asked says so itself

        def weigh_all() -> list[Local | None]:
            return [self.weigh_locally(r, question, tenant, now, memo) if id(r) not in excluded else None
                    for r in replicas]

        large = question_size(question) > LARGE_PROMPT
        # a long prompt is tokenized and hashed off the event loop that streams every answer
        local = await asyncio.to_thread(weigh_all) if large else weigh_all()
        asked = await asyncio.gather(*(self.ask(r, question, tenant) for r, known in zip(replicas, local)
                                       if known is None and id(r) not in excluded))
        answers = iter(asked)
        facts = [None if id(r) in excluded else (known.facts, known.prompt_tokens) if known is not None
                 else next(answers) for r, known in zip(replicas, local)]
        facts = [None if known is None and r.drained_there else f for r, known, f in zip(replicas, local, facts)]
        live = [(i, replace(f, name=replicas[i].name), tokens) for i, a in enumerate(facts) if a is not None
                for f, tokens in [a]]
        if not live:
            if replicas and not any(r.takes_requests for r in replicas):
                raise LookupError("every replica is draining: " + ", ".join(r.name for r in replicas))
            raise LookupError("no replica answered: " + "; ".join(
                f"{r.name} ({r.last_error or r.feed_error})" for r in replicas if id(r) not in excluded))
        wanted = body.get("model")
        if isinstance(wanted, str):  # only where it is served (a replica whose model is unknown may say)
            serving = [entry for entry in live if self.model_of(replicas[entry[0]]) in (None, wanted)]
            if not serving:
                served = sorted({m for r in replicas if (m := self.model_of(r)) is not None})
                raise ModelNotServed(f"model: {wanted!r} is not served by any replica; GET /v1/models lists "
                                     + ", ".join(repr(m) for m in served))
            live = serving
        return live, local, now, replicas

    async def _choose(self, body: dict, tenant: str | None, excluded: set[int]) -> tuple[Replica, str]:
        question = question_of(body)
        live, local, now, replicas = await self.weigh(body, question, tenant, excluded)
        live = reusing(body, live)
        prompt_tokens = max(tokens for _, _, tokens in live)
        chosen = self.router.choose(prompt_tokens, [f for _, f, _ in live], affinity_of(question))
        index, facts, counted = live[chosen.replica]
        replica = replicas[index]
        replica.sent += 1
        replica.prompt_tokens += counted
        replica.cached_tokens += facts.cached_tokens
        known = local[index]
        if known is not None and known.keys:  # what it will hold and compute once this arrives
            replica.view.note_sent(known.keys, known.prompt_tokens - known.facts.cached_tokens, now)
        return replica, chosen.reason

    async def what_if(self, body: dict, tenant: str | None, policies: list[str]) -> dict:
        """Where each of `policies` would send this request now, and why, with every replica's
        facts as the router sees them (from its view, or asked): nothing is sent, and the live
        policy's own books are not touched (it decides on a copy)."""
        question = question_of(body)
        live, local, _, replicas = await self.weigh(body, question, tenant)
        live = reusing(body, live)
        affinity = affinity_of(question)
        prompt_tokens = max(tokens for _, _, tokens in live)
        facts = {index: f for index, f, _ in live}
        rows = []
        for index, replica in enumerate(replicas):
            row = {"replica": replica.name}
            if index in facts:
                row.update(asdict(facts[index]), source="view" if local[index] is not None else "asked")
            else:
                row["error"] = ("draining" if not replica.takes_requests else replica.last_error or replica.feed_error
                                or "serves another model")
            rows.append(row)
        settings = {"prefill_rate": getattr(self.router, "prefill_rate", 20_000.0),
                    "balance_seconds": getattr(self.router, "balance_seconds", 2.0),
                    "new_prefix": getattr(self.router, "new_prefix", "home"),
                    "new_prefix_slack": getattr(self.router, "new_prefix_slack", NEW_PREFIX_SLACK_TOKENS)}
        routes = {}
        for name in policies:
            policy = copy.deepcopy(self.router) if name == self.router.name else make_router(name, **settings)
            chosen = policy.choose(prompt_tokens, [f for _, f, _ in live], affinity)
            routes[name] = {"replica": replicas[live[chosen.replica][0]].name, "reason": chosen.reason}
        return {"prompt_tokens": prompt_tokens, "routing": self.router.name, "replicas": rows, "routes": routes}

    def gave_up(self, routed_at: float) -> None:
        """A request no replica took in, routed (or refused) at `routed_at` (Unix time)."""
        self.unrouted += 1
        self.untraced.append(routed_at)

    @staticmethod
    def model_of(replica: Replica) -> str | None:
        """The model a replica serves, as its latest answer (a load poll or a question) said."""
        if replica.view is not None and replica.view.model is not None and replica.view.synced:
            return replica.view.model
        return replica.model

    def status(self) -> dict:
        now = self.clock()

        def one(r: Replica) -> dict:
            row = {"replica": r.name, "sent": r.sent, "open": r.open, "last_error": r.last_error}
            if not r.takes_requests:  # leaving: it goes once `open` is 0; "at the replica": kvctl drain there
                row["draining"] = "leaving" if r.leaving else "drained" if r.draining else "at the replica"
            if r.welcomed is not None:
                row["welcomed"] = r.welcomed
            if r.view is not None:
                age = r.view.load_age(now)
                row["view"] = {"synced": r.view.synced, "seq": r.view.seq, "device_keys": len(r.view.keys),
                               "lower_tier_keys": {tier: len(keys) for tier, keys in r.view.lower.items()},
                               "pending_keys": r.view.pending_count(now),
                               "load_age_seconds": None if age is None else round(age, 3),
                               "feed_error": r.feed_error}
            return row

        return {"routing": self.router.name, "view": self.view, "replicas": [one(r) for r in self.replicas],
                "gc": self.gc_pauses.report()}


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # None: the replica's default (a Unix caller that named none)
    role: str


class Refused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def create_router_app(service: RouterService, max_request_bytes: int = 32 * 2**20, *, front: str = "unix",
                      tokens: TokenTable | None = None, metrics: RouterMetrics | None = None) -> FastAPI:
    """The router's front; a body over `max_request_bytes` is refused (413) before it is read
    whole, as kvd refuses it.

    front "unix": callers are trusted (the socket's mode says who may connect), act as admin, and
    their X-KVD-Tenant passes through. front "tcp": every request but /healthz needs a bearer
    token of `tokens` (TOKEN TENANT ROLE, as kvd's), whose tenant the request is routed and served
    under (a caller's own X-KVD-Tenant is replaced); /router/status, /admin/status and /metrics
    need the admin role. Fronts of one router share `metrics`."""
    if front not in ("unix", "tcp"):
        raise ValueError(f"front: unknown value {front!r}; use unix or tcp")
    if front == "tcp" and tokens is None:
        raise ValueError("front: a tcp front needs the callers' tokens")
    app = FastAPI(title="kvd router", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=lambda: max_request_bytes)
    metrics = metrics or RouterMetrics(service)

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
        return Caller(entry.tenant, entry.role)

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
        followed and whose load is current; with ask, one whose own /readyz says so."""
        now = service.clock()
        if service.view == "events":
            ready = [r.name for r in service.replicas if r.takes_requests and r.view.synced and r.view.load is not None
                     and r.view.load_age(now) <= service.load_stale_seconds]
        else:
            async def one(replica: Replica) -> bool:
                try:
                    return (await replica.client.get("/readyz", timeout=ASK_TIMEOUT_S)).status_code == 200
                except httpx.HTTPError:
                    return False
            taking = [r for r in service.replicas if r.takes_requests]
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

    # ---- operator actions every replica carries out (daemon/server/fleet_admin.py); drained
    # replicas too: they still hold blocks and pins
    async def everywhere(method: str, path: str, content: bytes | None, merge) -> JSONResponse:
        replicas = service.replicas
        answers = await fan_out(replicas, method, path, content, FLEET_ADMIN_TIMEOUT_S)
        status, body = combine([r.name for r in replicas], answers, merge)
        return JSONResponse(body, status_code=status)

    @app.post("/admin/evict")
    async def evict_everywhere(http: Request, _: Caller = Depends(admin)):
        raw = await http.body()
        body = json_object(raw)
        if body is not None and "purge_once" not in body:  # one search per shared Redis (fleet_admin.py)
            raw = json.dumps({**body, "purge_once": secrets.token_hex(16)}).encode()
        return await everywhere("POST", "/admin/evict", raw, merge_evictions)

    def merged_listing(path: str, merge):
        """GET `path`: every replica's listing there (with the caller's query), merged by `merge`."""

        async def listing(http: Request, _: Caller = Depends(admin)) -> JSONResponse:
            replicas = service.replicas
            query = f"?{http.url.query}" if http.url.query else ""
            answers = await fan_out(replicas, "GET", path + query, None, ASK_TIMEOUT_S)
            status, body = merge([r.name for r in replicas], answers)
            return JSONResponse(body, status_code=status)

        app.add_api_route(path, listing, methods=["GET"], name=f"{path.rsplit('/', 1)[-1]}_everywhere")

    for path, merge in (("/admin/requests", merge_request_lists), ("/admin/tenants", merge_tenant_lists),
                        ("/admin/tiers", merge_tier_reports), ("/admin/prefixes", merge_prefix_lists),
                        ("/admin/pins", merge_pin_lists)):
        merged_listing(path, merge)

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

    @app.delete("/admin/pins/{pin_id}")
    async def unpin_everywhere(pin_id: str, _: Caller = Depends(admin)):
        return await everywhere("DELETE", f"/admin/pins/{quote(pin_id, safe='')}", None, merge_unpins)

    @app.get("/admin/trace")
    async def fleet_trace(http: Request, _: Caller = Depends(admin)):
        """The replicas' traces as one, in arrival order (daemon/server/fleet_trace.py); refused
        when the replicas key their block ids apart."""
        raw = http.query_params.get("last")
        if raw is not None and not (raw.isdigit() and int(raw) >= 1):
            return error(400, f"last: must be a whole number >= 1, got {raw!r}", "invalid_request")
        last = None if raw is None else int(raw)
        replicas = service.replicas
        answers = await fan_out(replicas, "GET", trace_query(last), None, FLEET_ADMIN_TIMEOUT_S)
        status, body = merge_traces([r.name for r in replicas], answers, last, list(service.untraced))
        return JSONResponse(body, status_code=status)

    @app.post("/router/sync-pins")
    async def sync_pins_everywhere(_: Caller = Depends(admin)):
        """Every pin of the fleet on every replica of its block space that lacks it (fleet_pins.py)."""
        status, body = await sync_pins(service.replicas)
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
    def metrics_endpoint(_: Caller = Depends(admin)):
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/status")
    async def fleet_status(_: Caller = Depends(admin)):
        """The replicas' statuses, with the figures a fleet adds up (model steps, queue) summed:
        what `kvctl bench serve` reads of the daemon it drives."""
        async def one(replica: Replica):
            try:
                answer = await replica.client.get("/admin/status", timeout=ASK_TIMEOUT_S)
                answer.raise_for_status()
                return kvd_json(answer)
            except (httpx.HTTPError, ValueError) as exc:
                return {"error": described(exc)}

        statuses = await asyncio.gather(*(one(r) for r in service.replicas))
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
        return {"model": live[0]["model"], "steps": steps, "queue": queue, **service.status(),
                "replica_status": [{"replica": r.name, **st} for r, st in zip(service.replicas, statuses)]}

    @app.get("/v1/models")
    async def models(_: Caller = Depends(caller)):
        """Every model some replica serves, once each."""
        async def one(replica: Replica):
            try:
                answer = await replica.client.get("/v1/models", timeout=ASK_TIMEOUT_S)
                answer.raise_for_status()
                return answer.json()["data"]
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return None

        listed = [m for m in await asyncio.gather(*(one(r) for r in service.replicas)) if m is not None]
        if not listed:
            return error(503, "no replica answered", "no_replica")
        data = {}
        for models_of_one in listed:
            for model in models_of_one:
                data.setdefault(model["id"], model)
        return {"object": "list", "data": list(data.values())}

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
        be reached or is not ready is passed over."""
        why = "no replica takes requests"
        for replica in [r for r in service.replicas if r.takes_requests]:
            try:
                answer = await replica.client.post(path, content=raw, timeout=ASK_TIMEOUT_S,
                                                   headers={"Content-Type": "application/json"})
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

    async def forward(path: str, http: Request, who: Caller):
        """Route the request, send it to the chosen replica's `path` as it came, and stream the
        answer back; refusals before a start are passed to the next best replica."""
        async def unless_caller_leaves(step):
            """Await `step`, looking every DISCONNECT_CHECK_S for the caller having left: then it is
            cancelled (closing the replica's connection, which cancels the request there) and
            CallerLeft raised."""
            task = asyncio.ensure_future(step)
            while not (await asyncio.wait({task}, timeout=DISCONNECT_CHECK_S))[0]:
                if await http.is_disconnected():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    raise CallerLeft
            return task.result()

        raw = await http.body()
        body = json_object(raw)
        if body is None:
            return error(400, "body: expected a JSON object", "invalid_json")
        tenant = who.tenant
        headers = {k: v for k, v in http.headers.items() if k.lower() in PASSED_HEADERS}
        if tenant is not None:
            headers["X-KVD-Tenant"] = tenant
        # A replica that refuses before starting the request (429: its queue is full; 503: it is
        # stopping or loading) or cannot be connected to has not run it: the next best one is tried.
        tried, excluded, refusal, closed_retried = [], set(), None, False
        traced = False  # whether a replica ran a try or turned it away (429): it keeps a trace line of it
        route_id = secrets.token_hex(8)  # each try names it: the fleet's trace keeps its last (fleet_trace.py)
        routed_at = None  # when the first replica was chosen: the fleet's trace is in this order, on this clock
        while True:
            try:
                replica, reason = await service.choose(body, tenant, excluded)
            except LookupError as exc:  # ModelNotServed too: on a retry, none left that serves its model
                if refusal is None and isinstance(exc, ModelNotServed):
                    return error(404, str(exc), "model_not_found")
                if not traced:
                    service.gave_up(routed_at or time.time())
                if refusal is not None:  # every replica that could take it refused: the last refusal, as it came
                    return refusal
                return error(503, str(exc), "no_replica")
            routed_at = routed_at or time.time()
            headers[ROUTER_ATTEMPT_HEADER] = RouterAttempt(route_id, len(tried) + 1, routed_at).header()
            request = replica.client.build_request("POST", path, content=raw, headers=headers)
            try:  # a non-streamed answer's headers come only when it is whole: the caller may leave first
                upstream = await unless_caller_leaves(replica.client.send(request, stream=True))
            except CallerLeft:
                return Response(status_code=499)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached it
                replica.last_error = described(exc)
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
                return error(502, f"replica {replica.name} failed: {replica.last_error}", "replica_failed")
            traced = traced or upstream.status_code != 503  # a 503 (stopping, loading, draining) keeps none
            if upstream.status_code not in (429, 503):
                break
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
            replica.rerouted += 1
            kept = {k: v for k, v in upstream.headers.items() if k.lower() == "retry-after"}
            refusal = Response(content, status_code=upstream.status_code, headers={
                **kept, "X-KVD-Replica": replica.name, "X-KVD-Tried": "; ".join(tried + [
                    f"{replica.name} ({upstream.status_code})"])},
                media_type=upstream.headers.get("content-type", "application/json"))
            tried.append(f"{replica.name} ({upstream.status_code})")
            excluded.add(id(replica))
        replica.open += 1
        answer_headers = {"X-KVD-Replica": replica.name, "X-KVD-Route": reason}
        if "x-kvd-request-id" in upstream.headers:  # the replica's ids: kvctl requests / cancel there
            answer_headers["X-KVD-Request-Id"] = upstream.headers["x-kvd-request-id"]
        if tried:
            answer_headers["X-KVD-Tried"] = "; ".join(tried)
        media = upstream.headers.get("content-type", "application/json")

        def failed_mid_answer(exc: Exception, events: int) -> str:
            replica.last_error = described(exc)
            replica.failed_forwards += 1
            log.warning("replica %s failed after %d event%s of a streamed answer: %s", replica.name, events,
                        "" if events == 1 else "s", replica.last_error)
            return f"replica {replica.name} failed during the answer: {replica.last_error}"

        async def relay():
            try:
                async for event in relay_events(upstream.aiter_raw(), failed_mid_answer):
                    yield event
            finally:
                replica.open -= 1
                await upstream.aclose()

        if media.startswith("text/event-stream"):
            return StreamingResponse(relay(), status_code=upstream.status_code, media_type=media,
                                     headers=answer_headers)
        try:
            content = await unless_caller_leaves(upstream.aread())
        except CallerLeft:
            return Response(status_code=499)
        except httpx.HTTPError as exc:  # it ended during the answer: the request ran there, so not again
            replica.last_error = described(exc)
            replica.failed_forwards += 1
            return error(502, f"replica {replica.name} failed during the answer: {replica.last_error}",
                         "replica_failed")
        finally:
            replica.open -= 1
            await upstream.aclose()
        return Response(content, status_code=upstream.status_code, media_type=media, headers=answer_headers)

    return app
