"""The conversations kvd keeps, on disk as well: in the responses file (`responses_store_file`,
response_file.py), whose thread writes them, so a restart forgets no conversation a client
continues by its id.

Each change is written as it is made: a conversation made, its metadata set, items added at its
end or one deleted, where `truncation: "auto"` last cut it (`prompt_start`: after a restart its
next turn at the context's edge still starts where the last one did, and comes from the cache),
the conversation deleted (or let go for room, which the memory store does first: the file holds
what memory holds). At start the memory store is filled from it, the least
recently used first (kvd's stop writes the order of use, `rank`; those made after the last stop
follow, in the order they were made).
"""

from __future__ import annotations

import json
from typing import Iterator

from .response_file import ResponseFile

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,
    tenant TEXT NOT NULL, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL, metadata TEXT NOT NULL,
    rank INTEGER, prompt_start TEXT);
CREATE TABLE IF NOT EXISTS conversation_items (conversation TEXT NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL,
    body TEXT NOT NULL, PRIMARY KEY (conversation, seq));
"""


class ConversationFile:
    """The conversations' tables of a ResponseFile. Each method returns at once: the file's
    thread writes it, in order with the responses' writes."""

    def __init__(self, file: ResponseFile) -> None:
        self.file = file
        file.db.executescript(SCHEMA)
        columns = {row[1] for row in file.db.execute("PRAGMA table_info(conversations)")}
        if "prompt_start" not in columns:  # a file an earlier kvd made
            file.db.execute("ALTER TABLE conversations ADD COLUMN prompt_start TEXT")

    def load(self) -> Iterator[tuple[str, str, int, int, dict, list[dict], str | None]]:
        """(id, tenant, created_at, updated_at, metadata, items, prompt_start) of each
        conversation, the least recently used first (read before the file's thread starts)."""
        db = self.file.db
        items: dict[str, list[dict]] = {}
        for conversation, body in db.execute("SELECT conversation, body FROM conversation_items ORDER BY "
                                             "conversation, seq"):
            items.setdefault(conversation, []).append(json.loads(body))
        rows = db.execute("SELECT id, tenant, created_at, updated_at, metadata, prompt_start FROM conversations "
                          "ORDER BY rank IS NULL, rank, seq")
        for conversation_id, tenant, created_at, updated_at, metadata, prompt_start in rows.fetchall():
            yield (conversation_id, tenant, created_at, updated_at, json.loads(metadata),
                   items.get(conversation_id, []), prompt_start)

    def create(self, conversation_id: str, tenant: str, created_at: int, metadata: dict, items: list[dict]) -> None:
        self.file.submit(self._create, conversation_id, tenant, created_at, json.dumps(metadata),
                         [(item["id"], json.dumps(item)) for item in items])

    def set_metadata(self, conversation_id: str, updated_at: int, metadata: dict) -> None:
        self.file.submit(self._set_metadata, conversation_id, updated_at, json.dumps(metadata))

    def add(self, conversation_id: str, updated_at: int, items: list[dict]) -> None:
        self.file.submit(self._added, conversation_id, updated_at, [(item["id"], json.dumps(item)) for item in items])

    def delete_item(self, conversation_id: str, updated_at: int, item_id: str) -> None:
        self.file.submit(self._delete_item, conversation_id, updated_at, item_id)

    def set_start(self, conversation_id: str, item_id: str | None) -> None:
        """Where truncation last cut it (not a change its client made: `updated_at` stays)."""
        self.file.submit(self._set_start, conversation_id, item_id)

    def delete(self, conversation_id: str) -> None:
        self.file.submit(self._delete, conversation_id)

    def save_order(self, conversation_ids: list[str]) -> None:
        """The order of use, the least recently used first (written at kvd's stop)."""
        self.file.submit(self._save_order, conversation_ids)

    # ---- on the file's thread, each in a transaction ----
    def _create(self, conversation_id: str, tenant: str, created_at: int, metadata: str,
                items: list[tuple[str, str]]) -> None:
        self.file.db.execute("INSERT INTO conversations (id, tenant, created_at, updated_at, metadata) "
                             "VALUES (?, ?, ?, ?, ?)", (conversation_id, tenant, created_at, created_at, metadata))
        self._add(conversation_id, items)

    def _updated(self, conversation_id: str, updated_at: int) -> None:
        self.file.db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (updated_at, conversation_id))

    def _set_metadata(self, conversation_id: str, updated_at: int, metadata: str) -> None:
        self.file.db.execute("UPDATE conversations SET metadata = ?, updated_at = ? WHERE id = ?",
                             (metadata, updated_at, conversation_id))

    def _added(self, conversation_id: str, updated_at: int, items: list[tuple[str, str]]) -> None:
        self._updated(conversation_id, updated_at)
        self._add(conversation_id, items)

    def _add(self, conversation_id: str, items: list[tuple[str, str]]) -> None:
        db = self.file.db
        [last] = db.execute("SELECT COALESCE(MAX(seq), 0) FROM conversation_items WHERE conversation = ?",
                            (conversation_id,)).fetchone()
        db.executemany("INSERT INTO conversation_items (conversation, seq, id, body) VALUES (?, ?, ?, ?)",
                       ((conversation_id, last + 1 + i, item_id, body) for i, (item_id, body) in enumerate(items)))

    def _delete_item(self, conversation_id: str, updated_at: int, item_id: str) -> None:
        self._updated(conversation_id, updated_at)
        self.file.db.execute("DELETE FROM conversation_items WHERE conversation = ? AND id = ?",
                             (conversation_id, item_id))

    def _set_start(self, conversation_id: str, item_id: str | None) -> None:
        self.file.db.execute("UPDATE conversations SET prompt_start = ? WHERE id = ?", (item_id, conversation_id))

    def _delete(self, conversation_id: str) -> None:
        self.file.db.execute("DELETE FROM conversation_items WHERE conversation = ?", (conversation_id,))
        self.file.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def _save_order(self, conversation_ids: list[str]) -> None:
        db = self.file.db
        db.execute("UPDATE conversations SET rank = NULL")
        db.executemany("UPDATE conversations SET rank = ? WHERE id = ?",
                       ((rank, conversation_id) for rank, conversation_id in enumerate(conversation_ids)))
