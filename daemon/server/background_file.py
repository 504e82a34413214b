"""The background responses in the responses file (`responses_store_file`, response_file.py):
those running, and those ended whose webhook is not yet written down.

A background response is written down as it starts (`began`: the response as it opened, the
conversation and items it was made from, and the request itself with its caller's role and how
often it was served again), and struck off as it ends (`ended`, in the order of the file's
writes: after the ended response itself). One still written down at a start ran when kvd last
stopped without ending it (a stop's deadline passed while it ran, a crash, a kill, a power loss):
it is served again from the start (serve_again.py), once at most; one cut short again, or written
down by a kvd that kept no request, is kept `failed`, so its client polling it is told so
instead of a 404, and its webhook says `response.failed`.

A webhook is told once its response's end is in the file (`ended`'s `then`), and the end is
noted as untold until the event is written down (`told`): kvd stopping between the two tells it
at the next start, under the same event id (webhooks.Webhooks.event_id), which a receiver dedupes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from .response_file import ResponseFile

SCHEMA = """
CREATE TABLE IF NOT EXISTS background_running (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, response TEXT NOT NULL,
    conversation TEXT NOT NULL, inputs TEXT NOT NULL, request TEXT, role TEXT, attempts INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS background_untold (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, event_type TEXT NOT NULL);
"""


# what a file written by a kvd before responses were served again lacks: added as the file is opened
ADDED_COLUMNS = (("request", "TEXT"), ("role", "TEXT"), ("attempts", "INTEGER NOT NULL DEFAULT 0"))


@dataclass(frozen=True)
class Cut:
    """A background response kvd stopped running without ending it: as it opened, and the request
    it was made from (None: written down by a kvd that kept none), its caller's role, and how
    often it was served again before."""
    tenant: str
    response: dict
    conversation: list[dict]
    inputs: list[dict]
    request: dict | None = None
    role: str | None = None
    attempts: int = 0


@dataclass(frozen=True)
class Untold:
    """An ended background response whose webhook event was not written down."""
    tenant: str
    event_type: str
    response_id: str


class BackgroundFile:
    """The background tables of a ResponseFile. Each method but `load` returns at once: the file's
    thread writes it, in order with the responses' writes."""

    def __init__(self, file: ResponseFile) -> None:
        self.file = file
        file.db.executescript(SCHEMA)
        columns = {row[1] for row in file.db.execute("PRAGMA table_info(background_running)")}
        for name, kind in ADDED_COLUMNS:
            if name not in columns:
                file.db.execute(f"ALTER TABLE background_running ADD COLUMN {name} {kind}")

    def load(self) -> tuple[list[Cut], list[Untold]]:
        """Those written down as running, the oldest first, and the ends not told (read before the
        file's thread starts)."""
        db = self.file.db
        cut = [Cut(tenant, json.loads(response), json.loads(conversation), json.loads(inputs),
                   None if request is None else json.loads(request), role, attempts)
               for tenant, response, conversation, inputs, request, role, attempts in
               db.execute("SELECT tenant, response, conversation, inputs, request, role, attempts "
                          "FROM background_running ORDER BY rowid")]
        untold = [Untold(tenant, event_type, response_id) for response_id, tenant, event_type in
                  db.execute("SELECT id, tenant, event_type FROM background_untold ORDER BY rowid")]
        return cut, untold

    def began(self, tenant: str, response: dict, conversation: list[dict], inputs: list[dict],
              request: dict | None = None, role: str | None = None, attempts: int = 0) -> None:
        """Writes it down as running: as it opened, with what serves it again after a stop."""
        self.file.submit(self._began, response["id"], tenant, json.dumps(response), json.dumps(conversation),
                         json.dumps(inputs), None if request is None else json.dumps(request), role, attempts)

    def ended(self, response_id: str, tenant: str, event_type: str | None,
              then: Callable[[], None] | None = None) -> None:
        """Strikes `response_id` off as running, noting its end `event_type` as untold (None: no event
        tells it); `then()` once that is written (or could not be: memory has the response)."""
        self.file.submit(self._ended, response_id, tenant, event_type, then=then)

    def told(self, response_id: str) -> None:
        """Its end's event is written down."""
        self.file.submit(self._told, response_id)

    def _began(self, response_id: str, tenant: str, response: str, conversation: str, inputs: str,
               request: str | None, role: str | None, attempts: int) -> None:
        self.file.db.execute("INSERT OR REPLACE INTO background_running (id, tenant, response, conversation, inputs, "
                             "request, role, attempts) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             (response_id, tenant, response, conversation, inputs, request, role, attempts))

    def _ended(self, response_id: str, tenant: str, event_type: str | None) -> None:
        self.file.db.execute("DELETE FROM background_running WHERE id = ?", (response_id,))
        if event_type is not None:
            self.file.db.execute("INSERT OR REPLACE INTO background_untold (id, tenant, event_type) VALUES (?, ?, ?)",
                                 (response_id, tenant, event_type))

    def _told(self, response_id: str) -> None:
        self.file.db.execute("DELETE FROM background_untold WHERE id = ?", (response_id,))
