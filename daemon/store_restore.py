"""A backup of the SQLite store put back in place (`kvctl db restore`), with nothing lost.

`kvctl db backup` (a cron job) leaves consistent copies. To put one back by hand, an operator
stops kvd and copies it over `kvd.sqlite3`. Three things go wrong that way:

- **A stale `kvd.sqlite3-wal` is replayed onto the copy.** SQLite checks a WAL's frames against
  the WAL's own header, not against the database file, so the old store's unwritten pages land
  in the backup: a malformed database, or silently mixed records.
- **The store being replaced is gone**, with the records it held that the backup lacks.
- **A rollback that kvd kept beside the store** (`rollback-pending.json`) belongs to the old store's
  rollouts, and its id may name another rollout in the backup.

`restore` therefore:

1. Holds the state folder's claim (`kvd.lock`) while it works: a kvd that runs there is named and
   nothing is done; a kvd that starts meanwhile is refused.
2. Checks the backup: a SQLite file that passes `PRAGMA integrity_check`, with a kvd schema no
   newer than this kvctl's.
3. Copies the backup beside the store through SQLite's backup API, and fsyncs the copy.
4. Keeps the store it replaces as `kvd.sqlite3.replaced-STAMP`, with its WAL and any
   `rollback-pending.json`. The old store is checkpointed first where it can be, so the kept file
   is whole by itself. The files are hard links (copies where links fail) until the swap.
5. Removes the old WAL and shared-memory files, then renames the copy over `kvd.sqlite3`. A
   crash anywhere leaves the old store or the restored one, and the kept one whole.
6. Opens the restored store, which migrates an older schema, and records a `db.restore` audit
   record: from which file, what it held, and where the replaced store was kept.

`kvctl db restore` of a `kvd.sqlite3.replaced-…` file undoes a restore the same way.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Callable
from urllib.parse import quote

from kvctl.daemon.folder_claim import FolderTaken, claim_folder
from kvctl.daemon.store import ROLLBACK_PENDING_FILE, SCHEMA_VERSION, Store
from kvctl.daemon.whole_file import sync_folder

STORE_FILE = "kvd.sqlite3"
COUNTED = {"audit records": "audit", "pins": "pins", "decision records": "adrs", "rollouts": "rollouts",
           "calibrations": "calibrations", "stored runs": "runs"}
NEWEST = ("SELECT MAX(at) FROM audit", "SELECT MAX(at) FROM runs", "SELECT MAX(created_at) FROM adrs",
          "SELECT MAX(at) FROM rollout_events", "SELECT MAX(created_at) FROM calibrations")
SQLITE_MAGIC = b"SQLite format 3\x00"


class RestoreRefused(ValueError):
    """Nothing was changed; the message names the field, the value and why."""


def _read_only(path: Path) -> sqlite3.Connection:
    """A connection that reads `path` and writes nothing, beside it either: with no WAL to read,
    `immutable` (SQLite makes no -wal and -shm files next to a backup); with one, read-only."""
    wal = Path(f"{path}-wal")
    has_wal = wal.exists() and wal.stat().st_size > 0
    return sqlite3.connect(f"file:{quote(str(path))}?mode=ro" + ("" if has_wal else "&immutable=1"), uri=True)


def describe(path: Path) -> dict:
    """What a store file holds, read without writing to it: its schema, rows per kind of record,
    the time of its newest record, and `problem` (None when it passes the integrity check)."""
    found = {"path": str(path), "schema": None, "counts": {}, "newest_at": None, "problem": None}
    try:
        with open(path, "rb") as handle:
            if handle.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
                found["problem"] = "not a SQLite database"
                return found
        conn = _read_only(path)
    except (OSError, sqlite3.Error) as exc:
        found["problem"] = str(exc)
        return found
    try:
        checked = [row[0] for row in conn.execute("PRAGMA integrity_check")]
        if checked != ["ok"]:
            found["problem"] = "; ".join(checked[:3])
        found["schema"] = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        found["counts"] = {name: conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                           for name, table in COUNTED.items() if table in tables}
        times = []
        for sql in NEWEST:
            if sql.rsplit(" ", 1)[-1] in tables:
                times.append(conn.execute(sql).fetchone()[0])
        found["newest_at"] = max((t for t in times if t is not None), default=None)
    except sqlite3.Error as exc:
        found["problem"] = found["problem"] or str(exc)
    finally:
        conn.close()
    return found


def _check_backup(backup: Path, store: Path) -> dict:
    if not backup.is_file():
        raise RestoreRefused(f"backup: {str(backup)!r} is not a file")
    if backup.resolve() == store.resolve():
        raise RestoreRefused(f"backup: {str(backup)!r} is the store itself; give a backup of it")
    found = describe(backup)
    if found["problem"] is not None:
        raise RestoreRefused(f"backup: {str(backup)!r} cannot be restored: {found['problem']}")
    if not found["schema"]:
        raise RestoreRefused(f"backup: {str(backup)!r} is a SQLite database but not a kvd store (no kvd schema)")
    if found["schema"] > SCHEMA_VERSION:
        raise RestoreRefused(f"backup: {str(backup)!r} has schema {found['schema']}, newer than this kvctl's "
                             f"{SCHEMA_VERSION}; restore it with the kvctl that wrote it")
    return found


def _copy_in(backup: Path, folder: Path) -> Path:
    """The backup copied into `folder` (SQLite's backup API, so a backup with a WAL of its own is
    copied whole), fsynced; a new file that the caller renames or removes."""
    fd, tmp = tempfile.mkstemp(prefix=".restore-", dir=folder)
    os.close(fd)
    try:
        source = _read_only(backup)
        target = sqlite3.connect(tmp)
        try:
            source.backup(target)
            target.execute("PRAGMA journal_mode = WAL")  # as Store keeps it
        finally:
            target.close()
            source.close()
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def _match_owner(copy: Path, like: Path) -> None:
    """Give the restored file the owner, group and mode of the store it replaces (else the state
    folder's owner and group, mode 0600): kvd runs as its own user, and an operator's `sudo kvctl`
    would otherwise leave it a store that it cannot open for writing."""
    found = os.stat(like)
    try:
        os.chown(copy, found.st_uid, found.st_gid)
    except PermissionError:  # not root: the file is this user's, who is then kvd's user or can say so
        pass
    os.chmod(copy, found.st_mode & 0o777 if like.is_file() else 0o600)


def _checkpoint(store: Path) -> None:
    """Write the store's WAL into its file where it can (best effort: a damaged store is kept with
    its WAL as it is)."""
    try:
        conn = sqlite3.connect(store, timeout=5.0)
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            conn.close()
    except sqlite3.Error:
        pass


def _keep(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, target)


def _aside_name(folder: Path, now: float) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    for n in range(1, 1000):
        name = folder / (f"{STORE_FILE}.replaced-{stamp}" + ("" if n == 1 else f"-{n}"))
        if not any(Path(str(name) + suffix).exists() for suffix in ("", "-wal", "-shm")):
            return name
    raise RestoreRefused(f"state_dir: {str(folder)!r} holds 999 stores replaced at {stamp}")


def restore(folder: Path, backup: Path, *, actor: str, dry_run: bool = False,
            clock: Callable[[], float] = time.time) -> dict:
    """Put `backup` in place of FOLDER/kvd.sqlite3 as the module says; what was done (or, with
    `dry_run`, what would be): the backup's and the current store's `describe`, and where the
    replaced store is kept. Raises RestoreRefused (nothing changed), OSError, and StoreError (the
    restored store could not be opened: it is in place, the replaced one kept)."""
    folder, backup = Path(folder), Path(backup)
    store = folder / STORE_FILE
    if not folder.is_dir():
        raise RestoreRefused(f"state_dir: {str(folder)!r} is not a folder")
    try:
        claim = claim_folder(folder, f"kvctl db restore (pid {os.getpid()})")
    except FolderTaken as taken:
        raise RestoreRefused(f"state_dir: {str(folder)!r} is in use by {taken.holder}; stop that kvd first "
                             "(systemctl stop kvd), then restore") from None
    try:
        restored = _check_backup(backup, store)
        current = describe(store) if store.exists() else None
        report = {"store": str(store), "backup": restored, "replaced": current, "kept_as": None,
                  "dry_run": dry_run}
        if dry_run:
            return report
        copy = _copy_in(backup, folder)
        try:
            _match_owner(copy, store if current is not None else folder)
            pending = folder / ROLLBACK_PENDING_FILE  # the replaced store's rollouts' business
            if current is not None or pending.exists():
                aside = _aside_name(folder, clock())
                if current is not None:
                    _checkpoint(store)
                    _keep(store, aside)
                    for suffix in ("-wal", "-shm"):
                        if Path(str(store) + suffix).exists():
                            _keep(Path(str(store) + suffix), Path(str(aside) + suffix))
                    report["kept_as"] = str(aside)
                if pending.exists():
                    _keep(pending, Path(f"{aside}.{ROLLBACK_PENDING_FILE}"))
                sync_folder(folder)
            for suffix in ("-wal", "-shm"):  # the old store's: replayed onto the copy, they would corrupt it
                Path(str(store) + suffix).unlink(missing_ok=True)
            os.replace(copy, store)
            pending.unlink(missing_ok=True)  # kept above; until the swap it stayed with the old store
            sync_folder(folder)
        except BaseException:
            copy.unlink(missing_ok=True)
            raise
    finally:
        claim.close()
    opened = Store(store)  # migrates a backup of an older schema
    try:
        opened.audit(actor=actor, tenant="-", action="db.restore", target=str(store), result="ok",
                     detail={"backup": str(backup), "backup_newest_at": restored["newest_at"],
                             "backup_counts": restored["counts"], "kept_as": report["kept_as"],
                             "replaced_counts": None if current is None else current["counts"],
                             "replaced_problem": None if current is None else current["problem"]})
        report["schema"] = opened.schema_version
    finally:
        opened.close()
    return report

