"""The SQLite record store: audit log, durable pins, stored runs, architecture decision records.

One database file in the state directory, opened through sqlite-utils with WAL journaling,
`synchronous=FULL`, a busy timeout and foreign keys; every write is one `BEGIN IMMEDIATE`
transaction, so the daemon and several kvctl processes (a cron job among them) can write at
once without losing a row. The schema version lives in `PRAGMA user_version` and moves
forward through `MIGRATIONS`; `PRAGMA quick_check` runs at every open. Pins are stored by
block keys (hex), never by token ids or text.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import sqlite_utils


log = logging.getLogger("kvd")


class StoreError(RuntimeError):
    """The database cannot be used as it is; the message says why and where."""


class StoreUnavailable(StoreError):
    """A write did not land (its filesystem full or read-only, an I/O error): nothing of it did."""


MIGRATIONS: list[tuple[int, str]] = [
    (1, """
        CREATE TABLE IF NOT EXISTS audit (id INTEGER PRIMARY KEY, at FLOAT, actor TEXT, tenant TEXT,
            action TEXT, target TEXT, result TEXT, detail TEXT);
        CREATE TABLE IF NOT EXISTS pins (pin_id TEXT PRIMARY KEY, tenant TEXT, keys TEXT, owner TEXT,
            note TEXT, created_at FLOAT, expires_at FLOAT);
    """),
    (2, """
        CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY, at FLOAT, kind TEXT, document TEXT);
        CREATE INDEX IF NOT EXISTS audit_at ON audit (at);
    """),
    (3, """
        CREATE TABLE IF NOT EXISTS adrs (id INTEGER PRIMARY KEY, created_at FLOAT, status TEXT NOT NULL,
            superseded_by INTEGER REFERENCES adrs (id));
        CREATE TABLE IF NOT EXISTS adr_revisions (adr_id INTEGER NOT NULL REFERENCES adrs (id),
            revision INTEGER NOT NULL, at FLOAT, author TEXT, title TEXT, body TEXT,
            PRIMARY KEY (adr_id, revision));
    """),
    (4, """
        CREATE TABLE IF NOT EXISTS rollouts (id INTEGER PRIMARY KEY, created_at FLOAT, state TEXT NOT NULL,
            fraction FLOAT NOT NULL, policy TEXT NOT NULL, stops TEXT NOT NULL,
            adr_id INTEGER REFERENCES adrs (id), actor TEXT);
        CREATE TABLE IF NOT EXISTS rollout_events (id INTEGER PRIMARY KEY,
            rollout_id INTEGER NOT NULL REFERENCES rollouts (id), at FLOAT, actor TEXT, action TEXT,
            detail TEXT);
    """),
    (5, """
        CREATE TABLE IF NOT EXISTS calibrations (id INTEGER PRIMARY KEY, created_at FLOAT, model_revision TEXT,
            dtype TEXT, margin FLOAT, max_kl FLOAT, scales TEXT, keep_layers TEXT, report TEXT,
            prompts_digest TEXT, meets_target INTEGER, applied_at FLOAT);
    """),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]


class Store:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA busy_timeout=30000")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            problems = [row[0] for row in conn.execute("PRAGMA quick_check")]
        except sqlite3.DatabaseError as exc:  # not a database, unreadable, a read-only folder for its WAL
            raise StoreError(f"store: {str(path)!r} cannot be opened: {exc}") from None
        self.db = sqlite_utils.Database(conn)
        self.conn = conn
        self.path = path
        self._lock = threading.RLock()  # one connection, shared by the daemon's threads
        self.audit_failures = 0  # audit records the database could not take (the log holds them)
        if problems != ["ok"]:
            raise StoreError(f"store: {str(path)!r} failed quick_check: {'; '.join(problems[:3])}")
        self._migrate()

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One writer transaction (BEGIN IMMEDIATE): all of it lands, or none of it. A write the
        database cannot take now (`database or disk is full`, a read-only file) is StoreUnavailable."""
        with self._lock:
            try:
                self.conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                raise self._unavailable(exc) from None
            try:
                yield self.conn
                self.conn.execute("COMMIT")
            except BaseException as exc:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.OperationalError):
                    raise self._unavailable(exc) from None
                raise

    def _unavailable(self, exc: sqlite3.OperationalError) -> StoreUnavailable:
        return StoreUnavailable(f"store: {str(self.path)!r} cannot be written now ({exc}); nothing of this "
                                f"change was stored")

    @property
    def schema_version(self) -> int:
        return self.conn.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self) -> None:
        with self.write() as conn:
            current = conn.execute("PRAGMA user_version").fetchone()[0]
            if current > SCHEMA_VERSION:
                raise StoreError(f"store: {str(self.path)!r} has schema {current}, newer than this "
                                 f"kvctl's {SCHEMA_VERSION}; upgrade kvctl")
            for version, script in MIGRATIONS:
                if version > current:
                    for statement in filter(str.strip, script.split(";")):
                        conn.execute(statement)
                    conn.execute(f"PRAGMA user_version = {version}")

    # ---- audit ---------------------------------------------------------------------------
    def audit(self, *, actor: str, tenant: str, action: str, target: str, result: str,
              detail: dict[str, Any] | None = None) -> None:
        """Record an operator's action. It has happened by now: when the store cannot take the
        record, the log does (an ERROR line holding it whole) and `audit_failures` counts it."""
        at = time.time()
        try:
            with self.write() as conn:
                conn.execute("INSERT INTO audit (at, actor, tenant, action, target, result, detail) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (at, actor, tenant, action, target, result, json.dumps(detail or {}, sort_keys=True)))
        except StoreUnavailable as exc:
            self.audit_failures += 1
            log.error("audit record not stored: %s; the record: %s", exc, json.dumps(
                {"at": at, "actor": actor, "tenant": tenant, "action": action, "target": target, "result": result,
                 "detail": detail or {}}, sort_keys=True))

    def audit_since(self, since: float = 0.0, limit: int = 1000, action: str | None = None) -> list[dict]:
        sql = "select * from audit where at >= ?" + (" and action = ?" if action else "") + \
              " order by id desc limit ?"
        args = [since] + ([action] if action else []) + [limit]
        with self._lock:
            rows = list(self.db.query(sql, args))
        return [{**row, "detail": json.loads(row["detail"])} for row in rows]

    # ---- pins ----------------------------------------------------------------------------
    def save_pin(self, pin: dict) -> None:
        with self.write() as conn:
            conn.execute("INSERT OR REPLACE INTO pins (pin_id, tenant, keys, owner, note, created_at, expires_at) "
                         "VALUES (:pin_id, :tenant, :keys, :owner, :note, :created_at, :expires_at)", pin)

    def delete_pin(self, pin_id: str) -> None:
        with self.write() as conn:
            conn.execute("DELETE FROM pins WHERE pin_id = ?", (pin_id,))

    def pins(self) -> list[dict]:
        with self._lock:
            return list(self.db.query("select * from pins order by created_at"))

    # ---- runs ----------------------------------------------------------------------------
    def save_run(self, kind: str, document: dict) -> int:
        """Store a benchmark, replay or calibration result; returns its id for ADRs and --compare."""
        with self.write() as conn:
            cursor = conn.execute("INSERT INTO runs (at, kind, document) VALUES (?, ?, ?)",
                                  (time.time(), kind, json.dumps(document, sort_keys=True)))
            return cursor.lastrowid

    def get_run(self, run_id: int) -> dict | None:
        with self._lock:
            rows = list(self.db.query("select * from runs where id = ?", [run_id]))
        if not rows:
            return None
        return {**rows[0], "document": json.loads(rows[0]["document"])}

    # ---- calibrations --------------------------------------------------------------------
    def save_calibration(self, row: dict) -> int:
        with self.write() as conn:
            return conn.execute(
                "INSERT INTO calibrations (created_at, model_revision, dtype, margin, max_kl, scales, keep_layers, "
                "report, prompts_digest, meets_target, applied_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL)",
                (time.time(), row["model_revision"], row["dtype"], row["margin"], row["max_kl"],
                 json.dumps(row["scales"]), json.dumps(row["keep_layers"]), json.dumps(row["report"]),
                 row["prompts_digest"], int(row["meets_target"]))).lastrowid

    def mark_calibration_applied(self, calibration_id: int) -> None:
        with self.write() as conn:
            conn.execute("UPDATE calibrations SET applied_at = ? WHERE id = ?", (time.time(), calibration_id))

    def calibration(self, model_revision: str, dtype: str, *, applied: bool) -> dict | None:
        """The newest calibration for the model and format (only applied ones when asked)."""
        sql = ("SELECT * FROM calibrations WHERE model_revision = ? AND dtype = ?"
               + (" AND applied_at IS NOT NULL ORDER BY applied_at DESC" if applied else " ORDER BY id DESC")
               + " LIMIT 1")
        with self._lock:
            rows = list(self.db.query(sql, [model_revision, dtype]))
        if not rows:
            return None
        row = rows[0]
        scales = {int(k): tuple(v) for k, v in json.loads(row["scales"]).items()}
        return {**row, "scales": scales, "keep_layers": tuple(json.loads(row["keep_layers"])),
                "report": json.loads(row["report"]), "meets_target": bool(row["meets_target"])}

    # ---- maintenance ---------------------------------------------------------------------
    def integrity_check(self) -> list[str]:
        with self._lock:
            return [row[0] for row in self.conn.execute("PRAGMA integrity_check")]

    def backup(self, destination: str | Path) -> Path:
        """A consistent copy through SQLite's backup API, published by rename (never torn)."""
        destination = Path(destination)
        destination.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".backup-", dir=destination.parent)
        os.close(fd)
        try:
            target = sqlite3.connect(tmp)
            with self._lock:
                self.conn.backup(target)
            target.close()
            os.replace(tmp, destination)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return destination

    def close(self) -> None:
        self.conn.close()
