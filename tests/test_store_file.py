"""kvd's SQLite store when its file is deleted or replaced while kvd runs. SQLite keeps writing to
the file it has open, so before this every pin, audit record and rollout written after an `rm` of
the state folder landed in a deleted file and was gone at the next restart, without a word."""

from __future__ import annotations

import os
import shutil
import sqlite3
import time

import pytest

from kvctl.daemon.store import Store, StoreUnavailable

PIN = {"pin_id": "pin-1", "tenant": "acme", "keys": "00", "owner": "ops", "note": "", "created_at": 1.0,
       "expires_at": None}


def rows(path) -> list[tuple]:
    """What another process opening the file finds: (action, target) of every audit record, oldest first."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute("select action, target from audit order by id").fetchall()
    finally:
        conn.close()


def audit(store: Store, target: str) -> None:
    store.audit(actor="ops", tenant="-", action="evict", target=target, result="ok")


@pytest.mark.parametrize("removed", ["the file", "the folder"])
def test_a_store_deleted_under_kvd_is_written_back_whole_at_the_next_write(tmp_path, caplog, removed):
    path = tmp_path / "state" / "kvd.sqlite3"
    store = Store(path)
    audit(store, "before")
    store.save_pin(PIN)
    if removed == "the file":
        path.unlink()
    else:
        shutil.rmtree(path.parent)
    with caplog.at_level("WARNING", logger="kvd"):
        audit(store, "after")
    assert rows(path) == [("evict", "before"), ("evict", "after")]
    assert [p["pin_id"] for p in Store(path).pins()] == ["pin-1"]  # as the next start finds them
    assert store.written_back == 1 and store.file_ok and store.audit_failures == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"store: {str(path)!r} was deleted under kvd; written back from the open database, nothing lost "
        "(stop kvd first to start a store afresh)"]
    assert sorted(os.listdir(path.parent)) == ["kvd.sqlite3", "kvd.sqlite3-shm", "kvd.sqlite3-wal"]
    store.delete_pin("pin-1")  # the store goes on as before, on the file written back
    assert Store(path).pins() == [] and store.written_back == 1


def test_the_daemon_check_writes_a_deleted_store_back_with_no_write_to_prompt_it(tmp_path):
    path = tmp_path / "kvd.sqlite3"
    store = Store(path)
    audit(store, "kept")
    path.unlink()
    assert store.check_file() is True
    assert rows(path) == [("evict", "kept")]
    assert store.check_file() is True and store.written_back == 1


def test_a_store_replaced_under_kvd_is_not_written_to_until_a_restart_opens_it(tmp_path, caplog):
    path = tmp_path / "kvd.sqlite3"
    store = Store(path)
    audit(store, "before")
    restored = Store(tmp_path / "backup.sqlite3")  # an operator's backup, moved into place
    audit(restored, "in the backup")
    restored.close()
    os.replace(tmp_path / "backup.sqlite3", path)
    with pytest.raises(StoreUnavailable) as refused:
        store.save_pin(PIN)
    assert str(refused.value) == (f"store: {str(path)!r} was replaced under kvd (another file stands at that path "
                                  "now); nothing is written to either until kvd restarts and opens the one there")
    assert not store.file_ok
    with caplog.at_level("ERROR", logger="kvd"):
        audit(store, "refused")  # the action happened: its record goes to the log whole
        assert store.check_file() is False and store.check_file() is False
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith(f"audit record not stored: store: {str(path)!r} was replaced under kvd")
    assert messages[1:] == [str(refused.value)]  # the daemon's check says it once, not every round
    assert store.audit_failures == 1
    assert rows(path) == [("evict", "in the backup")]  # the file put there is untouched
    assert Store(path).pins() == []
    assert [e["target"] for e in store.audit_since()] == ["before"]  # kvd still reads its own records


def test_writes_to_the_file_put_in_its_place_are_never_taken_by_kvds_store(tmp_path):
    """The WAL and its index lie beside the path by name. While kvd's connection kept them, its
    checks (a checkpoint each) took another process's writes to the new file into the replaced
    one, and they were gone from the new file."""
    path = tmp_path / "kvd.sqlite3"
    store = Store(path)
    audit(store, "kvd's")
    restored = Store(tmp_path / "backup.sqlite3")
    audit(restored, "in the backup")
    restored.close()
    os.replace(tmp_path / "backup.sqlite3", path)
    assert store.check_file() is False  # found out: kvd lets the old file go
    other = Store(path)  # kvctl, say, writing to the store now there
    other.audit(actor="kvctl", tenant="-", action="adr.new", target="adr:1", result="ok")
    assert store.check_file() is False and store.check_file() is False
    assert rows(path) == [("evict", "in the backup"), ("adr.new", "adr:1")]
    assert [e["target"] for e in store.audit_since()] == ["kvd's"]
    other.close()
    store.close()  # as kvd stopping for the restart does
    assert rows(path) == [("evict", "in the backup"), ("adr.new", "adr:1")]


def test_a_deleted_store_that_cannot_be_written_back_refuses_writes_rather_than_lose_them(tmp_path):
    state = tmp_path / "state"
    store = Store(state / "kvd.sqlite3")
    shutil.rmtree(state)
    state.write_text("not a folder")  # the state folder cannot be made again
    with pytest.raises(StoreUnavailable) as refused:
        store.save_pin(PIN)
    assert str(refused.value).startswith(f"store: {str(state / 'kvd.sqlite3')!r} was deleted under kvd and cannot "
                                         "be written back ([Errno 17] File exists: ")
    assert str(refused.value).endswith("); nothing of this change was stored")
    assert not store.file_ok and store.pins() == []
    state.unlink()  # mended: the next write puts the store back, and lands
    store.save_pin(PIN)
    assert [p["pin_id"] for p in Store(state / "kvd.sqlite3").pins()] == ["pin-1"] and store.file_ok


def test_a_file_created_at_the_path_while_writing_back_is_kept_and_kvds_records_set_beside_it(tmp_path,
                                                                                             monkeypatch):
    path = tmp_path / "kvd.sqlite3"
    store = Store(path)
    audit(store, "kvd's")
    path.unlink()
    snapshot = Store._snapshot

    def someone_creates_it_meanwhile(self, folder, prefix):
        made = snapshot(self, folder, prefix)
        other = Store(path)
        audit(other, "theirs")
        other.close()
        return made

    monkeypatch.setattr(Store, "_snapshot", someone_creates_it_meanwhile)
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)
    kept = tmp_path / "kvd.sqlite3.deleted-under-kvd-1800000000"
    with pytest.raises(StoreUnavailable) as refused:
        store.save_pin(PIN)
    assert str(refused.value) == (f"store: {str(path)!r} was deleted under kvd and another file was put there; "
                                  f"kvd's records are kept in {str(kept)!r}; nothing is written until kvd restarts")
    assert rows(path) == [("evict", "theirs")] and rows(kept) == [("evict", "kvd's")]
    assert store.audit_since()[0]["target"] == "kvd's"  # kvd goes on reading its own records
    with pytest.raises(StoreUnavailable, match="was replaced under kvd"):
        store.save_pin(PIN)
    assert rows(kept) == [("evict", "kvd's")] and not store.file_ok


def wait_for(condition, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_kvd_writes_its_deleted_store_back_by_itself_and_refuses_writes_to_a_replaced_one(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from rich.console import Console

    from kvctl.status_view import render_status

    from .daemon_fixtures import apps, call, start_service, token_table

    service = start_service(tmp_path)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        path = tmp_path / "kvd.sqlite3"
        pinned = call(unix, "POST", "/admin/pins", json={"text": "A system prompt worth keeping across restarts."})
        assert pinned.status_code == 200
        path.unlink()
        assert wait_for(path.exists)  # no write prompted it: the daemon's own check did
        # the file shows before the write-back is done (then it reopens it and counts): wait for the count
        assert wait_for(lambda: service.store.written_back == 1)
        assert [p["pin_id"] for p in Store(path).pins()] == [pinned.json()["pin_id"]]
        metrics = call(unix, "GET", "/metrics").text
        assert "kvd_store_written_back_total 1.0" in metrics and "kvd_store_file_ok 1.0" in metrics

        Store(tmp_path / "other.sqlite3").close()
        os.replace(tmp_path / "other.sqlite3", path)
        assert wait_for(lambda: not service.store.file_ok)
        assert "kvd_store_file_ok 0.0" in call(unix, "GET", "/metrics").text
        refused = call(unix, "POST", "/admin/pins", json={"text": "Another prompt."})
        assert refused.status_code == 503
        assert refused.json()["error"]["message"].startswith(f"store: {str(path)!r} was replaced under kvd")
        assert call(unix, "POST", "/admin/drain", json={}).status_code == 200  # done, its record in the log
        status = call(unix, "GET", "/admin/status").json()
        assert status["store"] == {"file_ok": False, "written_back": 1, "audit_write_failures": 1,
                                   "unstored_rollback": None, "unstored_rollback_kept": None,
                                   "failing_jobs": [], "waiting_writes": 0,
                                   "longest_write_wait_seconds": 0.0}
        console = Console(record=True, width=200)
        render_status(status, console)  # what `kvctl status` shows
        text = " ".join(console.export_text().split())
        assert ("store its file was replaced under kvd: pins, rollouts and records are refused until kvd restarts "
                "and opens the one there") in text
        assert "audit 1 record the store could not take is only in kvd's log" in text
        assert call(unix, "GET", "/admin/pins").json()["pins"][0]["pin_id"] == pinned.json()["pin_id"]
        assert Store(path).pins() == []
    finally:
        service.shutdown(1)


def test_a_read_beside_a_write_that_waits_for_another_process_does_not_wait(tmp_path):
    """kvd's threads share the store. SQLite waits for another process's write lock holding the
    connection's mutex, and pysqlite binds a cached statement's parameters holding the GIL: a
    read by a second thread through the same connection beside a waiting write froze every
    thread of the process (kvd's engine and event loop) until the write gave up. Reads have a
    connection of their own now, and in WAL mode a reader waits for no writer."""
    import threading

    store = Store(tmp_path / "kvd.sqlite3")
    store.audit(actor="ops", tenant="-", action="pin", target="pin-1", result="ok")
    query = "SELECT count(*) FROM audit WHERE actor = ?"
    assert store.read(query, ("ops",)) == [(1,)]  # its statement cached now
    store.conn.execute("PRAGMA busy_timeout=2000")
    shell = sqlite3.connect(tmp_path / "kvd.sqlite3", isolation_level=None)
    shell.execute("BEGIN IMMEDIATE")
    failed: list[str] = []
    pin = {"pin_id": "pin-2", "tenant": "t", "keys": "00", "owner": "o", "note": "", "created_at": 0.0,
           "expires_at": None}

    def write():
        try:
            store.save_pin(pin)
        except StoreUnavailable as exc:
            failed.append(str(exc))

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(0.2)  # the writer waits for the lock by now
    assert store.read(query, ("ops",)) == [(1,)]
    assert [a["target"] for a in store.audit_since()] == ["pin-1"] and store.pins() == []
    assert writer.is_alive() and failed == []  # the reads did not wait for the write
    writer.join(10)
    shell.execute("ROLLBACK")
    assert failed == [f"store: {str(tmp_path / 'kvd.sqlite3')!r} cannot be written now (database is locked: another "
                      "process held its write lock for the 2 s this write waited; a sqlite3 shell left in a "
                      "transaction? a long kvctl db command?); nothing of this change was stored"]
    store.save_pin(pin)  # the lock gone: it lands, and the reader sees it
    assert [p["pin_id"] for p in store.pins()] == ["pin-2"]
