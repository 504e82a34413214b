"""Why a kept response or conversation is gone, for the next request of its tenant that names it.

A client whose conversation kvd let go for room, past `responses_max_age`, or in an operator's
purge would otherwise get the 404 of an id that never was, and could not tell a bug of its own
from kvd's retention. The book remembers the reason for the last GONE_KEPT ids (by tenant: another
tenant still learns nothing), and the 404 says it. One the client deleted itself is not noted.
With `responses_store_file` the book is written there too (`GoneFile`), so a restart remembers it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

GONE_KEPT = 10_000  # ids whose reason is remembered (about 150 bytes each)
GONE_TRIM = 500  # the file holds at most this many more than GONE_KEPT of a kind before it is trimmed

SCHEMA = """
CREATE TABLE IF NOT EXISTS gone (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, tenant TEXT NOT NULL,
    id TEXT NOT NULL, why TEXT NOT NULL, at REAL NOT NULL, UNIQUE (kind, tenant, id));
"""


class GoneFile:
    """A book's notes in the responses file (response_file.py), written by the file's thread:
    `kind` tells the responses' book from the conversations'. It holds ids, tenants and reasons,
    never a response's text."""

    def __init__(self, file, kind: str, kept: int = GONE_KEPT) -> None:
        self.file, self.kind, self.kept = file, kind, kept
        file.db.executescript(SCHEMA)

    def load(self) -> list[tuple[str, str, str, float]]:
        """(tenant, id, why, at) of the newest `kept` notes, the oldest first (read at start)."""
        rows = self.file.db.execute("SELECT tenant, id, why, at FROM gone WHERE kind = ? ORDER BY seq DESC LIMIT ?",
                                    (self.kind, self.kept)).fetchall()
        return rows[::-1]

    def note(self, tenant: str, key: str, why: str, at: float) -> None:
        self.file.submit(self._note, tenant, key, why, at)

    def _note(self, tenant: str, key: str, why: str, at: float) -> None:
        db = self.file.db
        db.execute("DELETE FROM gone WHERE kind = ? AND tenant = ? AND id = ?", (self.kind, tenant, key))
        newest = db.execute("INSERT INTO gone (kind, tenant, id, why, at) VALUES (?, ?, ?, ?, ?)",
                            (self.kind, tenant, key, why, at)).lastrowid
        if newest % GONE_TRIM == 0:  # now and then, not at every note: each kind's newest `kept` stay
            for (kind,) in db.execute("SELECT DISTINCT kind FROM gone").fetchall():
                db.execute("DELETE FROM gone WHERE kind = ? AND seq <= (SELECT seq FROM gone WHERE kind = ? ORDER BY "
                           "seq DESC LIMIT 1 OFFSET ?)", (kind, kind, self.kept))


class GoneBook:
    """(tenant, id) -> why and when it went, the oldest forgotten first; with `file` (a
    GoneFile), read from it at start and written to it as it goes."""

    def __init__(self, kept: int = GONE_KEPT, clock=time.time, file: GoneFile | None = None) -> None:
        self.kept, self.clock, self.file = kept, clock, file
        self.book: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self.lock = threading.Lock()
        for tenant, key, why, at in file.load() if file is not None else ():
            self.book[(tenant, key)] = (why, at)

    def note(self, tenant: str, key: str, why: str) -> None:
        with self.lock:
            at = self.clock()
            self.book.pop((tenant, key), None)  # (the newest last)
            self.book[(tenant, key)] = (why, at)
            while len(self.book) > self.kept:
                self.book.popitem(last=False)
            if self.file is not None:  # (in the order noted)
                self.file.note(tenant, key, why, at)

    def why(self, tenant: str, key: str) -> str | None:
        """"<why>, <when> (UTC)" for the tenant's `key`, or None where the book does not know it."""
        with self.lock:
            known = self.book.get((tenant, key))
        if known is None:
            return None
        why, at = known
        return f"{why}, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(at))}"
