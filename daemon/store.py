"""The SQLite record store: audit log, durable pins, stored runs, architecture decision records.

One database file in the state directory, opened through sqlite-utils with WAL journaling,
`synchronous=FULL`, a busy timeout and foreign keys; every write is one `BEGIN IMMEDIATE`
transaction, so the daemon and several kvctl processes (a cron job among them) can write at
once without losing a row. A Store holds two connections, one that writes (under its lock)
and one that reads (see `Store.read` for why). The schema version lives in `PRAGMA user_version` and moves
forward through `MIGRATIONS`; `PRAGMA quick_check` runs at every open. Pins are stored by
block keys (hex), never by token ids or text.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import sqlite_utils

from kvctl.daemon.file_identity import file_identity


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
    (6, """
        ALTER TABLE pins ADD COLUMN space TEXT;
        ALTER TABLE pins ADD COLUMN adapter_id TEXT;
    """),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]
# in the state folder beside the store: a rollback kvd made that the store has not taken yet
# (daemon/server/rollouts.py); it belongs to this store's rollouts (daemon/store_restore.py)
ROLLBACK_PENDING_FILE = "rollback-pending.json"


def _insert_audit(conn: sqlite3.Connection, at: float, actor: str, tenant: str, action: str, target: str,
                  result: str, detail: dict[str, Any] | None) -> None:
    conn.execute("INSERT INTO audit (at, actor, tenant, action, target, result, detail) VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (at, actor, tenant, action, target, result, json.dumps(detail or {}, sort_keys=True)))


BUSY_TIMEOUT_MS = 30_000  # how long a write waits for another process's write lock before it fails
WAIT_SAID_AFTER_S = 1.0  # a write that has waited this long to begin calls the Store's `on_wait`


class Store:
    def __init__(self, path: str | Path, on_wait: Callable[[], object] | None = None) -> None:
        """`on_wait`: called (on a timer thread) once a write has waited WAIT_SAID_AFTER_S to begin, as
        while another process holds the write lock: kvctl says so rather than hang without a word."""
        path = Path(path)
        self.on_wait = on_wait
        path.parent.mkdir(parents=True, exist_ok=True)
        self._read_lock = threading.RLock()  # the reading connection's; held across a swap of connections too
        self._reader: sqlite3.Connection | None = None
        try:
            self._open_connection(path)
            problems = [row[0] for row in self.conn.execute("PRAGMA quick_check")]
        except sqlite3.DatabaseError as exc:  # not a database, unreadable, a read-only folder for its WAL
            raise StoreError(f"store: {str(path)!r} cannot be opened: {exc}") from None
        self.path = path
        self._lock = threading.RLock()  # the writing connection, shared by the daemon's threads: every use holds this
        self._waits_lock = threading.Lock()
        self._tickets = itertools.count()
        self._waiting: dict[int, float] = {}  # writes waiting to begin, by ticket: since when (monotonic)
        self.writes = 0  # writes begun or refused
        self.write_wait_seconds = 0.0  # their waits to begin, summed
        self.audit_failures = 0  # audit records the database could not take (the log holds them)
        self.written_back = 0  # times the file was deleted under this Store and written back
        self._identity = file_identity(path)  # which file the connection has open
        self.file_ok = True  # the file at `path` is the one open (False: replaced, or gone and not written back)
        self._detached = False  # reading a copy in memory: another file stands at `path`
        self._said: str | None = None  # the last trouble with the file check_file logged
        if problems != ["ok"]:
            raise StoreError(f"store: {str(path)!r} failed quick_check: {'; '.join(problems[:3])}")
        self._migrate()

    @contextlib.contextmanager
    def write(self, wait: float | None = None) -> Iterator[sqlite3.Connection]:
        """One writer transaction (BEGIN IMMEDIATE): all of it lands, or none of it. A write the
        database cannot take now (`database or disk is full`, a read-only file) is StoreUnavailable.
        Writes waiting to begin (for kvd's other writes, or for another process that holds the
        write lock) are counted: `waiting_writes`, `write_wait_seconds`. `wait`: seconds to wait
        to begin at most (default: the busy timeout, 30 s), for a write that must not hold up
        what comes after it, such as kvd's stop."""
        ticket, began = next(self._tickets), time.monotonic()
        with self._waits_lock:
            self._waiting[ticket] = began
        said = None
        if self.on_wait is not None:
            said = threading.Timer(WAIT_SAID_AFTER_S, self.on_wait)
            said.daemon = True
            said.start()
        def begun_or_refused() -> None:
            if said is not None:
                said.cancel()
            with self._waits_lock:
                del self._waiting[ticket]
                self.writes += 1
                self.write_wait_seconds += time.monotonic() - began

        if not self._lock.acquire(timeout=-1 if wait is None else wait):  # behind kvd's other writes
            begun_or_refused()
            raise StoreUnavailable(f"store: {str(self.path)!r} cannot be written now (another of kvd's writes held "
                                   f"it for the {wait:.0f} s this write could wait); nothing of this change was stored")
        try:
            try:
                self._check_file()
                if wait is not None:  # what is left of it, after kvd's other writes
                    left = max(0.0, wait - (time.monotonic() - began))
                    self.conn.execute(f"PRAGMA busy_timeout={int(left * 1000)}")
                try:
                    self.conn.execute("BEGIN IMMEDIATE")
                except sqlite3.OperationalError as exc:
                    raise self._unavailable(exc, waited=time.monotonic() - began) from None
                finally:
                    if wait is not None:
                        self.conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            finally:
                begun_or_refused()
            try:
                yield self.conn
                self.conn.execute("COMMIT")
            except BaseException as exc:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.OperationalError):
                    raise self._unavailable(exc) from None
                raise
        finally:
            self._lock.release()

    def waiting_writes(self) -> tuple[int, float]:
        """(writes waiting to begin now, seconds the longest of them has waited)."""
        with self._waits_lock:
            starts = list(self._waiting.values())
        return len(starts), (time.monotonic() - min(starts)) if starts else 0.0

    def read(self, sql: str, params: tuple | dict = ()) -> list[tuple]:
        """The rows of one query, through the reading connection (`_reader`).

        NOTE: reads never use the writing connection. SQLite waits for another process's write
        lock holding that connection's mutex, and pysqlite binds a cached statement's parameters
        holding the GIL: a read by another thread beside a write that waited froze every thread
        of kvd, the engine's and the event loop's, for as long as the write waited (24 s of no
        token, scripts/store-locked). A read there could also land inside another thread's open
        write transaction. In WAL mode a reader waits for no writer."""
        with self._read_lock:
            return self._reader.execute(sql, params).fetchall()

    def _query(self, sql: str, params: list | tuple = ()) -> list[dict]:
        """`read`, each row a dict by column name."""
        with self._read_lock:
            return list(self._read_db.query(sql, params))

    def read_one(self, sql: str, params: tuple | dict = ()) -> tuple | None:
        """The first row of one query (None: no row), as `read`."""
        rows = self.read(sql, params)
        return rows[0] if rows else None

    def _unavailable(self, exc: sqlite3.OperationalError, waited: float | None = None) -> StoreUnavailable:
        why = str(exc)
        if waited is not None and (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == sqlite3.SQLITE_BUSY:
            why = (f"{exc}: another process held its write lock for the {waited:.0f} s this write waited; a "
                   "sqlite3 shell left in a transaction? a long kvctl db command?")
        return StoreUnavailable(f"store: {str(self.path)!r} cannot be written now ({why}); nothing of this "
                                f"change was stored")

    def _open_connection(self, path: Path) -> None:
        """The writing connection (`conn`, used under `_lock`) and the reading one (`_reader`,
        under `_read_lock`; see `read`)."""
        conn = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        reader = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
        reader.execute("PRAGMA query_only=ON")
        reader.execute("SELECT count(*) FROM sqlite_master").fetchone()  # its WAL and index open now, as the writer's
        self.conn = conn
        self._set_reader(reader)

    def _set_reader(self, reader: sqlite3.Connection | None) -> None:
        """Put `reader` in place of the reading connection, closing the one there (None: none now)."""
        with self._read_lock:
            old = self._reader
            if old is not None and old is not reader and old is not self.conn:
                old.close()
            self._reader = reader
            self._read_db = None if reader is None else sqlite_utils.Database(reader)

    # ---- the file under the open connection -------------------------------------------------
    def check_file(self) -> bool:
        """Whether the open database is still the file at `path`, mending what can be mended: the
        daemon calls this every few seconds, and every write does. A file deleted under it (an
        `rm`, a cleanup of the state folder) would take every later write with it at the next
        restart: it is written back from the open connection, whole, and a warning says so. A
        file put in its place (a backup moved there) is left alone and not written to: the old
        file is let go (its records read from a copy in memory), each write is StoreUnavailable
        until kvd restarts and opens the new one, and an ERROR says so once."""
        with self._lock:
            try:
                self._check_file()
            except StoreUnavailable as exc:
                if self._said != str(exc):
                    self._said = str(exc)
                    log.error("%s", exc)
                return False
            self._said = None
            return True

    def _check_file(self) -> None:
        self.file_ok = False  # until it is found (or made) so
        identity = file_identity(self.path)
        if identity == self._identity:
            self.file_ok = True
            return
        if identity is None:
            self._write_back()
            return
        if not self._detached:
            self._detach()
        raise StoreUnavailable(f"store: {str(self.path)!r} was replaced under kvd (another file stands at that "
                               f"path now); nothing is written to either until kvd restarts and opens the one there")

    def _let_go(self) -> None:
        """Empty the open connection's WAL into the file it has open, then close it. The WAL and its
        index lie beside `path` by name, and whatever file stands at `path` now would read them as
        its own: pages of one database laid over another, or (a checkpoint by this connection
        later) another process's writes to that file taken into this one's. Done at once, while
        those names are still this connection's."""
        self._set_reader(None)  # first: the last connection to close would checkpoint by those names
        try:
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:  # another process reading the old file holds it: say so, go on
            log.warning("store: the WAL beside %r could not be emptied (%s)", str(self.path), exc)
        self.conn.close()

    def _detach(self) -> None:
        """Another file stands at `path`: this Store's records are read from a copy in memory from
        now on (writes are refused before they reach it), and the file it had open is let go."""
        copy = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self.conn.backup(copy)
        with self._read_lock:  # no read meanwhile
            self._let_go()
            self.conn = copy
            self._set_reader(copy)  # (writes are refused before they reach it)
        self._detached = True

    def _write_back(self) -> None:
        """Put the database back at `path` from the open connection (it reads the deleted file and
        its WAL through their open descriptors): copied whole to a temporary file beside it, the old
        connection closed, then linked in, so that a file someone created there meanwhile is never
        overwritten. What cannot be written back refuses the write (StoreUnavailable), as a full
        disk does: a write into the deleted file would be gone at the next restart."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._snapshot(self.path.parent, f".{self.path.name}.restore-")
        except (OSError, sqlite3.Error) as exc:
            raise StoreUnavailable(f"store: {str(self.path)!r} was deleted under kvd and cannot be written back "
                                   f"({exc}); nothing of this change was stored") from None
        with self._read_lock:  # no read meanwhile
            self._swap_in(tmp)

    def _swap_in(self, tmp: str) -> None:
        """`_write_back`'s second half: the old connections closed, the copy `tmp` linked in and opened."""
        self._let_go()
        try:
            os.link(tmp, self.path)
        except FileExistsError:  # a file appeared there meanwhile: keep ours beside it, and say where
            kept = self.path.with_name(f"{self.path.name}.deleted-under-kvd-{int(time.time())}")
            os.replace(tmp, kept)
            self._open_connection(kept)
            self._identity = file_identity(kept)
            self._detached = False
            raise StoreUnavailable(f"store: {str(self.path)!r} was deleted under kvd and another file was put "
                                   f"there; kvd's records are kept in {str(kept)!r}; nothing is written until "
                                   f"kvd restarts") from None
        os.unlink(tmp)
        self._open_connection(self.path)
        self._identity = file_identity(self.path)
        self._detached = False
        self.written_back += 1
        self.file_ok = True
        log.warning("store: %r was deleted under kvd; written back from the open database, nothing lost "
                    "(stop kvd first to start a store afresh)", str(self.path))

    @property
    def schema_version(self) -> int:
        return self.read("PRAGMA user_version")[0][0]

    def _migrate(self) -> None:
        """Bring the schema to SCHEMA_VERSION. A store already there is only read: a kvd that starts
        while another process holds the write lock (a sqlite3 shell) waits for nothing."""
        if self.schema_version == SCHEMA_VERSION:
            return
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
                _insert_audit(conn, at, actor, tenant, action, target, result, detail)
        except StoreUnavailable as exc:
            self.audit_failures += 1
            log.error("audit record not stored: %s; the record: %s", exc, json.dumps(
                {"at": at, "actor": actor, "tenant": tenant, "action": action, "target": target, "result": result,
                 "detail": detail or {}}, sort_keys=True))

    def prune_audit(self, before: float, *, actor: str, dry_run: bool = False, batch: int = 20_000,
                    pause: float = 0.05) -> dict:
        """Remove the audit records from before `before` (a time.time()), recording that first: the
        `db.prune` record (who, how many) lands in one transaction with the first `batch` removed,
        the rest go `batch` at a time, a `pause` between. In one transaction, 1.5 million rows held
        the database for 1.4 s, and kvd's writes (its engine thread's, as a pin's TTL ends) waited
        that long, no token moving (scripts/prune-wait). A prune cut short leaves its record and
        the rows it had not reached: run it again. `dry_run` counts and changes nothing. The file
        does not shrink; SQLite reuses the pages."""
        count = ("SELECT coalesce(sum(at < :before), 0), coalesce(sum(at >= :before), 0), "
                 "min(CASE WHEN at >= :before THEN at END) FROM audit")
        with self._lock:  # counted outside any write (a scan of the index): no row comes back from the past
            removed, kept, oldest = self.conn.execute(count, {"before": before}).fetchone()
        if not dry_run:
            delete = "DELETE FROM audit WHERE id IN (SELECT id FROM audit WHERE at < ? LIMIT ?)"
            with self.write() as conn:
                _insert_audit(conn, time.time(), actor, "-", "db.prune", "audit", "ok",
                              {"before": before, "removed": removed})
                gone = conn.execute(delete, (before, batch)).rowcount
            while gone == batch:  # SQLite's busy wait is no queue: a writer that never pauses keeps the lock
                time.sleep(pause)
                with self.write() as conn:
                    gone = conn.execute(delete, (before, batch)).rowcount
            with self._lock:
                _, kept, oldest = self.conn.execute(count, {"before": before}).fetchone()
        return {"removed": removed, "kept": kept, "oldest_kept": oldest, "before": before, "dry_run": dry_run}

    def audit_since(self, since: float = 0.0, limit: int = 1000, action: str | None = None,
                    result: str | None = None, actor: str | None = None, tenant: str | None = None,
                    target: str | None = None) -> list[dict]:
        """The audit records from `since` on (a time.time()), newest first, at most `limit`; only
        those of `action`, `result`, `actor`, `tenant` and `target` (a pin's id, `tenant=acme`)
        where given (each matched whole)."""
        matched = {k: v for k, v in (("action", action), ("result", result), ("actor", actor), ("tenant", tenant),
                                     ("target", target)) if v}
        sql = "select * from audit where at >= ?" + "".join(f" and {column} = ?" for column in matched) + \
              " order by id desc limit ?"
        rows = self._query(sql, [since, *matched.values(), limit])
        return [{**row, "detail": json.loads(row["detail"])} for row in rows]

    # ---- pins ----------------------------------------------------------------------------
    def save_pin(self, pin: dict) -> None:
        """Store a pin: pin_id, tenant, keys (hex, comma-separated), owner, note, created_at,
        expires_at, and where its keys were made (space, adapter_id: None where not known)."""
        row = {"space": None, "adapter_id": None, **pin}
        with self.write() as conn:
            conn.execute("INSERT OR REPLACE INTO pins (pin_id, tenant, keys, owner, note, created_at, expires_at, "
                         "space, adapter_id) VALUES (:pin_id, :tenant, :keys, :owner, :note, :created_at, "
                         ":expires_at, :space, :adapter_id)", row)

    def delete_pin(self, pin_id: str) -> None:
        with self.write() as conn:
            conn.execute("DELETE FROM pins WHERE pin_id = ?", (pin_id,))

    def pins(self) -> list[dict]:
        return self._query("select * from pins order by created_at")

    # ---- runs ----------------------------------------------------------------------------
    def save_run(self, kind: str, document: dict) -> int:
        """Store a benchmark, replay or calibration result; returns its id for ADRs and --compare."""
        with self.write() as conn:
            cursor = conn.execute("INSERT INTO runs (at, kind, document) VALUES (?, ?, ?)",
                                  (time.time(), kind, json.dumps(document, sort_keys=True)))
            return cursor.lastrowid

    def get_run(self, run_id: int) -> dict | None:
        rows = self._query("select * from runs where id = ?", [run_id])
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
        rows = self._query(sql, [model_revision, dtype])
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
        with self._lock:
            tmp = self._snapshot(destination.parent, ".backup-")
        try:
            os.replace(tmp, destination)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return destination

    def _snapshot(self, folder: Path, prefix: str) -> str:
        """A consistent copy of the open database (SQLite's backup API) in a new file in `folder`."""
        fd, tmp = tempfile.mkstemp(prefix=prefix, dir=folder)
        os.close(fd)
        try:
            target = sqlite3.connect(tmp)
            try:
                self.conn.backup(target)
            finally:
                target.close()
        except BaseException:
            os.unlink(tmp)
            raise
        return tmp

    def close(self, wait: float | None = None) -> bool:
        """Close both connections; False when a write of another thread still held the writing one
        after `wait` seconds (one waiting for another process's write lock holds its mutex, so a
        close would wait with it): that one is left to end with the process."""
        self._set_reader(None)
        if not self._lock.acquire(timeout=-1 if wait is None else wait):
            return False
        try:
            self.conn.close()
        finally:
            self._lock.release()
        return True
