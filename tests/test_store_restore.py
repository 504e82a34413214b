"""`kvctl db restore`: a backup put back in place of the store, the replaced store kept whole,
a stale WAL never replayed onto the backup, and nothing changed on a refusal
(daemon/store_restore.py)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest

pytest.importorskip("sqlite_utils")

from kvctl.daemon.folder_claim import claim_folder  # noqa: E402
from kvctl.daemon.records import Records  # noqa: E402
from kvctl.daemon.store import MIGRATIONS, ROLLBACK_PENDING_FILE, SCHEMA_VERSION, Store  # noqa: E402
from kvctl.daemon.store_restore import RestoreRefused, describe, restore  # noqa: E402

from .test_cli import cli  # noqa: E402

ADR = {"context": "c", "decision": "d"}


def titles(path: Path) -> list[str]:
    store = Store(path)
    try:
        return [adr.title for adr in Records(store).list()]
    finally:
        store.close()


def new_adr(path: Path, title: str) -> None:
    store = Store(path)
    try:
        Records(store).new(title, ADR, "ops")
    finally:
        store.close()


def back_up(path: Path, destination: Path) -> None:
    store = Store(path)
    try:
        store.backup(destination)
    finally:
        store.close()


def store_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != "kvd.lock"}


def state_with_backup(tmp_path: Path, before: list[str], after: list[str]) -> Path:
    """A state folder whose store held the records titled `before` when it was backed up to
    tmp_path/b.sqlite3, and holds those titled `after` too now."""
    folder = tmp_path / "state"
    folder.mkdir()
    for title in before:
        new_adr(folder / "kvd.sqlite3", title)
    back_up(folder / "kvd.sqlite3", tmp_path / "b.sqlite3")
    for title in after:
        new_adr(folder / "kvd.sqlite3", title)
    return folder


def killed_with_wal(folder: Path, title: str) -> None:
    """The store as a kvd killed -9 leaves it: its latest record only in kvd.sqlite3-wal."""
    live = folder.parent / "live"
    live.mkdir()
    shutil.copy(folder / "kvd.sqlite3", live / "kvd.sqlite3")
    store = Store(live / "kvd.sqlite3")
    store.conn.execute("PRAGMA wal_autocheckpoint = 0")
    Records(store).new(title, ADR, "ops")
    for name in ("kvd.sqlite3", "kvd.sqlite3-wal", "kvd.sqlite3-shm"):  # copied while it is open
        shutil.copy(live / name, folder / name)
    store.close()
    assert (folder / "kvd.sqlite3-wal").stat().st_size > 0


def test_a_backup_goes_back_in_place_and_the_replaced_store_with_its_wal_is_kept_whole(tmp_path):
    folder = state_with_backup(tmp_path, ["before the backup"], ["after the backup"])
    killed_with_wal(folder, "only in the WAL")
    (folder / ROLLBACK_PENDING_FILE).write_text('{"rollout_id": 1}')

    report = restore(folder, tmp_path / "b.sqlite3", actor="ops", clock=lambda: 1796150528.0)

    kept = folder / "kvd.sqlite3.replaced-20261201T184208Z"
    assert report["kept_as"] == str(kept)
    assert report["backup"]["counts"]["decision records"] == 1
    assert report["replaced"]["counts"]["decision records"] == 3  # the WAL's record read too
    assert report["schema"] == SCHEMA_VERSION
    # the stale WAL was not replayed onto the backup: exactly the backup's records, and a whole file
    assert titles(folder / "kvd.sqlite3") == ["before the backup"]
    assert describe(folder / "kvd.sqlite3")["problem"] is None
    assert titles(kept) == ["before the backup", "after the backup", "only in the WAL"]
    # the rollback kvd kept for the old store's rollouts went with it
    assert not (folder / ROLLBACK_PENDING_FILE).exists()
    assert json.loads((folder / f"{kept.name}.{ROLLBACK_PENDING_FILE}").read_text()) == {"rollout_id": 1}
    store = Store(folder / "kvd.sqlite3")
    [record] = [r for r in store.audit_since(0) if r["action"] == "db.restore"]
    store.close()
    assert record["actor"] == "ops" and record["target"] == str(folder / "kvd.sqlite3")
    detail = record["detail"] if isinstance(record["detail"], dict) else json.loads(record["detail"])
    assert detail["backup"] == str(tmp_path / "b.sqlite3") and detail["kept_as"] == str(kept)
    assert detail["replaced_counts"]["decision records"] == 3 and detail["backup_counts"]["decision records"] == 1

    # restoring the kept file undoes the restore
    again = restore(folder, kept, actor="ops", clock=lambda: 1796150528.0)
    assert again["kept_as"] == str(folder / "kvd.sqlite3.replaced-20261201T184208Z-2")
    assert titles(folder / "kvd.sqlite3") == ["before the backup", "after the backup", "only in the WAL"]
    assert not list(tmp_path.glob("b.sqlite3-*"))  # reading the backup left nothing beside it


def test_nothing_is_changed_while_a_kvd_holds_the_folder_or_for_a_backup_that_is_not_whole(tmp_path):
    folder = state_with_backup(tmp_path, ["current"], [])
    good = tmp_path / "b.sqlite3"
    before = store_files(folder)

    held = claim_folder(folder, "pid 4242, socket /run/kvd/kvd.sock")
    with pytest.raises(RestoreRefused) as refused:
        restore(folder, good, actor="ops")
    held.close()
    assert str(refused.value) == (f"state_dir: {str(folder)!r} is in use by pid 4242, socket /run/kvd/kvd.sock; "
                                  "stop that kvd first (systemctl stop kvd), then restore")

    (tmp_path / "notes.txt").write_text("not a database")
    plain = tmp_path / "plain.sqlite3"
    sqlite3.connect(plain).execute("CREATE TABLE t (x)").connection.close()
    newer = tmp_path / "newer.sqlite3"
    shutil.copy(good, newer)
    conn = sqlite3.connect(newer)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    damaged = tmp_path / "damaged.sqlite3"
    data = bytearray(good.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page + 8: 2 * page] = bytes(page - 8)  # the second page's cells gone: the schema points at nothing
    damaged.write_bytes(bytes(data))
    cases = {
        tmp_path / "missing.sqlite3": "is not a file",
        tmp_path / "notes.txt": "cannot be restored: not a SQLite database",
        plain: "is a SQLite database but not a kvd store (no kvd schema)",
        newer: f"has schema 99, newer than this kvctl's {SCHEMA_VERSION}; restore it with the kvctl that wrote it",
        damaged: "cannot be restored: ",
        folder / "kvd.sqlite3": "is the store itself; give a backup of it",
    }
    for backup, says in cases.items():
        with pytest.raises(RestoreRefused) as refused:
            restore(folder, backup, actor="ops")
        assert str(refused.value).startswith(f"backup: {str(backup)!r} ") and says in str(refused.value), backup
    assert store_files(folder) == before
    assert not list(folder.glob(".restore-*"))


def test_a_dry_run_shows_both_stores_and_changes_nothing(tmp_path):
    folder = state_with_backup(tmp_path, ["one"], ["two"])
    before = store_files(folder)
    report = restore(folder, tmp_path / "b.sqlite3", actor="ops", dry_run=True)
    assert report["dry_run"] is True and report["kept_as"] is None
    assert report["backup"]["counts"]["decision records"] == 1 and report["replaced"]["counts"]["decision records"] == 2
    assert report["replaced"]["newest_at"] > report["backup"]["newest_at"]
    assert store_files(folder) == before


def test_a_backup_of_an_older_schema_is_migrated_and_a_damaged_store_is_kept_as_found(tmp_path):
    folder = tmp_path / "state"
    folder.mkdir()
    old = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(old)
    for version, script in MIGRATIONS[:3]:
        conn.executescript(script)
        conn.execute(f"PRAGMA user_version = {version}")
    conn.execute("INSERT INTO audit (at, actor, tenant, action, target, result, detail) "
                 "VALUES (1.0, 'ops', '-', 'pin', 'p', 'ok', '{}')")
    conn.commit()
    conn.close()
    (folder / "kvd.sqlite3").write_bytes(b"SQLite format 3\x00" + bytes(4080))  # torn: no pages
    report = restore(folder, old, actor="ops")
    assert report["backup"]["schema"] == 3 and report["schema"] == SCHEMA_VERSION
    assert report["replaced"]["problem"] is not None
    assert Path(report["kept_as"]).read_bytes() == b"SQLite format 3\x00" + bytes(4080)
    store = Store(folder / "kvd.sqlite3")
    assert [r["action"] for r in store.audit_since(0)] == ["db.restore", "pin"]  # newest first
    store.close()


def test_kvctl_db_restore_prints_both_stores_and_where_the_replaced_one_is_kept(tmp_path, capsys):
    folder = state_with_backup(tmp_path, ["one"], ["two"])
    state = ["--state-dir", str(folder)]
    status, out, _ = cli(capsys, "db", "restore", str(tmp_path / "b.sqlite3"), *state, "--dry-run")
    assert status == 0 and "would restore" in out and "the store now" in out
    assert "the store now holds records newer than the backup" in out
    assert titles(folder / "kvd.sqlite3") == ["one", "two"]
    status, out, _ = cli(capsys, "db", "restore", str(tmp_path / "b.sqlite3"), *state, "--json")
    assert status == 0
    report = json.loads(out)
    assert Path(report["kept_as"]).name.startswith("kvd.sqlite3.replaced-")
    assert titles(folder / "kvd.sqlite3") == ["one"]
    held = claim_folder(folder, "pid 7, socket /run/kvd/kvd.sock")
    try:
        status, _, err = cli(capsys, "db", "restore", str(tmp_path / "b.sqlite3"), *state)
    finally:
        held.close()
    assert status == 2 and "is in use by pid 7, socket /run/kvd/kvd.sock; stop that kvd first" in err
    assert os.path.exists(report["kept_as"])


@pytest.mark.skipif(os.geteuid() != 0, reason="gives files to another user: needs root")
def test_the_restored_store_keeps_the_owner_and_mode_of_the_one_it_replaces(tmp_path):
    """kvd runs as a user of its own; `sudo kvctl db restore` must not leave it a root-owned store."""
    folder = state_with_backup(tmp_path, ["one"], [])
    os.chown(folder / "kvd.sqlite3", 65534, 65534)
    os.chmod(folder / "kvd.sqlite3", 0o640)
    restore(folder, tmp_path / "b.sqlite3", actor="ops")
    found = os.stat(folder / "kvd.sqlite3")
    assert (found.st_uid, found.st_gid, found.st_mode & 0o777) == (65534, 65534, 0o640)
    os.unlink(folder / "kvd.sqlite3")
    os.chown(folder, 65534, 65534)
    restore(folder, tmp_path / "b.sqlite3", actor="ops")  # no store there: the folder's owner, 0600
    found = os.stat(folder / "kvd.sqlite3")
    assert (found.st_uid, found.st_gid, found.st_mode & 0o777) == (65534, 65534, 0o600)


def test_a_restore_that_fails_at_the_swap_leaves_the_store_and_its_kept_rollback_as_they_were(tmp_path, monkeypatch):
    import kvctl.daemon.store_restore as store_restore

    folder = state_with_backup(tmp_path, ["one"], ["two"])
    (folder / ROLLBACK_PENDING_FILE).write_text('{"rollout_id": 1}')
    before = store_files(folder)

    def no_room(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_restore.os, "replace", no_room)
    with pytest.raises(OSError):
        restore(folder, tmp_path / "b.sqlite3", actor="ops")
    monkeypatch.undo()
    assert {name: data for name, data in store_files(folder).items() if ".replaced-" not in name} == before
    assert not list(folder.glob(".restore-*"))
    assert titles(folder / "kvd.sqlite3") == ["one", "two"]
