"""The responses kvd keeps for `previous_response_id` and `GET /v1/responses/{id}`.

In memory, within a budget of bytes (`responses_store_bytes`): when a new one would not fit, the
least recently used response of the tenant holding the most bytes goes first
(policies/kept_state.py: one tenant's burst does not push out every other tenant's), and a
response bigger than the whole budget is not kept.
Each is its tenant's: another tenant's id reads as unknown, as if it had never been (a 404 that
says nothing about whose it is). With `responses_store_file` they are written to disk as well
(response_file.py), and a restart finds them there; without it a restart forgets them all. A
background response is written there as it starts (background_file.py): one kvd stopped without
ending it is kept `failed` at the next start, not forgotten.

A response is counted at the JSON of itself, and of each message of its conversation and each
item that made it (`inputs`, which `GET /v1/responses/{id}/input_items` lists) once, however many
responses hold it: the turns of one conversation share their earlier messages and items in
memory (the same objects, continued by `previous_response_id`), so a conversation of N turns
takes what its messages take, not N times that. A message or item is let go with the last
response that holds it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from kvctl.policies.kept_state import KeptByTenant

from .background_file import BackgroundFile, Cut, Untold
from .gone_book import GoneBook, GoneFile
from .kept_budget import ResizableBudget
from .response_file import ResponseFile, ResponseFileError

log = logging.getLogger("kvd")

REPLAY_S = 300.0  # how long an ended background response's events can still be streamed again
CUT_SHORT = {"code": "server_error", "message": "kvd stopped before it ended, without ending it (a crash, a kill, or a "
                                                "stop whose last writes did not land); what it wrote is lost"}
SERVED_AGAIN_AT_MOST = 1  # times a background response cut short by kvd's stop is served again (serve_again.py)
CUT_SHORT_AGAIN = {"code": "server_error", "message": "kvd stopped before it ended, and stopped again before it ended "
                                                      "when it was served again from the start; what it wrote is lost"}


@dataclass(frozen=True, slots=True)
class StoredResponse:
    tenant: str
    response: dict  # the Response object as it was answered
    conversation: tuple[dict, ...]  # the chat messages a next turn continues (no instructions)
    inputs: tuple[dict, ...]  # the items it was made from: the earlier turns' inputs and outputs, then its input
    size: int  # bytes of its own: the JSON of the response (its messages and items are counted where they are held)

    def parts(self) -> list[dict]:
        """The messages and items it holds, each of them perhaps held by other responses too."""
        return [*self.conversation, *self.inputs]


class ResponseStore(ResizableBudget):
    """Responses by id, each for its tenant; for room, the least recently used of the tenant
    holding the most bytes goes first."""

    SETTING = "responses_store_bytes"

    def __init__(self, budget_bytes: int, file: ResponseFile | None = None) -> None:
        """`file`: where they are written as well, and read back from now (response_file.py)."""
        if file is not None and budget_bytes == 0:
            file.close()
            raise ResponseFileError("responses_store_file: needs responses_store_bytes above 0 (with 0 kvd keeps no "
                                    "response, and would empty the file)")
        self.budget = budget_bytes
        self.used = 0
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        # every message and item held, by id(): [responses that hold it, its bytes, itself (so its id stays
        # its), the SHA-256 of its JSON (its name in the file), the tenant its bytes are counted to]
        self.held: dict[int, list] = {}
        self.kept = KeptByTenant()  # each tenant's responses, least recently used first, and its bytes
        # why those let go went, for their tenant's next request (not those it deleted); in the file too
        self.gone = GoneBook(file=GoneFile(file, "responses") if file is not None else None)
        self.dropped = 0  # responses let go to make room (or too big to keep)
        self.expired = 0  # responses let go once older than responses_max_age (response_admin.expire)
        self.runs: dict[str, object] = {}  # background responses still running (response_runs.Run), by id
        # ended background streams whose events can be streamed again (REPLAY_S, a quarter of the budget):
        # id -> (its Run, when it ended, the bytes of its events)
        self.replays: OrderedDict[str, tuple] = OrderedDict()
        self.replay_bytes = 0
        self.clock = time.monotonic
        self.lock = threading.Lock()
        self.file = file
        # tells a background response's end to its tenant's webhook (webhooks.Webhooks.told): False where
        # the event could not be written down; None: no webhooks (set by the service, with tell_untold)
        self.tell: Callable[[str, str, str], bool] | None = None
        self.untold: list[Untold] = []  # ends whose webhook was not written down before kvd last stopped
        self.background = BackgroundFile(file) if file is not None else None
        # running when kvd last stopped, and not ended: served again from the start (serve_again.start takes them)
        self.again: list[Cut] = []
        self.served_again = 0  # background responses served again since kvd started (take_again)
        if file is not None:  # (the oldest first: those that no longer fit go, from the file too)
            for tenant, response, conversation, inputs in file.load():
                self.put(tenant, response, conversation, inputs, written=True)
            cut, self.untold = self.background.load()
            failed = []
            for run in cut:  # (one pass: served again, or failed)
                again = self.keeps and run.request is not None and run.attempts < SERVED_AGAIN_AT_MOST
                (self.again if again else failed).append(run)
            for run in failed:  # failed (the newest kept)
                error = CUT_SHORT if run.request is None or not self.keeps else CUT_SHORT_AGAIN
                self.put(run.tenant, {**run.response, "status": "failed", "error": error}, run.conversation,
                         run.inputs)
                self.background.ended(run.response["id"], run.tenant, "response.failed")
                self.untold.append(Untold(run.tenant, "response.failed", run.response["id"]))
            if cut:
                log.warning("%d background responses were running when kvd last stopped without ending them: %d "
                            "served again from the start; %d kept failed (cut short again, or written down by a kvd "
                            "that kept no request), their tenants' webhooks told", len(cut), len(self.again),
                            len(failed))
            file.start()

    @property
    def keeps(self) -> bool:
        """Whether it keeps any response (responses_store_bytes 0: none)."""
        return self.budget > 0

    def put(self, tenant: str, response: dict, conversation: list[dict], inputs: list[dict] = (),
            written: bool = False) -> bool:
        """Keeps `response`, the conversation a next turn continues and the items it was made
        from (and writes it to the file, unless it was read from there: `written`); False (kept
        nothing) when it is bigger than the whole budget (counted as dropped), or the store keeps
        none."""
        if not self.keeps:
            return False
        entry = StoredResponse(tenant, response, tuple(conversation), tuple(inputs), len(json.dumps(response)))
        parts = {id(part): part for part in entry.parts()}  # (each once, as it is held once)
        with self.lock:
            fresh = {key: json.dumps(part, sort_keys=True) for key, part in parts.items() if key not in self.held}
            named = {key: [len(text), hashlib.sha256(text.encode()).hexdigest()] for key, text in fresh.items()}
            named.update({key: [self.held[key][1], self.held[key][3]] for key in parts if key in self.held})
            if entry.size + sum(size for size, _ in named.values()) > self.budget:  # it alone would not fit
                self.dropped += 1
                self.gone.note(tenant, response["id"], "it was bigger than kvd keeps for all responses "
                                                       f"(responses_store_bytes {self.budget})")
                if written:
                    self.file.remove(response["id"])
                return False
            for key, part in parts.items():  # held before any other goes: what it shares stays
                size, digest = named[key]
                holding = self.held.setdefault(key, [0, size, part, digest, tenant])
                holding[0] += 1
                if holding[0] == 1:
                    self.used += size
                    self.kept.grew(tenant, size)
            self.used += entry.size
            self.kept.grew(tenant, entry.size)
            old = self.entries.pop(response["id"], None)  # (one of its id it replaces)
            if old is not None:
                self._release(response["id"], old)
                self._drop_replay(response["id"])
            self._make_room(None)
            self.entries[response["id"]] = entry
            self.kept.add(tenant, response["id"])
            if self.file is not None and not written:
                self.file.add(tenant, response, [self.held[id(part)][3] for part in conversation],
                              [self.held[id(part)][3] for part in inputs],
                              {named[key][1]: text for key, text in fresh.items()})
            return True

    def budget_refusal(self, budget_bytes: int) -> str | None:
        """Why `resize(budget_bytes)` cannot be done (None: it can): a file needs a budget above 0."""
        if self.file is not None and budget_bytes == 0:
            return ("responses_store_bytes: 0 would keep no response and empty responses_store_file; start kvd "
                    "without the file to keep none")
        return None

    def _make_room(self, keep: str | None,
                   why: str = "kvd let it go for room (responses_store_bytes; its tenant held the most)") -> None:
        """Lets go of responses (not `keep`) until the rest fit: the least recently used of the
        tenant holding the most bytes first; and of the events kept for replay past a quarter of
        the budget."""
        while self.used > self.budget:
            gone_id = self.kept.victim(keep)
            if gone_id is None:
                break
            gone = self.entries.pop(gone_id)
            self._release(gone_id, gone)
            self.gone.note(gone.tenant, gone_id, why)
            self.dropped += 1
            self._drop_replay(gone_id)
            if self.file is not None:
                self.file.remove(gone_id)
        self._forget_replays()

    def _release(self, response_id: str, entry: StoredResponse) -> None:
        """Lets `entry` go: its own bytes, and each message or item no other response holds."""
        self.used -= entry.size
        self.kept.remove(entry.tenant, response_id)
        self.kept.grew(entry.tenant, -entry.size)
        for key in {id(part) for part in entry.parts()}:
            holding = self.held[key]
            holding[0] -= 1
            if holding[0] == 0:
                del self.held[key]
                self.used -= holding[1]
                self.kept.grew(holding[4], -holding[1])

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response `response_id` (now the most recently used), or None."""
        with self.lock:
            entry = self.entries.get(response_id)
            if entry is None or entry.tenant != tenant:
                return None
            self.entries.move_to_end(response_id)
            self.kept.used(tenant, response_id)
            return entry

    def find(self, response_id: str) -> StoredResponse | None:
        """Any tenant's response `response_id` (an operator's question: it is not made more recently used)."""
        with self.lock:
            return self.entries.get(response_id)

    def delete(self, tenant: str, response_id: str) -> bool:
        with self.lock:
            entry = self.entries.get(response_id)
            if entry is None or entry.tenant != tenant:
                return False
            del self.entries[response_id]
            self._release(response_id, entry)
            self._drop_replay(response_id)
            if self.file is not None:
                self.file.remove(response_id)
            return True

    def tenants(self) -> list[dict]:
        """Each tenant's kept responses (`GET /admin/responses`): how many, their bytes (each message
        or item they hold once), when the oldest and the newest were made, and how many run in the
        background; the most bytes first."""
        rows: dict[str, dict] = {}
        counted: dict[str, set] = {}
        with self.lock:
            for entry in self.entries.values():
                row = rows.get(entry.tenant) or rows.setdefault(entry.tenant, tenant_row(entry.tenant))
                row["responses"] += 1
                row["bytes"] += entry.size
                seen = counted.setdefault(entry.tenant, set())
                for part in entry.parts():
                    if id(part) not in seen:
                        seen.add(id(part))
                        row["bytes"] += self.held[id(part)][1]
                made = entry.response.get("created_at")
                if isinstance(made, (int, float)):
                    row["oldest"] = made if row["oldest"] is None else min(row["oldest"], made)
                    row["newest"] = made if row["newest"] is None else max(row["newest"], made)
            for run in self.runs.values():
                row = rows.get(run.tenant) or rows.setdefault(run.tenant, tenant_row(run.tenant))
                row["running"] += 1
            self._forget_replays()
            for run, _, size in self.replays.values():  # (each beside a response of its tenant's, counted above)
                rows[run.tenant]["replay_bytes"] += size
        return sorted(rows.values(), key=lambda row: (-row["bytes"], row["tenant"]))

    def runs_matching(self, tenant: str | None, made_before: float | None, ids: set[str] | None = None) -> list:
        """The background responses running for `tenant` (None: any) made before `made_before`
        (None: whenever), of `ids` (None: any)."""
        with self.lock:
            runs = [run for response_id, run in self.runs.items() if (tenant is None or run.tenant == tenant)
                    and (ids is None or response_id in ids)]
        return [run for run in runs if made_before is None or run.now()["created_at"] < made_before]

    def purge(self, tenant: str | None, made_before: float | None, dry_run: bool = False,
              expired: bool = False, ids: set[str] | None = None) -> dict:
        """Lets go of the kept responses of `tenant` (None: every tenant's) made before
        `made_before` (None: whenever), of `ids` (None: any), from the file too; with `dry_run`,
        only counts them; `expired`: counted as let go past their age (responses_max_age).
        {"responses", "bytes" (what memory gets back), "tenants" ({tenant: responses})}, and with
        `ids`, "ids": those it found."""
        with self.lock:
            chosen = [(response_id, entry) for response_id, entry in self.entries.items()
                      if (tenant is None or entry.tenant == tenant)
                      and (made_before is None or entry.response.get("created_at", 0) < made_before)
                      and (ids is None or response_id in ids)]
            holders: dict[int, int] = {}  # message or item -> how many of the chosen hold it
            for _, entry in chosen:
                for key in {id(part) for part in entry.parts()}:
                    holders[key] = holders.get(key, 0) + 1
            freed = sum(entry.size for _, entry in chosen) + sum(
                self.held[key][1] for key, count in holders.items() if count == self.held[key][0])
            if not dry_run:
                self.expired += len(chosen) if expired else 0
                why = "older than responses_max_age" if expired else "an operator purged it (kvctl responses purge)"
                for response_id, entry in chosen:
                    del self.entries[response_id]
                    self._release(response_id, entry)
                    self.gone.note(entry.tenant, response_id, why)
                    self._drop_replay(response_id)
                    if self.file is not None:
                        self.file.remove(response_id)
            tenants: dict[str, int] = {}
            for _, entry in chosen:
                tenants[entry.tenant] = tenants.get(entry.tenant, 0) + 1
            found = {"ids": [response_id for response_id, _ in chosen]} if ids is not None else {}
            return {"responses": len(chosen), "bytes": freed, "tenants": tenants, **found}

    def begin(self, response_id: str, run, conversation: list[dict] = (), inputs: list[dict] = (),
              request: dict | None = None, role: str | None = None, attempts: int = 0) -> None:
        """A background response starts: `run` (response_runs.Run) answers for it until it ends; in
        the file, it is written down as it opened, with the conversation and items it is made from,
        and what serves it again after kvd's stop: the request, its caller's role, and how often it
        was served again already."""
        with self.lock:
            self.runs[response_id] = run
        if self.background is not None:
            self.background.began(run.tenant, run.now(), list(conversation), list(inputs), request, role, attempts)

    def serves_again(self, attempts: int) -> bool:
        """Whether a background response served `attempts` times again already, which kvd's stop cuts
        short, is served again at the next start (the file keeps it): else it ends `failed` now."""
        return self.background is not None and attempts < SERVED_AGAIN_AT_MOST

    def set_aside(self, tenant: str, response_id: str) -> None:
        """kvd's stop cut it short: no longer running here, and still written down as running, so that
        the next start serves it again; the response its cancel kept as it ended is let go."""
        with self.lock:
            self.runs.pop(response_id, None)
        self.delete(tenant, response_id)

    def take_again(self) -> list[Cut]:
        """Those to serve again (each once: serve_again.start)."""
        again, self.again = self.again, []
        self.served_again += len(again)
        return again

    def waiting(self, response_id: str, run) -> None:
        """`run` answers for a response waiting to be served again (queued) until it runs."""
        with self.lock:
            self.runs[response_id] = run

    def running(self, tenant: str, response_id: str):
        """The tenant's background response `response_id` while it runs, or None."""
        with self.lock:
            run = self.runs.get(response_id)
            return run if run is not None and run.tenant == tenant else None

    def ended(self, response_id: str, run=None, event_type: str | None = None) -> None:
        """A background response has ended (and been put, where it is kept). The events of `run`
        (one made with stream: true) can be streamed again for REPLAY_S while the response is kept,
        within a quarter of the budget (the oldest go first): a client whose stream dropped near
        the end gets the rest, and the terminal event. Its end is told to its tenant's webhook as
        `event_type` (None: not told), once the file has it (a restart then finds what it says)."""
        size = sum(len(json.dumps(event)) for event in run.events) if run is not None and run.events else 0
        with self.lock:
            self.runs.pop(response_id, None)
            if size and response_id in self.entries and size <= self.budget // 4:
                self.replays[response_id] = (run, self.clock(), size)
                self.replay_bytes += size
                self._forget_replays()
        tenant = run.tenant if run is not None else ""
        tell = (lambda: self._tell(Untold(tenant, event_type, response_id))) if event_type is not None else None
        if self.background is not None:
            self.background.ended(response_id, tenant, event_type, then=tell)
        elif tell is not None:
            tell()

    def tell_untold(self, tell: Callable[[str, str, str], bool]) -> int:
        """From now on tells each background response's end with `tell`; first those not told before
        kvd last stopped (and those it failed at this start); how many."""
        self.tell = tell
        untold, self.untold = self.untold, []
        for end in untold:
            self._tell(end)
        return len(untold)

    def _tell(self, end: Untold) -> None:
        """Tells `end`; noted as told once its event is written down (or its tenant has no webhook)."""
        if (self.tell is None or self.tell(end.tenant, end.event_type, end.response_id)) and self.background:
            self.background.told(end.response_id)

    def replayable(self, tenant: str, response_id: str):
        """The tenant's ended background response `response_id` whose events can still be
        streamed again (response_runs.Run), or None."""
        with self.lock:
            self._forget_replays()
            kept = self.replays.get(response_id)
            return kept[0] if kept is not None and kept[0].tenant == tenant else None

    def _forget_replays(self) -> None:
        """Lets go of the events past REPLAY_S, and the oldest past a quarter of the budget."""
        now = self.clock()
        while self.replays:
            response_id, (_, ended_at, _) = next(iter(self.replays.items()))
            if now - ended_at <= REPLAY_S and self.replay_bytes <= self.budget // 4:
                return
            self._drop_replay(response_id)

    def _drop_replay(self, response_id: str) -> None:
        kept = self.replays.pop(response_id, None)
        if kept is not None:
            self.replay_bytes -= kept[2]

    def close(self) -> None:
        """Writes what is left to the file, and the order of use, and closes it (at kvd's stop)."""
        if self.file is not None:
            with self.lock:
                order = list(self.entries)
            self.file.save_order(order)
            self.file.close()

    def figures(self) -> dict:
        """Counts and bytes; `replay_bytes`: the events kept to stream ended background responses
        again (within a quarter of the budget, beside `bytes`); `file`: the file they and the
        conversations are written to as well (ResponseFile.figures), None: memory only."""
        with self.lock:
            self._forget_replays()
            return {"responses": len(self.entries), "bytes": self.used, "budget_bytes": self.budget,
                    "dropped": self.dropped, "expired": self.expired, "running": len(self.runs),
                    "served_again": self.served_again,
                    "replay_bytes": self.replay_bytes, "file": None if self.file is None else self.file.figures()}


def tenant_row(tenant: str) -> dict:
    """A tenant's row of `GET /admin/responses` before anything is counted in it."""
    return {"tenant": tenant, "responses": 0, "bytes": 0, "oldest": None, "newest": None, "running": 0,
            "replay_bytes": 0}
