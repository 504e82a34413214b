"""OpenAI's Batch API (`/v1/batches`): a file of requests that kvd serves while its caller is
away, writing each answer to an output file the caller fetches when the batch has ended.

A batch is `validating` while its input file is read (a faulty file fails it whole, each fault
named: batch_lines.py), `in_progress` while its lines are served, `finalizing` while its output
and error files are written, then `completed`; `cancelling` then `cancelled` when its caller (or
an operator) cancels it, `expired` where its completion window (24 h) passes first. Lines are
served through kvd's own API as the batch's tenant, as if each came over the socket, with
`service_tier: "flex"` where the line names no tier (under a priority queue, behind what callers
wait for); `batch_concurrency` lines at a time across all batches, taken from each tenant in turn
and each of its running batches in turn, each batch's in the order of its prompts (lines that begin alike one after another).

What a batch has served is appended to `state_dir/batches/<id>.done.jsonl` as each line ends, and
the batch itself (`<id>.json`) is written whole at each change of status: after a restart, kvd
serves what was left of each batch it had not finished. A line answered 429 or 503 (a full queue,
kvd asleep, draining or stopping) is not written: it is served again later, not counted failed.

A running batch keeps in memory where each line lies in its input file (batch_lines.py), which
lines are answered, and their counts and tokens: not their bodies (read from the input file as
each is served) nor their answers (in the done file, from which the output and error files are
written in the input's order when the batch ends, a record at a time).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from kvctl.daemon.whole_file import write_json_whole, write_whole

from .batch_files import FileError, FileStore
from .batch_via import VIA_CHECK_S, ViaRouter, refusal
from .log_throttle import EveryFewSeconds
from .replica_errors import described
from .batch_lines import ENDPOINTS, BatchLine, prompt_order, read_body, read_lines

log = logging.getLogger("kvd")

WINDOWS = {"24h": 86_400}  # OpenAI's only completion window
RETRY_S = 1.0  # a line answered 429 or 503 is served again after this
SERVED_AGAIN = (429, 503)  # a full queue, kvd asleep, draining or stopping: not the line's fault
VIA_SERVED_AGAIN = (*SERVED_AGAIN, 502, 504)  # through kvd router, also a replica that failed or went silent
# through a router's TCP front, also its refusal of kvd's token (rotated there, its role changed): asked again
TOKEN_REFUSED = (401, 403)
VIA_CONNECT_S = 5.0  # to connect to the router (a router down: the line is served again later)
ENDED = ("completed", "failed", "expired", "cancelled")
STATUSES = ("validating", "in_progress", "finalizing", "cancelling", *ENDED)
ACTIVE = ("in_progress", "finalizing", "cancelling")  # what the supervisor serves or ends
STAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")
TOKENS = ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens")  # what a batch's usage sums


def answered_2xx(answer: dict) -> bool:
    """An output record (OpenAI's: custom_id, response, error) of a request answered 2xx."""
    return answer["response"] is not None and 200 <= answer["response"]["status_code"] < 300


def answer_tokens(answer: dict) -> tuple[int, int, int, int]:
    """The TOKENS of an output record answered 2xx (a chat's or completion's usage, or a
    response's); zeros for one that says none."""
    usage = answered_2xx(answer) and isinstance(answer["response"]["body"], dict) and \
        answer["response"]["body"].get("usage")
    if not isinstance(usage, dict):
        return 0, 0, 0, 0
    given, made = ("input", "output") if "input_tokens" in usage else ("prompt", "completion")  # (a response's)
    return (usage.get(f"{given}_tokens") or 0, usage.get(f"{made}_tokens") or 0,
            (usage.get(f"{given}_tokens_details") or {}).get("cached_tokens") or 0,
            (usage.get(f"{made}_tokens_details") or {}).get("reasoning_tokens") or 0)


def done_records(path: Path):
    """(offset, bytes, record or None) of each line of a done file, in its order: None where the
    line is not a whole record (one a crash cut short). Nothing where there is no file."""
    if not path.exists():
        return
    with open(path, "rb") as rows:
        offset = 0
        for raw in rows:
            start, offset = offset, offset + len(raw)
            try:
                record = json.loads(raw)
                whole = isinstance(record, dict) and isinstance(record.get("line"), int)
                answered_2xx(record)  # (KeyError or TypeError where it is not an output record)
            except (ValueError, KeyError, TypeError):
                whole = False
            yield start, raw, record if whole and raw.endswith(b"\n") else None


def keep_whole_records(done: Path, into: Path) -> None:
    """Write `done`'s whole records into `into` (done_records), dropping those a crash cut short."""
    with open(into, "wb") as kept:
        for _, raw, record in done_records(done):
            if record is not None:
                kept.write(raw)


class BatchError(FileError):
    """A batch request that cannot be met (`status` 400, 404 or 409, `param` the field at fault)."""


@dataclass
class Batch:
    """One batch: what OpenAI's batch object says, and what kvd needs to serve the rest."""

    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict
    created_at: int
    expires_at: int
    status: str = "validating"
    stamps: dict = field(default_factory=dict)  # status -> when it began (STAMPS)
    errors: list = field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    total: int = 0
    ending: str | None = None  # what it ends as, once finalizing
    final: dict | None = None  # its request_counts and usage once ended (its answers are in its files then)
    output_expiry: int | None = None  # seconds its output and error files are kept (output_expires_after)
    told: bool = True  # its end's webhook written down (False from its ended record until it is: BatchRunner._end)
    # what serving it keeps in memory (not written: the done file and the input say it again)
    lines: list[BatchLine] = field(default_factory=list, repr=False)  # in the order they are served
    done: set[int] = field(default_factory=set, repr=False)  # the line numbers answered (their records: the done file)
    answered: dict = field(default_factory=lambda: {"completed": 0, "failed": 0, **dict.fromkeys(TOKENS, 0)},
                           repr=False)  # of those: how many 2xx and not, and the TOKENS of those 2xx
    next_line: int = 0  # in `lines`
    in_flight: int = 0
    retry: list[BatchLine] = field(default_factory=list, repr=False)  # answered 429/503: served again
    retry_at: float = 0.0

    def record(self) -> dict:
        return {"id": self.id, "tenant": self.tenant, "endpoint": self.endpoint, "input_file_id": self.input_file_id,
                "completion_window": self.completion_window, "metadata": self.metadata, "created_at": self.created_at,
                "expires_at": self.expires_at, "status": self.status, "stamps": self.stamps, "errors": self.errors,
                "output_file_id": self.output_file_id, "error_file_id": self.error_file_id, "total": self.total,
                "ending": self.ending, "final": self.final, "output_expiry": self.output_expiry, "told": self.told}

    @classmethod
    def from_record(cls, record: dict) -> "Batch":
        return cls(**record)

    @property
    def counts(self) -> dict:
        if self.final is not None:
            return self.final["request_counts"]
        return {"total": self.total, "completed": self.answered["completed"], "failed": self.answered["failed"]}

    def count(self, number: int, answer: dict) -> None:
        """Line `number` answered with `answer` (its output record)."""
        self.done.add(number)
        self.answered["completed" if answered_2xx(answer) else "failed"] += 1
        for name, tokens in zip(TOKENS, answer_tokens(answer)):
            self.answered[name] += tokens

    def public(self) -> dict:
        """The batch object OpenAI's API answers."""
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint, "model": None,
                "errors": {"object": "list", "data": self.errors} if self.errors else None,
                "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "expires_at": self.expires_at,
                **{stamp: self.stamps.get(stamp) for stamp in STAMPS},
                "request_counts": self.counts, "usage": self.usage(), "metadata": self.metadata or None}

    def usage(self) -> dict:
        """Tokens of the requests answered so far, in the Batch API's names (cached_tokens: prompt
        tokens the prefix cache served, where kvd reports them to the tenant)."""
        if self.final is not None:
            return self.final["usage"]
        totals = self.answered
        return {"input_tokens": totals["prompt_tokens"], "output_tokens": totals["completion_tokens"],
                "total_tokens": totals["prompt_tokens"] + totals["completion_tokens"],
                "input_tokens_details": {"cached_tokens": totals["cached_tokens"]},
                "output_tokens_details": {"reasoning_tokens": totals["reasoning_tokens"]}}

    def pending(self) -> bool:
        """Lines are left to hand out (now or once their retry is due)."""
        while self.next_line < len(self.lines) and self.lines[self.next_line].number in self.done:
            self.next_line += 1  # (served before a restart)
        return self.next_line < len(self.lines) or bool(self.retry)


class BatchRunner:
    """Every tenant's batches, served `concurrency()` lines at a time through `lines_app` (kvd's
    Unix-socket app: its tenant header names each batch's tenant), or where `via()` names a kvd
    router, through that router: it spreads them across its fleet by their prompts, the tenant
    header passed on to the replica (batch_via.py: over TCP, only by a router that says it does)."""

    def __init__(self, folder: str | Path, files: FileStore, concurrency: Callable[[], int],
                 clock: Callable[[], float] = time.time, via: Callable[[], ViaRouter | None] = lambda: None,
                 on_end: Callable[["Batch"], object] = lambda batch: None) -> None:
        self.folder = Path(folder)
        self.files = files
        self.concurrency = concurrency
        self.clock = clock
        self.via = via
        self.on_end = on_end  # told of each batch that ends (its webhook), from any thread
        self.unsent_warnings = EveryFewSeconds(log)  # (a router down: one line a few seconds, not one a request)
        self.transport_to = lambda via: via.transport()  # (to the router: tests swap it)
        self.via_checked: dict[ViaRouter, float] = {}  # a URL router's latest word that it serves as the tenant
        # why lines are not going through the router, since when (Unix time): from the first line it did not
        # take (down, or over TCP not serving lines as their tenant) to the next it answered; None: they go
        self.unsent: dict | None = None
        self.lines_app = None  # set by create_app(front="unix")
        self.stopping = False  # kvd is stopping: no line is handed out
        self.batches: dict[str, Batch] = {}
        self.served = {"completed": 0, "failed": 0}  # lines, since kvd started
        self._supervisor: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        if self.folder.is_dir():
            self._load()

    # ---- what callers ask ----------------------------------------------------------------
    def create(self, tenant: str, input_file_id: Any, endpoint: Any, completion_window: Any,
               metadata: dict, output_expiry: int | None = None, elsewhere: int = 0) -> Batch:
        """A batch of `tenant`'s file, validated (a faulty file gives a `failed` batch, as OpenAI's
        does); BatchError for a request that names no such file, endpoint or window.
        `output_expiry`: seconds its output and error files are kept once written (None: until deleted);
        `elsewhere`: bytes of the tenant's files at the fleet's other replicas (FileStore.over_budget)."""
        if endpoint not in ENDPOINTS:
            raise BatchError(f"endpoint: kvd serves batches of {', '.join(ENDPOINTS)}, got {endpoint!r}",
                             "endpoint")
        if completion_window not in WINDOWS:
            raise BatchError(f"completion_window: must be one of {', '.join(WINDOWS)}, got {completion_window!r}",
                             "completion_window")
        source = self.files.get(tenant, input_file_id, "input_file_id")
        if source.purpose != "batch":
            raise BatchError(f"input_file_id: file {input_file_id!r} was uploaded for {source.purpose!r}; a batch's "
                             "input is uploaded with purpose 'batch'", "input_file_id")
        no_room = self.files.no_room_for_output(tenant, elsewhere)
        if no_room is not None:
            raise no_room
        now = int(self.clock())
        batch = Batch("batch_" + uuid.uuid4().hex, tenant, endpoint, source.id, completion_window, metadata, now,
                      now + WINDOWS[completion_window], output_expiry=output_expiry)
        with open(self.files.data_path(source.id), "rb") as content:
            lines, faults = read_lines(content, endpoint)
        if faults:
            batch.errors, batch.status, batch.stamps["failed_at"], batch.told = faults, "failed", now, False
        else:
            batch.total = len(lines)
            batch.lines = prompt_order(lines)
            batch.status, batch.stamps["in_progress_at"] = "in_progress", now
        self._save(batch)
        self.batches[batch.id] = batch
        if batch.status == "failed":
            self._end(batch)
        self._kick()
        return batch

    def get(self, tenant: str | None, batch_id: Any) -> Batch:
        """`tenant`'s batch (None: any tenant's, for an operator); a 404 BatchError where there is none."""
        batch = self.batches.get(batch_id) if isinstance(batch_id, str) else None
        if batch is None or tenant not in (None, batch.tenant):
            raise BatchError(f"batch_id: no batch {batch_id!r} is kept here", "batch_id", 404)
        return batch

    def listed(self, tenant: str | None) -> list[Batch]:
        """`tenant`'s batches (None: every tenant's), the latest first."""
        return sorted([b for b in list(self.batches.values()) if tenant in (None, b.tenant)],
                      key=lambda b: (b.created_at, b.id), reverse=True)

    def cancel(self, tenant: str | None, batch_id: Any) -> Batch:
        """Hand out no more of its lines; it ends `cancelled` once those being served end (their
        answers are in its output file)."""
        batch = self.get(tenant, batch_id)
        if batch.status in ENDED or batch.status == "finalizing":
            raise BatchError(f"batch_id: batch {batch_id!r} has {'ended' if batch.status in ENDED else 'been served'} "
                             f"({batch.status}); only a batch that has not can be cancelled", "batch_id", 409)
        if batch.status != "cancelling":
            batch.status, batch.stamps["cancelling_at"] = "cancelling", int(self.clock())
            self._save(batch)
        self._kick()
        return batch

    def figures(self) -> dict:
        """Batches by status, the requests of those running not yet answered, and the requests
        answered since kvd started (metrics.py)."""
        by_status = dict.fromkeys(STATUSES, 0)
        for batch in list(self.batches.values()):
            by_status[batch.status] += 1
        waiting = sum(batch.total - len(batch.done) for batch in list(self.batches.values())
                      if batch.status == "in_progress")
        return {"batches": by_status, "waiting": waiting, "served": dict(self.served)}

    def holds_input(self, file_id: str) -> Batch | None:
        """The batch not yet ended that reads `file_id` (which deleting it would lose)."""
        return next((b for b in list(self.batches.values()) if b.input_file_id == file_id and b.status not in ENDED),
                    None)

    # ---- serving --------------------------------------------------------------------------
    def start(self) -> None:
        """Serve what is left of each batch, on the running event loop (at kvd's start, and at each
        new batch: a loop that has ended takes its supervisor with it)."""
        self._kick()

    def _kick(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # (no loop: kvd's start serves what is left)
        if self._supervisor is None or self._supervisor.done() or self._supervisor.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._supervisor = loop.create_task(self._supervise())
        self._wake.set()

    async def _supervise(self) -> None:
        serving: set[asyncio.Task] = set()
        clients: dict[ViaRouter | None, httpx.AsyncClient] = {}  # by where lines go: None, here; else a router

        def client_for(via: ViaRouter | None) -> httpx.AsyncClient:
            if via not in clients:
                timeout = httpx.Timeout(None, connect=VIA_CONNECT_S)
                clients[via] = via.client(self.transport_to(via), timeout) if via is not None else \
                    httpx.AsyncClient(transport=httpx.ASGITransport(app=self.lines_app, raise_app_exceptions=False),
                                      base_url="http://kvd-batch", timeout=timeout)  # (a 500, answered)
            return clients[via]

        try:
            while True:
                await self._settle()
                if not serving and not any(b.status in ACTIVE for b in list(self.batches.values())):
                    self.unsent = None  # (no line waits to go)
                    return  # (nothing to serve: the next batch, or cancel, starts another)
                while len(serving) < max(1, self.concurrency()) and not self.stopping:
                    taken = self._next()
                    if taken is None:
                        break
                    via = self.via()
                    task = asyncio.create_task(self._serve(client_for(via), *taken, via))
                    # (a callback: it runs for a task cancelled before it started too, as at kvd's stop)
                    task.add_done_callback(lambda _, batch=taken[0]: self._ended_one(batch))
                    serving.add(task)
                wake = self._wake
                wake.clear()
                waits = serving | {asyncio.create_task(wake.wait())}
                done, _ = await asyncio.wait(waits, timeout=RETRY_S, return_when=asyncio.FIRST_COMPLETED)
                serving -= done
                for task in waits - serving - done:
                    task.cancel()
        finally:
            for client in clients.values():
                await client.aclose()

    def _next(self) -> tuple[Batch, BatchLine] | None:
        """The next line to serve, from each tenant in turn, then each of its batches (the tenant
        with fewest lines in flight first, then its batch with fewest): a tenant that sends ten
        batches takes no more of batch_concurrency than one that sends one."""
        now = self.clock()
        running = [b for b in list(self.batches.values()) if b.status == "in_progress" and now < b.expires_at]
        tenants_in_flight = Counter()
        for batch in running:
            tenants_in_flight[batch.tenant] += batch.in_flight
        for batch in sorted(running, key=lambda b: (tenants_in_flight[b.tenant], b.in_flight)):
            if not batch.pending():
                continue
            if batch.retry and batch.retry_at <= now:
                line = batch.retry.pop(0)
            elif batch.next_line < len(batch.lines):
                line = batch.lines[batch.next_line]
                batch.next_line += 1
            else:
                continue
            batch.in_flight += 1
            return batch, line
        return None

    async def _serve(self, client: httpx.AsyncClient, batch: Batch, line: BatchLine, via: ViaRouter | None = None
                     ) -> None:
        request_id = "batch_req_" + uuid.uuid4().hex
        try:
            body = self._body(batch, line)  # (a line's bytes from a local file: read on the loop, as httpx sends them)
        except (OSError, ValueError, KeyError) as exc:  # (its input changed under it: not expected)
            log.error("batch %s: line %d could not be read from its input file again (%s)", batch.id, line.number,
                      type(exc).__name__)
            self._note(batch, line, {"id": request_id, "custom_id": line.custom_id, "response": None, "error": {
                "code": "input_unreadable", "message": "this request could not be read from the input file again"}})
            return
        body = body if "service_tier" in body else {**body, "service_tier": "flex"}
        try:
            why_not = await self._refusal(client, via) if via is not None and via.over_tcp else None
            if why_not is not None:  # (it would serve the line as its token's tenant) served again later
                self.unsent_warnings.warning("batch %s: a request was not sent to kvd router at %s: %s; it is "
                                             "served again", batch.id, via.target, why_not)
                self._not_going(why_not)
                status = 503
            else:
                answer = await client.post(batch.endpoint, json=body,
                                           headers={"X-KVD-Tenant": batch.tenant, "X-Request-Id": request_id})
                status = answer.status_code
                self.unsent = None
        except httpx.HTTPError as exc:  # (kvd's own app, in process: not expected; a router down) served again
            self.unsent_warnings.warning("batch %s: a request could not be sent%s (%s); it is served again", batch.id,
                                         f" to kvd router at {via.target}" if via is not None else "", described(exc))
            if via is not None:  # (kvd's own app, in process, is not a router that lines wait for)
                self._not_going(f"it could not be reached ({described(exc)})")
            status = 503
        if via is not None and via.over_tcp and status in TOKEN_REFUSED:  # not the line's fault: its word asked again
            self.via_checked.pop(via, None)
            status = 503
        if status in (VIA_SERVED_AGAIN if via is not None else SERVED_AGAIN) or self.stopping:  # again later
            batch.retry.append(line)
            batch.retry_at = self.clock() + RETRY_S
        else:
            try:
                content = answer.json()
            except ValueError:
                content = {"error": {"message": answer.text[:1000], "type": "server_error", "param": None,
                                     "code": None}}
            self._note(batch, line, {"id": request_id, "custom_id": line.custom_id,
                                     "response": {"status_code": status, "request_id": request_id, "body": content},
                                     "error": None})

    async def _refusal(self, client: httpx.AsyncClient, via: ViaRouter) -> str | None:
        """Why the router at a URL would not serve lines as their batch's tenant, asked at most
        every VIA_CHECK_S while it says it would (batch_via.refusal); None: it would."""
        now = time.monotonic()
        if now - self.via_checked.get(via, -VIA_CHECK_S) < VIA_CHECK_S:
            return None
        why_not = await refusal(client, via.target)
        if why_not is None:
            self.via_checked[via] = now
        return why_not

    def _not_going(self, why: str) -> None:
        """A line did not go through the router, for `why` (kept since the first such line)."""
        self.unsent = {"why": why, "since": self.unsent["since"] if self.unsent is not None else time.time()}

    def via_target(self) -> str | None:
        """The router's socket or URL that lines go through, or None (served here)."""
        via = self.via()
        return None if via is None else via.target

    def _body(self, batch: Batch, line: BatchLine) -> dict:
        with open(self.files.data_path(batch.input_file_id), "rb") as source:
            return read_body(source, line)

    def _ended_one(self, batch: Batch) -> None:
        batch.in_flight -= 1
        if self._wake is not None:
            self._wake.set()

    def _note(self, batch: Batch, line: BatchLine, answer: dict) -> None:
        self._record(batch, line, answer)
        self.served["completed" if answered_2xx(answer) else "failed"] += 1

    def _record(self, batch: Batch, line: BatchLine, answer: dict) -> None:
        """`line`'s answer counted, and appended to the batch's done file."""
        batch.count(line.number, answer)
        with open(self.folder / f"{batch.id}.done.jsonl", "a") as done:
            done.write(json.dumps({"line": line.number, **answer}) + "\n")

    async def _settle(self) -> None:
        """Batches whose lines are all served (or that were cancelled or ran out of time, with none
        of theirs in flight) end: their files are written."""
        now = self.clock()
        for batch in list(self.batches.values()):
            if batch.in_flight:
                continue
            if batch.status == "finalizing":  # (kvd stopped while it wrote them)
                ending = batch.ending or "completed"
            elif batch.status == "cancelling":
                ending = "cancelled"
            elif batch.status == "in_progress" and now >= batch.expires_at:
                ending = "expired"
            elif batch.status == "in_progress" and not batch.pending():
                ending = "completed"
            else:
                continue
            if batch.status != "finalizing":  # (said on the loop: no line of it is handed out, no cancel taken)
                batch.status, batch.ending = "finalizing", ending
                batch.stamps["finalizing_at"] = int(now)
            try:
                await asyncio.to_thread(self._finish, batch, ending, now)  # (its files: off the event loop)
            except OSError as exc:  # (a full disk): said, and tried again at the next turn
                log.error("batch %s: its output could not be written (%s); kvd tries again", batch.id, exc)

    def _finish(self, batch: Batch, ending: str, now: float) -> None:
        self._save(batch)  # (finalizing: a restart writes its files again)
        if ending == "expired":  # each line not served is an error, as OpenAI writes them
            for line in [line for line in batch.lines if line.number not in batch.done]:
                self._record(batch, line, {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": line.custom_id,
                                           "response": None, "error": {"code": "batch_expired", "message": (
                                               "this request could not be served before the batch expired")}})
        done = self.folder / f"{batch.id}.done.jsonl"
        where = {record["line"]: (start, len(raw)) for start, raw, record in done_records(done) if record}
        parts = {kind: self.folder / f"{batch.id}.{kind}.part" for kind in ("output", "error")}
        written = dict.fromkeys(parts, 0)
        with open(parts["output"], "w") as ok, open(parts["error"], "w") as bad, open(done, "ab+") as rows:
            for number in sorted(where):  # (in the input's order, a record at a time)
                rows.seek(where[number][0])
                answer = json.loads(rows.read(where[number][1]))
                del answer["line"]
                kind = "output" if answered_2xx(answer) else "error"
                (ok if kind == "output" else bad).write(json.dumps(answer) + "\n")
                written[kind] += 1
        stem = batch.id.removeprefix("batch_")[:24]
        for kind, attribute in (("output", "output_file_id"), ("error", "error_file_id")):
            if written[kind]:
                with open(parts[kind], "rb") as content:
                    kept = self.files.add(batch.tenant, f"{batch.id}_{kind}.jsonl", "batch_output", content,
                                          file_id=f"file-{stem}{'0' if kind == 'output' else '1'}",
                                          expires_in=batch.output_expiry)
                setattr(batch, attribute, kept.id)
            parts[kind].unlink(missing_ok=True)
        batch.final = {"request_counts": batch.counts, "usage": batch.usage()}
        batch.status = ending
        batch.stamps[f"{ending}_at"] = int(now)
        batch.told = False
        self._save(batch)
        self._end(batch)
        batch.lines, batch.retry, batch.done = [], [], set()  # (in its files now: not held in memory)
        done.unlink(missing_ok=True)
        log.info("batch %s of tenant %s %s: %d of %d requests answered 2xx", batch.id, batch.tenant, ending,
                 written["output"], batch.total)

    def _end(self, batch: Batch) -> None:
        """Tell of `batch`'s end (its webhook: on_end), its ended record saved with told False first: where
        kvd stops between the two, the next start tells it again (the same event id, which receivers dedupe
        on). An event that could not be written down (on_end answers False) is tried again then too."""
        if self.on_end(batch) is not False:
            batch.told = True
            self._save(batch)

    # ---- kept across restarts -------------------------------------------------------------
    def _save(self, batch: Batch) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        write_json_whole(self.folder / f"{batch.id}.json", batch.record())

    def _load(self) -> None:
        for path in sorted(self.folder.glob("batch_*.json")):
            try:
                batch = Batch.from_record(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                log.error("batch record %s cannot be read; left as it is", path)
                continue
            self.batches[batch.id] = batch
            if batch.status in ENDED:
                if not batch.told:  # kvd stopped between its ended record and its webhook
                    self._end(batch)
                continue
            try:
                self.files.get(batch.tenant, batch.input_file_id)
                with open(self.files.data_path(batch.input_file_id), "rb") as content:
                    lines, _ = read_lines(content, batch.endpoint)
            except (FileError, OSError) as exc:
                log.error("batch %s: its input file %s cannot be read (%s); the batch fails", batch.id,
                          batch.input_file_id, exc)
                batch.status, batch.stamps["failed_at"], batch.told = "failed", int(self.clock()), False
                batch.errors = [{"code": "input_file_missing", "message": f"its input file could not be read again "
                                 f"when kvd started: {exc}", "param": "input_file_id", "line": None}]
                self._save(batch)
                self._end(batch)
                continue
            batch.lines = prompt_order(lines)
            done = self.folder / f"{batch.id}.done.jsonl"
            torn = False
            for _, _, record in done_records(done):
                if record is None:
                    torn = True  # (a line a crash cut short: its request is served again)
                else:
                    batch.count(record.pop("line"), record)
            if torn:  # written again without it, so that what is appended next starts a line of its own
                write_whole(done, lambda tmp: keep_whole_records(done, tmp))
