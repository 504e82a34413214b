"""kvd router's books and choices: the replicas it sends to (`Replica`), what it knows of each
(its `view`), and the choice of one for each request (`RouterService`, deciding with a routing
policy of kvctl.policies.routing). The HTTP front that forwards the requests is router.py.

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
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import ssl
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace
from typing import Awaitable, Callable, Sequence, TypeVar
from urllib.parse import quote

import httpx

from kvctl.daemon.cache.keys import Namespace, chain_keys
from kvctl.policies.routing import (LOCAL_PREFILL_TOKENS, NEW_PREFIX_SLACK_TOKENS, ReplicaFacts, Router,
                                   facts_from_answer, make_router, none_in_time)
from kvctl.policies.unanswered import Unanswered
from kvctl.daemon.software import router_versions

from .fleet_admin import Answer, fan_out
from .fleet_file import ROLES
from .fleet_pins import sync_pins
from .fleet_rollouts import WatchBook
from .gc_pauses import GcPauses
from .replica_errors import described, kvd_json
from .replica_feed import Tokenizers, follow_events, poll_load
from .replica_view import ReplicaView
from .response_homes import ResponseHomes
from .silent_replicas import GIVE_UP_SILENT_S, PROBE_EVERY_S
from .reply_ids import REPLY_IDS_BYTES, ReplyIds
from .router_replies import ResponseReplyWatch, ReplyWatch, keeper, token_ids
from .route_question import affinity_of, computes_whole_prompt, local_ids, question_of, question_size
from .service_tiers import FLEX_DEFERRAL

log = logging.getLogger("kvd.router")
T = TypeVar("T")

EVENTS_VIEW_MAX_REST_S = 60.0  # the longest a replica rests unasked (policies/unanswered.py) with the events view
FAILING_AFTER = 3  # a replica whose answers were failures (500) this many times in a row is passed over ...
FAILING_MAX_REST_S = 60.0  # ... for 1 s, doubling with each more, up to this
ASK_TIMEOUT_S = 2.0  # a replica slower than this to answer the question is left out
FORWARD_TIMEOUT_S = 600.0
WELCOME_TIMEOUT_S = 600.0  # how long a replica that joined may take to answer ready before its pins are copied
VIEWS = ("ask", "events")
# how a request's disaggregated prefill went: done at a prefill replica; left to the decode replica
# (local: little to compute there, or a prompt it scores whole); or failed there or nowhere to go
PD_OUTCOMES = ("transferred", "local", "prefill_failed", "no_prefill_replica")
UNTRACED_KEPT = 10_000  # times of requests no replica kept a trace line of, for the fleet's trace
LARGE_PROMPT = 32_768  # characters or token ids: the events view weighs a longer prompt in a worker thread


@dataclass
class Replica:
    """One upstream kvd and the router's own count of what it sent there."""

    name: str  # as given: a socket path or a URL
    client: httpx.AsyncClient
    # what it takes (router.py, disaggregated prefill and decode): "both" (whole requests, and
    # decodes), "prefill" (computes prompts for the decode replicas), or "decode" (decodes only)
    role: str = "both"
    sent: int = 0
    open: int = 0  # forwarded requests still answering
    homed_at: int = -1  # when it last made a new conversation (RouterService.conversation_home's count); -1: never
    last_error: str | None = None
    view: ReplicaView | None = None  # with --view events: what its feed and load polls say
    model: str | None = None  # the model it serves, as its latest answer to a question said
    adapters: list[str] = field(default_factory=list)  # and its LoRA adapters, by name
    feed_error: str | None = None
    snapshots: int = 0  # times its feed was (re)started from a snapshot
    # the router's tallies, for /metrics
    prompt_tokens: int = 0  # of the requests sent there (as the router counted them)
    cached_tokens: int = 0  # of those, what the router counted as held there when it chose it
    questions: int = 0  # route-facts asked on a request's path (ask view, or a view not current)
    failed_questions: int = 0
    unanswered: Unanswered = field(default_factory=Unanswered)  # not asked for a while after it answers none
    skipped_questions: int = 0  # requests that did not ask it, as it rested (policies/unanswered.py)
    # its forwarded requests' answers that were its own failures (500s), in a row: passed over after FAILING_AFTER
    failing: Unanswered = field(default_factory=lambda: Unanswered(max_seconds=FAILING_MAX_REST_S, after=FAILING_AFTER))
    failed_forwards: int = 0
    given_up: int = 0  # requests it had that the router stopped waiting for, as it went silent (silent_replicas.py)
    probed_at: float = float("-inf")  # when it was last asked a load poll's question as a request waited on it
    probe: asyncio.Task | None = None  # that question, while it is out
    rerouted: int = 0  # requests it refused before starting (429, 503) or was unreachable for: tried elsewhere
    passed_over: int = 0  # requests sent elsewhere, its predicted wait past its max_queue_wait
    draining: bool = False  # takes no new request: an operator's drain, or it is leaving
    drained_there: bool = False  # the replica itself said it is draining (kvctl drain; seen by every router)
    asleep_there: bool = False  # and that it is asleep (kvctl sleep there), as its latest answer to a question said
    cached_tokens_report: str = "all"  # its report_cached_tokens, as its latest answer to a question said
    leaving: bool = False  # taken out of the fleet: it goes once its open requests have answered
    welcomed: dict | None = None  # joined while the router ran: the fleet's pins copied to it (fleet_pins.py)
    tasks: list = field(default_factory=list)  # events view: its feed and load followers

    @property
    def known_draining(self) -> bool:
        """Drained here, or draining by its latest load poll (events view): left out unasked."""
        load = self.view.load if self.view is not None else None
        return self.draining or (load is not None and load.get("draining", False))

    @property
    def asleep(self) -> bool:
        """Asleep by its own latest word (a load poll, else an answer to a question): `kvctl sleep`
        there (its route facts say it is draining too, so it takes no request)."""
        load = self.view.load if self.view is not None else None
        return load.get("asleep", False) if load is not None else self.asleep_there

    @property
    def tells_users_cached_tokens(self) -> bool:
        """Whether it shows callers without the admin role how much of their prompt it caches
        (report_cached_tokens: all), by its latest load poll, else its latest answer: where it does
        not, the router's X-KVD-Route, which names what it caches, must not tell them either."""
        load = self.view.load if self.view is not None else None
        said = load.get("report_cached_tokens", "all") if load is not None else self.cached_tokens_report
        return said == "all"

    @property
    def takes_requests(self) -> bool:
        """Neither drained here nor draining by its own latest word (a load poll, else an answer)."""
        polled = self.view is not None and self.view.load is not None
        return not (self.known_draining or (not polled and self.drained_there))


def replica_client(spec: str, token: str | None = None, transport: httpx.AsyncBaseTransport | None = None,
                   verify: ssl.SSLContext | bool = True) -> httpx.AsyncClient:
    """A client for a socket path or an http(s) URL (with `token` as its bearer; an https
    replica's certificate checked by `verify`: tls.client_context)."""
    timeout = httpx.Timeout(FORWARD_TIMEOUT_S, connect=ASK_TIMEOUT_S)
    if spec.startswith(("http://", "https://")):
        if not token:
            raise ValueError(f"replica: {spec!r} is reached over TCP and needs --token-file (an admin token)")
        return httpx.AsyncClient(base_url=spec, headers={"Authorization": f"Bearer {token}"}, timeout=timeout,
                                 transport=transport, verify=verify)
    return httpx.AsyncClient(base_url="http://kvd", timeout=timeout,
                             transport=transport or httpx.AsyncHTTPTransport(uds=spec))


class ModelNotServed(LookupError):
    """The request names a model no live replica serves."""


KEPT_NOUNS = {"responses": "response", "conversations": "conversation", "files": "file", "batches": "batch"}


class KeeperUnavailable(LookupError):
    """The replica that alone keeps the response or conversation a request continues cannot take
    it now (draining, not answering, or it refused it): no other replica could answer it."""


class NoneInTime(LookupError):
    """A request a replica turned away for its wait (queue_timeout): every other replica's predicted
    wait is past its own max_queue_wait, so it would wait there as long for the same answer."""


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


# a request's replicas as weighed (RouterService.weigh): (index, facts, prompt tokens) of those that
# could take it, each replica's local weighing (None: asked), the clock reading, the replicas then
Weighing = tuple[list[tuple[int, ReplicaFacts, int]], list[Local | None], float, list[Replica]]
# a weighing made before the choice it stands for, and when it began (time.perf_counter())
Weighed = tuple[Weighing, float]


@dataclass
class RouterService:
    replicas: list[Replica]
    router: Router
    view: str = "events"  # see the module's docstring
    load_interval: float = 0.25  # events: seconds between load polls of each replica
    pending_seconds: float = 30.0  # events: how long a sent prompt counts as cached before the feed says
    # a request's replica silent this long is given up on (given_up_on; 0: never), asked each
    # silent_probe_seconds meanwhile where no load poll asks it (silent_replicas.py)
    silent_give_up_seconds: float = GIVE_UP_SILENT_S
    silent_probe_seconds: float = PROBE_EVERY_S
    clock: Callable[[], float] = time.monotonic
    tokenizers: Tokenizers = field(default_factory=Tokenizers)
    # Requests the router gave up on with no replica taking them in: none could take one or be
    # reached, or each one asked was stopping, loading or draining (a 503). `unrouted` counts them
    # (kvd_router_unrouted_total); no replica keeps a trace line of them, so the fleet's trace says
    # how many fell in its span from `untraced` (fleet_trace.py): Unix times, the newest UNTRACED_KEPT.
    unrouted: int = 0
    # requests a replica turned away after their wait (queue_timeout) that went to no other: none was
    # predicted to start them in time (NoneInTime; kvd_router_timeouts_not_rerouted_total)
    timeouts_not_rerouted: int = 0
    # disaggregated: a replica that decodes computes the prompt itself when it would compute this many
    # tokens of it or fewer (it holds the rest), rather than take it from a prefill replica (router.py)
    local_prefill_tokens: int = LOCAL_PREFILL_TOKENS
    # disaggregated prefill and decode: requests by how their prefill went (router.py, PD_OUTCOMES)
    pd_outcomes: Counter = field(default_factory=Counter)
    untraced: deque = field(default_factory=lambda: deque(maxlen=UNTRACED_KEPT))
    # each choice's time, with the exemplar linking it to the route's trace where one is made (the /metrics histogram)
    on_decision: Callable[[float, dict | None], None] = lambda seconds, exemplar=None: None
    # the router process's garbage collections (gc_pauses.py): `kvd router` installs and freezes it
    gc_pauses: GcPauses = field(default_factory=lambda: GcPauses(stalls="no request is routed meanwhile"))
    tls: object | None = None  # the TCP front's TLS (tls.ServingTls), which SIGHUP rotates; None without
    log_requests: bool = False  # a logfmt line per routed request: where it went and why (router.py)
    # the TCP front serves a request under the X-KVD-Tenant it names, not its token's tenant (kvd router
    # --trusted-proxy): what a kvd sending its batches' requests through it over TCP needs (batch_via)
    trusted_proxy: bool = False
    route_spans: object | None = None  # OpenTelemetry spans of the routing (route_spans.RouteSpans); None: off
    # the replica that answered each response (/v1/responses), for the requests that continue it
    response_homes: ResponseHomes = field(default_factory=ResponseHomes)
    # the events view's memory of the chat replies relayed (router_replies.py), within reply_ids_bytes
    reply_ids: ReplyIds = field(default_factory=lambda: ReplyIds(REPLY_IDS_BYTES))
    # what its watch of fleet rollouts did (fleet_rollouts.py), started with the router (daemon/cli.py)
    rollout_watch: WatchBook = field(default_factory=WatchBook)

    def __post_init__(self) -> None:
        if self.view not in VIEWS:
            raise ValueError(f"view: unknown value {self.view!r}; use {' or '.join(VIEWS)}")
        if not self.load_interval > 0:
            raise ValueError(f"load_interval: must be > 0 seconds, got {self.load_interval!r}")
        if not self.pending_seconds >= 0:
            raise ValueError(f"pending_seconds: must be >= 0, got {self.pending_seconds!r}")
        if not self.silent_give_up_seconds >= 0:
            raise ValueError(f"silent_give_up_seconds: must be >= 0 (0: never), got {self.silent_give_up_seconds!r}")
        if not self.silent_probe_seconds > 0:
            raise ValueError(f"silent_probe_seconds: must be > 0, got {self.silent_probe_seconds!r}")
        if not (isinstance(self.local_prefill_tokens, int) and self.local_prefill_tokens >= 0):
            raise ValueError(f"local_prefill_tokens: must be a whole number >= 0, got {self.local_prefill_tokens!r}")
        names = [r.name for r in self.replicas]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"replica: {twice[0]!r} is given twice; each replica once")
        for replica in self.replicas:
            if replica.role not in ROLES:
                raise ValueError(f"role: unknown value {replica.role!r} for {replica.name}; use {', '.join(ROLES)}")
        if self.disaggregated and not any(r.role != "prefill" for r in self.replicas):
            raise ValueError("decode: prefill replicas need a replica that decodes (--decode, or --replica)")
        self._following = False
        self._leaving: set[asyncio.Task] = set()  # replicas on their way out (`remove`)
        self._welcoming: set[asyncio.Task] = set()  # replicas joining: the fleet's pins are copied to them
        self._fetching: set[asyncio.Task] = set()  # asking replicas for the ids of Responses replies relayed
        self._homes_made = itertools.count()  # conversation_home's order of choices
        for replica in self.replicas:
            self._prepare(replica)

    def _prepare(self, replica: Replica) -> None:
        if self.view == "events":
            replica.view = ReplicaView(pending_seconds=self.pending_seconds)
            # its load poll, off the request's path, says when it answers again: a request need
            # hardly ever ask it to find out (each such question costs that request the timeout)
            replica.unanswered.max_seconds = EVENTS_VIEW_MAX_REST_S

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
                         asyncio.create_task(poll_load(
                             replica.client, replica.view, self.load_interval, self.clock, back,
                             lambda asked_at, why: self.went_unanswered(replica, why, asked_at)))]
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
        status, body = await sync_pins(self.replicas, self.ask_each, only=replica.name)
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
        asked_at = self.clock()
        replica.unanswered.asking()
        try:
            answer = await replica.client.post("/admin/route-facts", json={**(question or {"tokens": []}),
                                                                            "tenant": tenant},
                                               timeout=ASK_TIMEOUT_S)
            if answer.status_code in (400, 413, 422):  # the prompt is bad, not the replica: it says so
                replica.last_error = None  # when the request reaches it
                replica.unanswered.answered()
                return ReplicaFacts(0, 0.0, replica.open), 0
            answer.raise_for_status()
            known = kvd_json(answer)
            facts = facts_from_answer(known, replica.open)
            replica.model = known.get("model")
            replica.adapters = list(known.get("adapters") or ())
            replica.drained_there = bool(known.get("draining", False))
            replica.asleep_there = bool(known.get("asleep", False))
            replica.cached_tokens_report = known.get("report_cached_tokens", "all")
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            replica.failed_questions += 1
            self.went_unanswered(replica, described(exc), asked_at)
            return None
        finally:
            replica.unanswered.probing = False  # (answered, or not, or the request's caller left)
        replica.last_error = None
        replica.unanswered.answered()
        return facts, known["prompt_tokens"]

    def went_unanswered(self, replica: Replica, why: str, asked_at: float | None = None) -> None:
        """A question or call asked of the replica at `asked_at` went unanswered (timed out, an
        error), or a request could not be sent to it (refused, or no connection made in time; asked
        and known unanswered at once): it rests (policies/unanswered.py), `why` its last error."""
        replica.last_error = why
        now = self.clock()
        replica.unanswered.failed(now if asked_at is None else asked_at, now)

    def resting(self, replica: Replica, now: float) -> bool:
        """Whether a request passes the replica over unasked (policies/unanswered.py): it left a
        question unanswered lately, and answered nothing since (with the events view, a load poll
        answered since ends the rest, and the run of unanswered questions)."""
        heard_at = replica.view.load_asked_at if replica.view is not None else None
        if heard_at is not None and replica.unanswered.since is not None and heard_at >= replica.unanswered.since:
            replica.unanswered.answered()
        return replica.unanswered.resting(now, heard_at)

    def not_asked(self, replicas: Sequence[Replica]) -> dict[int, str]:
        """The replicas (by id) that a question to the whole fleet (a lookup, a listing, a status)
        passes over now as they rest (`resting`), each with why; none where every one rests (each
        is asked all the same: one may be back). What it gives up is the word of a replica known not
        to answer; what it saves is waiting out that replica's timeout."""
        now = self.clock()
        resting = [r for r in replicas if self.resting(r, now)]
        if len(resting) == len(replicas):
            return {}
        return {id(r): f"not asked: it has answered nothing lately ({r.last_error}); asked again "
                       + (f"in {r.unanswered.seconds_left(now):.0f} s" if not r.unanswered.probing else "once the "
                          "question out to it now is answered") for r in resting}

    async def ask_each(self, replicas: Sequence[Replica], method: str, path: str, content: bytes | None = None,
                       timeout: float = ASK_TIMEOUT_S) -> list[Answer]:
        """The same call to each of `replicas` (fleet_admin.fan_out), passing over those that rest
        unanswering (their rows say so: not reached) rather than waiting out their timeouts, and
        noting what came of each call as a route question's is (`heard`)."""
        return await fan_out(replicas, method, path, content, timeout, self.not_asked(replicas), self.heard)

    def given_up_on(self, replica: Replica, sent_at: float) -> str | None:
        """Why to stop waiting for the answer to a request sent to the replica at `sent_at` (the
        router's clock): its questions have gone unanswered over silent_give_up_seconds, none
        answered between, the latest asked after the request was sent; None: wait on (always, with
        silent_give_up_seconds 0). Asked every half second as the request waits; it asks the replica
        a load poll's question every silent_probe_seconds where no load poll asks it
        (silent_replicas.py)."""
        if not self.silent_give_up_seconds:
            return None
        now = self.clock()
        self.resting(replica, now)  # (a load poll answered since ends the run)
        book = replica.unanswered
        if book.since is not None and book.since >= sent_at and book.silent_seconds() >= self.silent_give_up_seconds:
            return f"answered nothing for {book.silent_seconds():.0f} s ({replica.last_error})"
        if replica.view is None and replica.probe is None and \
                now - max(sent_at, replica.probed_at) >= self.silent_probe_seconds:
            replica.probed_at = now
            replica.probe = asyncio.ensure_future(self._probe(replica))
        return None

    async def _probe(self, replica: Replica) -> None:
        try:
            await self.heard(replica, replica.client.post("/admin/route-facts", json={"tokens": []},
                                                          timeout=ASK_TIMEOUT_S))
        except httpx.HTTPError:
            pass  # (heard noted it)
        finally:
            replica.probe = None

    async def heard(self, replica: Replica, call: Awaitable[T]) -> T:
        """`call`'s answer (a request to `replica`), noted as a route question's is: answered,
        its rest is over; not answered in time, or no connection, it rests (or rests longer)."""
        asked_at = self.clock()
        replica.unanswered.asking()
        try:
            answer = await call
        except httpx.TransportError as exc:
            self.went_unanswered(replica, described(exc), asked_at)
            raise
        finally:
            replica.unanswered.probing = False
        replica.unanswered.answered()
        return answer

    def weigh_locally(self, replica: Replica, question: dict | None, tenant: str | None, now: float,
                      memo: dict) -> Local | None:
        """The replica's facts from its view, or None when the view is not current (feed not
        synced, load not polled lately) and the replica must be asked. `memo` keeps the prompt's
        tokens and keys across replicas that share a tokenizer and a namespace."""
        view = replica.view
        if view is None or not view.synced or view.load is None or view.load_age(now) > self.load_stale_seconds:
            return None
        namespace = view.namespace
        adapter = view.adapters.get(question.get("model")) if question is not None else None
        if adapter is not None:  # a LoRA adapter's blocks: its id in the namespace
            namespace = {**namespace, "adapter_id": adapter}
        tenant = view.tenant_for(tenant)  # as the replica serves it: its kept replies too (router_replies.py)
        if question is None:
            ids = None
        elif "tokens" in question:
            ids = question["tokens"]
        else:
            digest, template_digest = namespace["tokenizer_digest"], view.chat_template
            if ("ids", digest, template_digest, tenant) not in memo:
                tokenizer = self.tokenizers.by_digest.get(digest)
                template = self.tokenizers.templates.get(template_digest) if template_digest else None
                if tokenizer is None or (template_digest is not None and template is None):
                    return None
                replies = None if not self.splices_replies else (
                    lambda text: self.reply_ids.ids_for(tenant, digest, text))
                memo["ids", digest, template_digest, tenant] = local_ids(question, tokenizer, template, replies)
            ids = memo["ids", digest, template_digest, tenant]
        priority = question.get("priority", 0) if question is not None else 0  # (a deferral, question_of's)
        if question is not None and question.get("service_tier") == "flex":  # (a place only a priority queue has)
            priority += FLEX_DEFERRAL
        if not ids:  # no prompt it can read: it goes by load, and the replica says what is wrong
            return Local(view.facts(0, replica.open, tenant=tenant, priority=priority), [], 0)
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
        return Local(view.facts(cached, replica.open, restorable, view.restore_seconds(run), tenant, priority),
                     keys, len(ids))

    @property
    def splices_replies(self) -> bool:
        """Whether the events view renders a chat with the replies it relayed as their ids, as the
        replica prompts it (router_replies.py): not across a KV transfer, where both sides read text."""
        return self.view == "events" and not self.disaggregated and self.reply_ids.keeps

    def _splicing_tokenizer(self, replica: Replica):
        """The replica's tokenizer, where the router keeps replies' ids for it; None where it splices
        none or does not have that tokenizer yet."""
        view = replica.view
        if not self.splices_replies or view is None or not view.namespace:
            return None
        return self.tokenizers.by_digest.get(view.namespace["tokenizer_digest"])

    def reply_watch(self, replica: Replica, tenant: str | None) -> ReplyWatch | None:
        """A reader of the chat answer `replica` gives `tenant`'s request, which keeps its replies'
        ids; None where `_splicing_tokenizer` is."""
        tokenizer = self._splicing_tokenizer(replica)
        return None if tokenizer is None else ReplyWatch(
            keeper(self.reply_ids, tokenizer, replica.view.tenant_for(tenant)))

    def response_reply_watch(self, replica: Replica, tenant: str | None) -> ResponseReplyWatch | None:
        """A reader of the Responses answer `replica` gives `tenant`'s request: once it is whole, the
        router asks the replica, in the background, for the ids it keeps of its replies and keeps them
        (router_replies.py); None where `reply_watch` would be."""
        tokenizer = self._splicing_tokenizer(replica)
        if tokenizer is None:
            return None
        served = replica.view.tenant_for(tenant)

        def ask(texts: list[str]) -> None:
            task = asyncio.get_running_loop().create_task(self._fetch_reply_ids(replica, served, tokenizer, texts))
            self._fetching.add(task)
            task.add_done_callback(self._fetching.discard)
        return ResponseReplyWatch(ask)

    @property
    def reply_ids_asked(self) -> int:
        """Questions for the ids of Responses replies relayed not answered yet (`response_reply_watch`)."""
        return len(self._fetching)

    async def _fetch_reply_ids(self, replica: Replica, tenant: str, tokenizer, texts: list[str]) -> None:
        """Keep the ids `replica` keeps of `tenant`'s replies `texts`, where its tokenizer is the one
        the router renders its prompts with. A replica that cannot say (an older kvd's 404, an error,
        no answer in time) leaves them read as text."""
        try:
            answer = await replica.client.post("/admin/reply-ids", json={"tenant": tenant, "texts": texts},
                                               timeout=ASK_TIMEOUT_S)
            body = answer.json() if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("replica %s did not give reply ids: %s", replica.name, described(exc))
            return
        if not isinstance(body, dict) or body.get("tokenizer_digest") != tokenizer.digest \
                or not isinstance(body.get("ids"), list):
            return
        keep = keeper(self.reply_ids, tokenizer, tenant)
        for text, ids in zip(texts, body["ids"]):
            if isinstance(ids, list) and ids and token_ids(ids):
                keep(ids, text)

    @property
    def disaggregated(self) -> bool:
        """Whether prompts are computed at prefill replicas and decoded at others (router.py)."""
        return any(r.role == "prefill" for r in self.replicas)

    def not_for(self, phase: str) -> set[int]:
        """The id()s of the replicas whose role is not for `phase`: "prefill" is for prefill
        replicas alone; "whole" (a request, or its decode) for the others."""
        return {id(r) for r in self.replicas if (r.role == "prefill") != (phase == "prefill")}

    async def local_prefill(self, body: dict, tenant: str | None) -> tuple[str | None, Weighed | None]:
        """Disaggregated: why the replica that decodes this request computes its prompt itself
        (X-KVD-Prefill's "local: ..."), or None when a prefill replica is to. Local when a replica
        that decodes would compute `local_prefill_tokens` of it or fewer (the prompt less what it
        holds in any tier: a short prompt, or a conversation's next turn), as Dynamo's conditional
        disaggregation decides, and for a request that scores its whole prompt (it is computed
        whole where it decodes anyway). LookupError, as `choose`'s, when no replica decodes it.

        Also the weighing of the replicas that decode, where it was made and is the one `choose`
        makes next (local: nothing has changed there since; the `weighed` it takes), else None
        (a prefill replica computes the prompt first, and they hold it after)."""
        if computes_whole_prompt(body):
            return "local: the request scores its whole prompt", None
        started = time.perf_counter()
        weighing = await self.weigh(body, question_of(body), tenant, self.not_for("whole"))
        uncached = min(max(tokens - facts.held_tokens, 0) for _, facts, tokens in weighing[0])
        if uncached <= self.local_prefill_tokens:
            return f"local: {uncached} prompt tokens to compute at the decode replica", (weighing, started)
        return None, None

    async def choose(self, body: dict, tenant: str | None, excluded: set[int] = frozenset(),
                     phase: str = "whole", weighed: Weighed | None = None, timed_out: bool = False,
                     exemplar: dict | None = None) -> tuple[Replica, str]:
        """The replica for this request, and why; replicas whose id() is in `excluded` (they
        refused it already) are not weighed, nor those whose role is not for `phase` ("prefill":
        prefill replicas alone; "whole", a request or its decode: the others). LookupError when
        none can take it. `weighed`: the replicas weighed for this request a moment ago, with
        nothing excluded but by `phase` (`local_prefill`'s), so that none is asked twice; the
        choice's time (on_decision) then counts from that weighing's start. `timed_out`: a replica
        turned it away for its wait (queue_timeout): a policy heeding queue limits sends it on only
        to a replica predicted to start it in time (NoneInTime when none is). `exemplar`: the
        route span's ids, which the choice's time carries to /metrics (RouteSpan.exemplar)."""
        started = time.perf_counter() if weighed is None else weighed[1]
        excluded = set(excluded) | self.not_for(phase)
        try:
            return await self._choose(body, tenant, excluded, None if weighed is None else weighed[0], timed_out)
        finally:
            self.on_decision(time.perf_counter() - started, exemplar)

    async def weigh(self, body: dict, question: dict | None, tenant: str | None, excluded: set[int] = frozenset()
                    ) -> Weighing:
        """Every replica that could take the request, as the policy weighs it: (index, facts,
        prompt tokens it counted) from its view or by asking it, serving the model the body names;
        `question`: the body's prompt as `question_of` reads it. Also each replica's local
        weighing (None where asked), the clock reading used and the replicas as they were then.
        LookupError (ModelNotServed) when none can."""
        now, memo, replicas = self.clock(), {}, self.replicas
        excluded = set(excluded) | {id(r) for r in replicas if r.known_draining}  # one asked says so itself
        passed = excluded | self.passed_resting(replicas, excluded, now)  # (their errors still say why none)

        def weigh_all() -> list[Local | None]:
            return [self.weigh_locally(r, question, tenant, now, memo) if id(r) not in passed else None
                    for r in replicas]

        large = question_size(question) > LARGE_PROMPT
        # a long prompt is tokenized and hashed off the event loop that streams every answer
        local = await asyncio.to_thread(weigh_all) if large else weigh_all()
        asked = await asyncio.gather(*(self.ask(r, question, tenant) for r, known in zip(replicas, local)
                                       if known is None and id(r) not in passed))
        answers = iter(asked)
        facts = [None if id(r) in passed else (known.facts, known.prompt_tokens) if known is not None
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
            serving = [entry for entry in live if (names := self.models_of(replicas[entry[0]])) is None
                       or wanted in names]
            if not serving:
                served = sorted({m for r in replicas for m in self.models_of(r) or ()})
                raise ModelNotServed(f"model: {wanted!r} is not served by any replica; GET /v1/models lists "
                                     + ", ".join(repr(m) for m in served))
            live = serving
        return live, local, now, replicas

    def answered_with(self, replica: Replica, status: int, why: str) -> None:
        """What a request forwarded to the replica came to: a failure of its own (a 500; a stream's
        error event engine_error) counts toward passing it over (`failing`), `why` its last error;
        any other answer (a 4xx too: it works) ends the run."""
        if status >= 500:
            now = self.clock()
            replica.failing.failed(now, now)
            replica.last_error = why
        else:
            replica.failing.answered()

    def failing(self, replica: Replica, now: float) -> bool:
        """Whether requests pass the replica over as its answers fail: its last FAILING_AFTER or
        more were its own failures (500s: its engine failing every step, say), and its rest is not
        over. A replica that fails at once answers fastest: least-loaded routing would send it the
        most. After the rest, requests go there again; one answered ends it."""
        return replica.failing.resting(now)

    def passed_resting(self, replicas: list[Replica], excluded: set[int], now: float) -> set[int]:
        """The ids of the replicas a request passes over as they rest (`resting`, or `failing`),
        counted, unless every one it could go to rests: then none is passed over (asked, one may be
        back). Prefill replicas resting are passed over all the same: no request needs one (the
        replica that decodes it computes its prompt instead)."""
        resting = [r for r in replicas if id(r) not in excluded and (self.resting(r, now) or self.failing(r, now))]
        if not resting or (len(resting) == sum(id(r) not in excluded for r in replicas)
                           and any(r.role != "prefill" for r in resting)):
            return set()
        for replica in resting:
            replica.skipped_questions += 1
        return {id(r) for r in resting}

    def replica_keeping(self, response_id) -> Replica | None:
        """The replica of the fleet that answered `response_id` (/v1/responses), which alone keeps
        it; None where the router does not know it, or that replica has left the fleet."""
        name = self.response_homes.home(response_id)
        return next((r for r in self.replicas if r.name == name), None) if name is not None else None

    async def find_keeper(self, response_id, tenant: str | None, kind: str = "responses") -> Replica | None:
        """The replica that keeps `response_id`: the one the router saw answer it, else the first
        replica to say it keeps it for `tenant` (`GET /v1/responses/{id}`, asked of all at once),
        then noted as its home. A router learns homes from the answers it forwards, so one
        that restarted, or the other routers of a fleet, find a conversation's home this way.
        `kind` "conversations": a conversation's (`GET /v1/conversations/{id}`), "files" a file's,
        "batches" a batch's, noted in the same book. None where none keeps it (for that tenant).
        Every replica of the fleet is asked (a drained one may keep it), but those resting
        unanswering (`not_asked`); KeeperUnavailable where none said it keeps it and some could
        not say (not asked, no answer, an error): the one that keeps it may be among them, and a
        404 would tell the caller it is gone."""
        known = self.replica_keeping(response_id)
        if known is not None or not isinstance(response_id, str):
            return known
        path = f"/v1/{kind}/{quote(response_id, safe='')}"
        headers = {"X-KVD-Tenant": tenant} if tenant is not None else {}
        passed = self.not_asked(self.replicas)
        unsure = [f"{r.name} ({passed[id(r)]})" for r in self.replicas if id(r) in passed]

        async def keeps(replica: Replica) -> Replica | None:
            try:
                answer = await self.heard(replica, replica.client.get(path, headers=headers, timeout=ASK_TIMEOUT_S))
            except httpx.HTTPError as exc:
                unsure.append(f"{replica.name} ({described(exc)})")
                return None
            if answer.status_code not in (200, 404):  # (404: it keeps none of that id for the tenant)
                unsure.append(f"{replica.name} (answered {answer.status_code})")
            return replica if answer.status_code == 200 else None

        # the first that says so, without waiting on the others (one that hangs would hold the answer
        # its whole timeout); the questions still out are cancelled
        asked = [asyncio.ensure_future(keeps(r)) for r in self.replicas if id(r) not in passed]
        try:
            for answered in asyncio.as_completed(asked):
                replica = await answered
                if replica is not None:
                    self.response_homes.note(response_id, replica.name)
                    return replica
            if unsure:
                raise KeeperUnavailable(f"{KEPT_NOUNS[kind]} {response_id!r} is kept at no replica that answered; "
                                        f"{'; '.join(unsure)} could not say whether it keeps it: try again later")
            return None
        finally:
            for question in asked:
                question.cancel()
            await asyncio.gather(*asked, return_exceptions=True)

    async def previous_home(self, body: dict, tenant: str | None, excluded: set[int] = frozenset()) -> Replica | None:
        """The replica that keeps the response a Responses request continues (its
        `previous_response_id`), or the conversation (its `conversation`), found as `find_keeper`
        finds it; None where the request continues none, or none keeps it. KeeperUnavailable where
        that replica has refused this request (`excluded`: its refusal is the answer), takes no
        requests now, or rests unanswering: no other replica keeps it, so sending it elsewhere
        would only have it refused there as unknown (a 404 for what exists)."""
        previous = body.get("previous_response_id")
        talk = body.get("conversation")
        talk = talk.get("id") if isinstance(talk, dict) else talk
        try:
            replica = (await self.find_keeper(previous, tenant) if previous is not None else
                       await self.find_keeper(talk, tenant, "conversations") if isinstance(talk, str) else None)
        except KeeperUnavailable as exc:  # (none said it keeps it, and some could not say)
            raise KeeperUnavailable(f"{'previous_response_id' if previous is not None else 'conversation'}: {exc}")
        if replica is None:
            return None
        keeper = (f"previous_response_id: {previous!r} is kept at {replica.name}" if previous is not None
                  else f"conversation: {talk!r} is kept at {replica.name}")
        if id(replica) in excluded:
            raise KeeperUnavailable(f"{keeper} alone, which refused the request")
        if not replica.takes_requests:
            raise KeeperUnavailable(f"{keeper} alone, which takes no new request now (draining); try again once "
                                    "it is resumed")
        if self.resting(replica, self.clock()):
            raise KeeperUnavailable(f"{keeper} alone, which does not answer now ({replica.last_error}); try again "
                                    "later")
        return replica

    def answering(self, replica: Replica) -> bool:
        """Whether the replica's latest word says it answers: with the events view, a load poll
        answered lately; with ask, its last question or request reached it."""
        if replica.view is not None:
            age = replica.view.load_age(self.clock())
            return age is not None and age <= self.load_stale_seconds
        return replica.unanswered.since is None

    def conversation_home(self, excluded: set[int] = frozenset()) -> Replica | None:
        """The replica a new conversation is made at (`POST /v1/conversations`): of those taking
        requests (and not `excluded`: ids of replicas already tried), one that answers
        (`answering`) before one that does not, then the one with the fewest of this router's
        requests open now, then the one that made a conversation least recently; its turns all go
        there after. (Not the one sent the fewest so far: a replica that joined later took every
        new conversation until it had caught up. Nor a replica that went down first: with no
        request open there, it drew every new conversation.) None when none is left."""
        replicas = [r for r in self.replicas if r.takes_requests and r.role != "prefill" and id(r) not in excluded]
        if not replicas:
            return None
        replica = min(replicas, key=lambda r: (not self.answering(r), r.open, r.homed_at))
        replica.sent += 1
        replica.homed_at = next(self._homes_made)
        return replica

    async def _choose(self, body: dict, tenant: str | None, excluded: set[int],
                      weighed: Weighing | None, timed_out: bool = False) -> tuple[Replica, str]:
        home = await self.previous_home(body, tenant, excluded)
        if home is not None:
            home.sent += 1
            if body.get("previous_response_id") is None:
                return home, "it keeps the conversation this one continues (conversation)"
            return home, "it keeps the response this one continues (previous_response_id)"
        question = question_of(body)
        live, local, now, replicas = weighed or await self.weigh(body, question, tenant, excluded)
        live = reusing(body, live)
        if timed_out and none_in_time(self.router, [f for _, f, _ in live]):
            self.timeouts_not_rerouted += 1
            raise NoneInTime("every other replica's predicted wait is past its max_queue_wait: " + ", ".join(
                f"{replicas[i].name} ({f.wait_seconds:.2f} s, limit {f.max_wait_seconds:g} s)" for i, f, _ in live))
        prompt_tokens = max(tokens for _, _, tokens in live)
        chosen = self.router.choose(prompt_tokens, [f for _, f, _ in live], affinity_of(question))
        index, facts, counted = live[chosen.replica]
        for passed in chosen.passed_over:
            replicas[live[passed][0]].passed_over += 1
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
        live, local, _, replicas = await self.weigh(body, question, tenant, self.not_for("whole"))
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
                                or ("did not answer" if replica.role == "prefill" else "serves another model"))
            rows.append(row)
        settings = {"prefill_rate": getattr(self.router, "prefill_rate", 20_000.0),
                    "balance_seconds": getattr(self.router, "balance_seconds", 2.0),
                    "new_prefix": getattr(self.router, "new_prefix", "home"),
                    "new_prefix_slack": getattr(self.router, "new_prefix_slack", NEW_PREFIX_SLACK_TOKENS),
                    "queue_limits": getattr(self.router, "queue_limits", "heed")}
        routes = {}
        for name in policies:
            policy = copy.deepcopy(self.router) if name == self.router.name else make_router(name, **settings)
            chosen = policy.choose(prompt_tokens, [f for _, f, _ in live], affinity)
            routes[name] = {"replica": replicas[live[chosen.replica][0]].name, "reason": chosen.reason}
        answer = {"prompt_tokens": prompt_tokens, "routing": self.router.name, "replicas": rows, "routes": routes}
        if self.disaggregated:
            answer["prefill"] = await self._prefill_what_if(body, question, tenant, rows)
        return answer

    async def _prefill_what_if(self, body: dict, question: dict | None, tenant: str | None, rows: list[dict]) -> dict:
        """Where the live policy would compute the request's prompt (the prefill replica, and
        why), or why the replica that decodes it would; each prefill replica's row gets its facts."""
        try:
            live, local, _, replicas = await self.weigh(body, question, tenant, self.not_for("prefill"))
        except LookupError as exc:
            live, local, replicas, why = [], [], self.replicas, str(exc)
        for index, facts, _ in live:
            rows[index].pop("error", None)
            rows[index].update(asdict(facts), source="view" if local[index] is not None else "asked")
        for row, replica in zip(rows, replicas):
            if replica.role != "both":
                row["role"] = replica.role
        reason, _ = await self.local_prefill(body, tenant)
        if reason is not None:
            return {"replica": None, "reason": reason}
        if not live:
            return {"replica": None, "reason": f"none: {why}; the decode replica computes the whole prompt"}
        chosen = copy.deepcopy(self.router).choose(max(t for _, _, t in live), [f for _, f, _ in live],
                                                   affinity_of(question))
        return {"replica": replicas[live[chosen.replica][0]].name, "reason": chosen.reason}

    def gave_up(self, routed_at: float) -> None:
        """A request no replica took in, routed (or refused) at `routed_at` (Unix time)."""
        self.unrouted += 1
        self.untraced.append(routed_at)

    @staticmethod
    def models_of(replica: Replica) -> list[str] | None:
        """The models a replica serves, as its latest answer (a load poll or a question) said: its
        model, then its LoRA adapters; None when it has not said."""
        if replica.view is not None and replica.view.model is not None and replica.view.synced:
            return [replica.view.model, *replica.view.adapters]
        return None if replica.model is None else [replica.model, *replica.adapters]

    def status(self) -> dict:
        now = self.clock()

        def one(r: Replica) -> dict:
            row = {"replica": r.name, "sent": r.sent, "open": r.open, "last_error": r.last_error}
            if r.role != "both":
                row["role"] = r.role
            if not r.takes_requests:  # leaving: it goes once `open` is 0; "at the replica": kvctl drain there
                row["draining"] = "leaving" if r.leaving else "drained" if r.draining else \
                    "asleep" if r.asleep else "at the replica"
            if r.welcomed is not None:
                row["welcomed"] = r.welcomed
            if r.passed_over:  # sent elsewhere for a predicted wait past its max_queue_wait
                row["passed_over"] = r.passed_over
            if r.given_up:  # requests it had, given up as it went silent (silent_replicas.py)
                row["given_up"] = r.given_up
            if self.resting(r, now):  # passed over unasked: it answered none of its latest questions
                row["resting"] = {"unanswered_in_a_row": r.unanswered.in_a_row,
                                  "seconds_left": round(r.unanswered.seconds_left(now), 3)}
            if self.failing(r, now):  # passed over: its latest answers were failures of its own
                row["failing"] = {"failed_in_a_row": r.failing.in_a_row,
                                  "seconds_left": round(r.failing.seconds_left(now), 3)}
            if r.view is not None:
                age = r.view.load_age(now)
                row["view"] = {"synced": r.view.synced, "seq": r.view.seq, "device_keys": len(r.view.keys),
                               "lower_tier_keys": {tier: len(keys) for tier, keys in r.view.lower.items()},
                               "pending_keys": r.view.pending_count(now),
                               "load_age_seconds": None if age is None else round(age, 3),
                               "feed_error": r.feed_error}
            return row

        body = {"routing": self.router.name, "view": self.view, "software": router_versions(),
                "replicas": [one(r) for r in self.replicas],
                "silent_give_up_seconds": self.silent_give_up_seconds,
                "gc": self.gc_pauses.report(),
                "tls": None if self.tls is None else self.tls.describe(time.time()),
                "trusted_proxy": self.trusted_proxy,
                "fleet_rollout_watch": self.rollout_watch.report()}
        if self.splices_replies:  # the chat replies' ids the events view weighs next turns with
            body["reply_ids"] = self.reply_ids.figures()
        if self.timeouts_not_rerouted:  # queue timeouts with no other replica in time
            body["timeouts_not_rerouted"] = self.timeouts_not_rerouted
        if self.disaggregated:
            body["disaggregated"] = dict(self.pd_outcomes)
        return body
