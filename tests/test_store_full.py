"""kvd when its SQLite store cannot be written (the filesystem full, the file read-only): what an
operator asks either happens and is recorded, or does not happen and says so. A pin that could not
be stored stayed pinned in memory behind a 500; an eviction, a drain or a cancel that had happened
answered 500 because its audit record could not be written."""

from __future__ import annotations

import json
import sqlite3

import pytest

from kvctl.daemon.store import Store, StoreUnavailable

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from .daemon_fixtures import apps, call, start_service, token_table  # noqa: E402

PROMPT = "A shared system prompt for the support bot, long enough for a few blocks of tokens."


class FullDisk:
    """The store's connection on a full filesystem: `at` (BEGIN or COMMIT) fails as SQLite does."""

    def __init__(self, conn, at: str = "BEGIN") -> None:
        self._conn, self._at = conn, at

    def execute(self, sql, *args):
        if sql.startswith(self._at):
            raise sqlite3.OperationalError("database or disk is full")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._conn, name)


@pytest.mark.parametrize("at", ["BEGIN", "COMMIT"])
def test_a_write_the_database_cannot_take_lands_not_at_all_and_says_where(tmp_path, at):
    store = Store(tmp_path / "kvd.sqlite3")
    real = store.conn
    store.conn = FullDisk(real, at)
    with pytest.raises(StoreUnavailable) as refused:
        store.save_pin({"pin_id": "pin-1", "tenant": "acme", "keys": "00", "owner": "ops", "note": "",
                        "created_at": 1.0, "expires_at": None})
    assert str(refused.value) == (f"store: {str(tmp_path / 'kvd.sqlite3')!r} cannot be written now (database or "
                                  "disk is full); nothing of this change was stored")
    store.conn = real
    assert store.pins() == [] and not real.in_transaction


def test_a_pin_is_stored_or_not_made_and_a_done_action_keeps_its_record_in_the_log(tmp_path, caplog):
    service = start_service(tmp_path)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        store, real = service.store, service.store.conn
        store.conn = FullDisk(real)
        refused = call(unix, "POST", "/admin/pins", json={"text": PROMPT})
        assert refused.status_code == 503
        assert refused.json()["error"]["message"].endswith("nothing of this change was stored: nothing was pinned")
        assert call(unix, "GET", "/admin/pins").json()["pins"] == []  # not pinned in memory either
        with caplog.at_level("ERROR", logger="kvd"):
            evicted = call(unix, "POST", "/admin/evict", json={"all_unpinned": True})
        assert evicted.status_code == 200 and evicted.json()["result"] == "ok"  # it happened: it says so
        [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("audit record not stored")]
        record = json.loads(line.split("; the record: ", 1)[1])
        assert (record["action"], record["target"], record["result"]) == ("evict", "all_unpinned", "ok")
        assert store.audit_failures == 1
        assert "kvd_audit_write_failures_total 1.0" in call(unix, "GET", "/metrics").text

        store.conn = real
        pinned = call(unix, "POST", "/admin/pins", json={"text": PROMPT}).json()
        store.conn = FullDisk(real)
        kept = call(unix, "DELETE", f"/admin/pins/{pinned['pin_id']}")
        assert kept.status_code == 503 and kept.json()["error"]["message"].endswith(": the pin stands")
        assert [p["pin_id"] for p in call(unix, "GET", "/admin/pins").json()["pins"]] == [pinned["pin_id"]]
        assert [row["pin_id"] for row in store.pins()] == [pinned["pin_id"]]  # as it will be after a restart
        store.conn = real
        assert call(unix, "DELETE", f"/admin/pins/{pinned['pin_id']}").status_code == 200
        assert store.pins() == [] and call(unix, "GET", "/admin/pins").json()["pins"] == []
    finally:
        service.shutdown(1)
