"""The daemon's SQLite records: the audit log of mutating admin calls and durable pins.

One database file in the state directory, opened through sqlite-utils in WAL mode with a
busy timeout, so kvctl processes and the daemon can write at once. Pins are stored by
block keys (hex), never by token ids or text.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import sqlite_utils

SCHEMA_VERSION = 1


class Store:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA busy_timeout=30000")
        conn.execute("PRAGMA foreign_keys=ON")
        self.db = sqlite_utils.Database(conn)
        self.path = path
        self._lock = threading.Lock()  # one connection, shared by the daemon's threads
        self._migrate()

    def _migrate(self) -> None:
        if "audit" not in self.db.table_names():
            self.db["audit"].create({"id": int, "at": float, "actor": str, "tenant": str, "action": str,
                                     "target": str, "result": str, "detail": str}, pk="id")
        if "pins" not in self.db.table_names():
            self.db["pins"].create({"pin_id": str, "tenant": str, "keys": str, "owner": str, "note": str,
                                    "created_at": float, "expires_at": float}, pk="pin_id")
        if "runs" not in self.db.table_names():
            self.db["runs"].create({"id": int, "at": float, "kind": str, "document": str}, pk="id")
        self.db.execute("PRAGMA user_version = %d" % SCHEMA_VERSION)

    def audit(self, *, actor: str, tenant: str, action: str, target: str, result: str,
              detail: dict[str, Any] | None = None) -> None:
        with self._lock, self.db.conn:
            self.db["audit"].insert({"at": time.time(), "actor": actor, "tenant": tenant, "action": action,
                                     "target": target, "result": result,
                                     "detail": json.dumps(detail or {}, sort_keys=True)})

    def audit_since(self, since: float = 0.0, limit: int = 1000) -> list[dict]:
        with self._lock:
            rows = list(self.db.query("select * from audit where at >= ? order by id desc limit ?",
                                      [since, limit]))
        return [{**row, "detail": json.loads(row["detail"])} for row in rows]

    def save_pin(self, pin: dict) -> None:
        with self._lock, self.db.conn:
            self.db["pins"].upsert(pin, pk="pin_id")

    def delete_pin(self, pin_id: str) -> None:
        with self._lock, self.db.conn:
            self.db["pins"].delete_where("pin_id = ?", [pin_id])

    def pins(self) -> list[dict]:
        with self._lock:
            return list(self.db["pins"].rows)

    def save_run(self, kind: str, document: dict) -> int:
        """Store a benchmark or replay result; returns its id for ADRs and --compare."""
        with self._lock, self.db.conn:
            table = self.db["runs"].insert({"at": time.time(), "kind": kind,
                                            "document": json.dumps(document, sort_keys=True)})
            return table.last_pk

    def get_run(self, run_id: int) -> dict | None:
        with self._lock:
            rows = list(self.db.query("select * from runs where id = ?", [run_id]))
        if not rows:
            return None
        return {**rows[0], "document": json.loads(rows[0]["document"])}

    def close(self) -> None:
        self.db.conn.close()
