"""The responses kvd keeps, on disk as well (`responses_store_file`): a restart, an upgrade or a
crash then forgets none of the conversations clients continue by `previous_response_id`.

One SQLite file (WAL), written by a thread of its own, so that no request waits on the disk. It
holds what the memory store holds (response_store.py) and nothing more: a response let go for
room, deleted, or too big to keep is deleted from the file too, so the file stays within
`responses_store_bytes` as the memory does (less what SQLite itself adds). Messages and items
are stored by their content (the SHA-256 of their JSON), each once however many responses hold
it, with the count of those that do: the turns of a conversation share them on disk as they do
in memory. The file is made with mode 0600: it holds the conversations' text.

At start the memory store is filled from it, least recently used first: kvd's stop writes the
order of use (`used`; one write at the end, not one per read), so a restart keeps it; those kept
after the last stop (a crash) follow, in the order they were made. Identical messages become one
object again, so the memory store counts them once. A background response still running when kvd
last stopped is kept `failed` (background_file.py).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sqlite3
import threading
from pathlib import Path
from typing import Iterator

log = logging.getLogger("kvd")

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,
    tenant TEXT NOT NULL, response TEXT NOT NULL, conversation TEXT NOT NULL, inputs TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS parts (digest TEXT PRIMARY KEY, body TEXT NOT NULL, refs INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS used (id TEXT PRIMARY KEY, rank INTEGER NOT NULL);
"""


class ResponseFileError(RuntimeError):
    """The file cannot be opened as kvd's responses file; the message names it and says why."""


class ResponseFile:
    """The file, and the thread that writes it. `add` and `remove` return at once: the thread
    applies them in order, each in one transaction (`flush` waits for it). The conversations
    kvd keeps are written to it as well (conversation_file.py), through `submit`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            if not self.path.exists():  # made readable by kvd's user alone, before SQLite opens it
                os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
            self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA secure_delete=ON")  # what is removed is overwritten, not kept in free pages
            self.db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise ResponseFileError(f"responses_store_file: cannot use {str(self.path)!r}: {exc}") from None
        self.queue: queue.Queue = queue.Queue()
        self.failed = 0  # writes that did not land (a full disk): the memory store serves on without them
        self.last_failure: str | None = None  # why the latest of them did not land (SQLite's word)
        self.thread = threading.Thread(target=self._write_all, name="kvd-responses-file", daemon=True)

    def load(self) -> Iterator[tuple[str, dict, list[dict], list[dict]]]:
        """(tenant, response, conversation, inputs) of each response kept, the least recently used
        first (as kvd last stopped; then those kept since, oldest first); a message or item held
        by several is one object."""
        bodies = dict(self.db.execute("SELECT digest, body FROM parts"))
        objects: dict[str, dict] = {}

        def part(digest: str) -> dict:
            if digest not in objects:
                objects[digest] = json.loads(bodies[digest])
            return objects[digest]

        rows = self.db.execute("SELECT tenant, response, conversation, inputs FROM responses LEFT JOIN used "
                               "USING (id) ORDER BY used.rank IS NULL, used.rank, seq")
        for tenant, response, conversation, inputs in rows.fetchall():
            yield (tenant, json.loads(response), [part(d) for d in json.loads(conversation)],
                   [part(d) for d in json.loads(inputs)])

    def start(self) -> None:
        self.thread.start()

    def figures(self) -> dict:
        """Where the kept responses and conversations are written as well, and the writes that did
        not land (and why the latest did not): what they wrote is kept in memory only, and a restart
        will not find it."""
        return {"path": str(self.path), "failed_writes": self.failed, "last_failure": self.last_failure}

    def add(self, tenant: str, response: dict, conversation: list[str], inputs: list[str],
            bodies: dict[str, str]) -> None:
        """Keeps `response` (replacing one of its id): its messages and items by digest, `bodies`
        the JSON of those the file may not have yet."""
        self.submit(self._add, response["id"], tenant, json.dumps(response), conversation, inputs, bodies)

    def remove(self, response_id: str) -> None:
        self.submit(self._remove, response_id)

    def save_order(self, response_ids: list[str]) -> None:
        """The order of use, the least recently used first (written at kvd's stop)."""
        self.submit(self._save_order, response_ids)

    def submit(self, write, *args, then=None) -> None:
        """Has the thread call `write(*args)`, after every write submitted before, in a
        transaction of its own (undone whole where it fails); then `then()`, where given, on the
        thread (whether the write landed or not)."""
        self.queue.put((write, args, then))

    def flush(self) -> None:
        """Waits until every add and remove so far has been written."""
        self.queue.join()

    def close(self) -> None:
        """Writes what waits (and what a write's `then` submits), and closes the file."""
        if self.thread.is_alive():
            self.queue.join()
            self.queue.put(None)
            self.thread.join()
        self.db.close()

    def _write_all(self) -> None:
        while True:
            job = self.queue.get()
            try:
                if job is None:
                    return
                write, args, then = job
                try:
                    self.db.execute("BEGIN IMMEDIATE")
                    write(*args)
                    self.db.execute("COMMIT")
                except sqlite3.Error as exc:
                    if self.db.in_transaction:
                        self.db.execute("ROLLBACK")
                    self.failed += 1
                    self.last_failure = str(exc)
                    log.warning("responses_store_file %s: a write did not land (%s); what it wrote is kept in "
                                "memory only", self.path, exc)
                if then is not None:
                    try:
                        then()
                    except Exception:  # (the thread writes on for every other write)
                        log.exception("responses_store_file %s: what follows a write failed", self.path)
            finally:
                self.queue.task_done()

    def _add(self, response_id: str, tenant: str, response: str, conversation: list[str], inputs: list[str],
             bodies: dict[str, str]) -> None:
        for digest in set(conversation) | set(inputs):  # counted once for each response that holds it
            if digest in bodies:
                self.db.execute("INSERT INTO parts (digest, body, refs) VALUES (?, ?, 1) ON CONFLICT (digest) "
                                "DO UPDATE SET refs = refs + 1", (digest, bodies[digest]))
            elif self.db.execute("UPDATE parts SET refs = refs + 1 WHERE digest = ?", (digest,)).rowcount != 1:
                raise sqlite3.IntegrityError(f"message {digest[:12]} is held in memory but not in the file")
        self._remove(response_id)  # the one it replaces (after: what the two share stays)
        self.db.execute("INSERT INTO responses (id, tenant, response, conversation, inputs) VALUES (?, ?, ?, ?, ?)",
                        (response_id, tenant, response, json.dumps(conversation), json.dumps(inputs)))

    def _save_order(self, response_ids: list[str]) -> None:
        self.db.execute("DELETE FROM used")
        self.db.executemany("INSERT INTO used (id, rank) VALUES (?, ?)",
                            ((response_id, rank) for rank, response_id in enumerate(response_ids)))

    def _remove(self, response_id: str) -> None:
        row = self.db.execute("SELECT conversation, inputs FROM responses WHERE id = ?", (response_id,)).fetchone()
        if row is None:
            return
        self.db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        self.db.execute("DELETE FROM used WHERE id = ?", (response_id,))
        for digest in set(json.loads(row[0])) | set(json.loads(row[1])):
            self.db.execute("UPDATE parts SET refs = refs - 1 WHERE digest = ?", (digest,))
        self.db.execute("DELETE FROM parts WHERE refs <= 0")
