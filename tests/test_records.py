"""The SQLite store and decision records: lifecycle, export, migrations, concurrent writers,
a writer killed mid-transaction, backup and check."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sqlite_utils")

from kvctl.daemon.records import Records, RecordError  # noqa: E402
from kvctl.daemon.store import SCHEMA_VERSION, Store, StoreError  # noqa: E402

from .test_cli import cli  # noqa: E402

ADR_TEXT = """# Block size 32 for chat traffic

## Context
Chat prompts share 1-2k token system prompts.

## Alternatives
16 (today), 64.

## Evidence
Replay run:1 shows the hit ratio holds at 32.

## Decision
Use 32.

## Reversal trigger
recomputed_token_ratio above 1.2x baseline.
"""


def test_adr_lifecycle_revisions_and_export(tmp_path, capsys):
    store = Store(tmp_path / "kvd.sqlite3")
    run_id = store.save_run("bench_replay", {"runs": []})
    assert run_id == 1
    (tmp_path / "adr.md").write_text(ADR_TEXT)
    state = ["--state-dir", str(tmp_path)]
    status, out, _ = cli(capsys, "adr", "new", "--title", "ignored", "--from-file", str(tmp_path / "adr.md"),
                         "--author", "ops", *state, "--json")
    assert status == 0
    first = json.loads(out)
    assert (first["id"], first["status"], first["title"], first["revision"]) == (
        1, "proposed", "Block size 32 for chat traffic", 1)
    assert first["evidence_runs"] == [1] and first["fields"]["decision"] == "Use 32."
    (tmp_path / "more.md").write_text("## Unresolved risks\nLong documents fragment more.\n")
    status, out, _ = cli(capsys, "adr", "edit", "1", "--from-file", str(tmp_path / "more.md"), *state, "--json")
    edited = json.loads(out)
    assert edited["revision"] == 2 and edited["fields"]["decision"] == "Use 32."
    assert edited["fields"]["unresolved_risks"] == "Long documents fragment more."
    records = Records(Store(tmp_path / "kvd.sqlite3"))
    assert [r["revision"] for r in records.revisions(1)] == [1, 2]  # nothing rewritten
    assert cli(capsys, "adr", "accept", "1", *state)[0] == 0
    status, _, err = cli(capsys, "adr", "reject", "1", *state)
    assert status == 2 and "adr 1: cannot become rejected from accepted (only from proposed)" in err
    cli(capsys, "adr", "new", "--title", "Block size 64 after all", *state)
    assert cli(capsys, "adr", "supersede", "1", "--by", "2", *state)[0] == 0
    status, out, _ = cli(capsys, "adr", "list", "--status", "superseded", *state, "--json")
    assert [(a["id"], a["superseded_by"]) for a in json.loads(out)] == [(1, 2)]
    status, out, _ = cli(capsys, "adr", "export", str(tmp_path / "docs"), *state, "--json")
    files = sorted(os.path.basename(p) for p in json.loads(out)["written"])
    assert files == ["0001-block-size-32-for-chat-traffic.md", "0002-block-size-64-after-all.md"]
    (tmp_path / "a-file").write_text("keep")
    status, _, err = cli(capsys, "adr", "export", str(tmp_path / "a-file"), *state)
    assert status == 2 and err.strip() == f"error: folder: {str(tmp_path / 'a-file')!r} is a file; give a folder for the records"
    text = (tmp_path / "docs" / files[0]).read_text()
    assert "Status: superseded (superseded by ADR 2)" in text and "## Reversal trigger" in text
    actions = [e["action"] for e in store.audit_since(0)]
    assert actions[:4] == ["adr.superseded", "adr.new", "adr.accepted", "adr.edit"]


def test_adr_errors_name_the_problem(tmp_path, capsys):
    state = ["--state-dir", str(tmp_path)]
    (tmp_path / "bad.md").write_text("## Evidence\nsee run:42\n")
    status, _, err = cli(capsys, "adr", "new", "--title", "T", "--from-file", str(tmp_path / "bad.md"), *state)
    assert status == 2 and "evidence: run:42 is not a stored run" in err
    (tmp_path / "odd.md").write_text("## Vibes\nfine\n")
    status, _, err = cli(capsys, "adr", "new", "--title", "T", "--from-file", str(tmp_path / "odd.md"), *state)
    assert status == 2 and "adr: unknown section 'Vibes'" in err
    status, _, err = cli(capsys, "adr", "show", "9", *state)
    assert status == 2 and "adr 9: no such record" in err
    assert cli(capsys, "adr", "new", "--title", "Undecided", *state)[0] == 0  # a draft to fill in later
    status, out, _ = cli(capsys, "adr", "show", "1", *state)
    assert status == 0 and " ".join(out.split()).count("(not written yet)") == 8  # every section says so
    status, _, err = cli(capsys, "adr", "accept", "1", *state)
    assert status == 2 and ("adr 1: has no Decision section to accept; add one first (kvctl adr edit 1 "
                            "--from-file F with a '## Decision' section)") in " ".join(err.split())
    assert json.loads(cli(capsys, "adr", "show", "1", *state, "--json")[1])["status"] == "proposed"
    status, _, err = cli(capsys, "adr", "edit", "1", "--from-file", str(tmp_path / "none.md"), *state)
    assert status == 2 and err.strip() == (f"error: from_file: cannot read {str(tmp_path / 'none.md')!r} "
                                           "(No such file or directory)")
    # an exported draft, one section written and given back: only that section changes
    cli(capsys, "adr", "export", str(tmp_path / "docs"), *state)
    draft = tmp_path / "docs" / "0001-undecided.md"
    draft.write_text(draft.read_text().replace("## Context\n\n(not written yet)", "## Context\n\nChat traffic."))
    assert cli(capsys, "adr", "edit", "1", "--from-file", str(draft), *state)[0] == 0
    edited = json.loads(cli(capsys, "adr", "show", "1", *state, "--json")[1])
    assert edited["title"] == "Undecided" and edited["revision"] == 2
    assert edited["fields"]["context"] == "Chat traffic." and edited["fields"]["decision"] == ""
    status, _, err = cli(capsys, "adr", "accept", "1", *state)  # the placeholder is no decision
    assert status == 2 and "adr 1: has no Decision section to accept" in err
    # a new title: the next export replaces the record's file, and keeps a file that is not an export
    (tmp_path / "docs" / "0001-notes.md").write_text("my notes on ADR 1\n")
    (tmp_path / "retitled.md").write_text("# Block size 32 for chat\n")
    assert cli(capsys, "adr", "edit", "1", "--from-file", str(tmp_path / "retitled.md"), *state)[0] == 0
    status, out, _ = cli(capsys, "adr", "export", str(tmp_path / "docs"), *state, "--json")
    assert status == 0 and json.loads(out)["removed"] == [str(draft)]
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == ["0001-block-size-32-for-chat.md",
                                                                     "0001-notes.md"]
    with pytest.raises(RecordError, match="title: must not be empty"):
        Records(Store(tmp_path / "kvd.sqlite3")).new(" ", {}, "ops")


def test_readers_of_the_store_never_create_one_where_there_is_none(tmp_path, capsys):
    missing = tmp_path / "typo"
    for args in (["adr", "list"], ["adr", "show", "1"], ["audit"], ["db", "check"],
                 ["bench", "serve", "--compare", "1", "--baseline", "none"]):
        status, _, err = cli(capsys, *args, "--state-dir", str(missing))
        assert status == 2, args
        assert err.strip() == (f"error: state_dir: no kvd.sqlite3 in {str(missing)!r}; give kvd's state directory "
                               "(--state-dir or KVD_STATE_DIR)"), args
    assert not missing.exists()
    Store(tmp_path / "kvd.sqlite3").save_run("bench_replay", {"runs": []})
    status, _, err = cli(capsys, "bench", "serve", "--compare", "1", "--state-dir", str(tmp_path))
    assert status == 2 and "compare: run 1 is a bench_replay run, not one of bench serve" in err
    status, _, err = cli(capsys, "bench", "serve", "--compare", "7", "--state-dir", str(tmp_path))
    assert status == 2 and "compare: no stored run 7" in err  # said before any request is sent
    assert cli(capsys, "adr", "new", "--title", "First record", "--state-dir", str(tmp_path / "new"))[0] == 0
    assert (tmp_path / "new" / "kvd.sqlite3").is_file()  # a writer may start a store


def test_migration_from_the_first_schema_version(tmp_path):
    path = tmp_path / "kvd.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript("""
        CREATE TABLE audit (id INTEGER PRIMARY KEY, at FLOAT, actor TEXT, tenant TEXT, action TEXT,
                            target TEXT, result TEXT, detail TEXT);
        CREATE TABLE pins (pin_id TEXT PRIMARY KEY, tenant TEXT, keys TEXT, owner TEXT, note TEXT,
                           created_at FLOAT, expires_at FLOAT);
        INSERT INTO audit (at, actor, tenant, action, target, result, detail)
            VALUES (1.0, 'ops', 'acme', 'pin', 'pin-1', 'ok', '{}');
        INSERT INTO pins VALUES ('pin-1', 'acme', 'ab', 'ops', 'old', 1.0, NULL);
        PRAGMA user_version = 1;
    """)
    conn.close()
    store = Store(path)
    assert store.schema_version == SCHEMA_VERSION == 6
    # where a pin's keys were made was not recorded then: not known (never taken for stranded)
    assert store.pins() == [{"pin_id": "pin-1", "tenant": "acme", "keys": "ab", "owner": "ops", "note": "old",
                             "created_at": 1.0, "expires_at": None, "space": None, "adapter_id": None}]
    assert [e["target"] for e in store.audit_since(0)] == ["pin-1"]
    assert Records(store).new("after migration", {}, "ops").id == 1
    assert store.save_run("x", {}) == 1


_WRITER = """
import sys
from kvctl.daemon.store import Store
store = Store(sys.argv[1])
for i in range(int(sys.argv[3])):
    store.audit(actor=sys.argv[2], tenant="-", action="write", target=str(i), result="ok")
"""


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "kvd.sqlite3"
    daemon = Store(path)
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), name, "150"])
               for name in ("kvctl-1", "kvctl-2", "cron")]
    for i in range(150):
        daemon.audit(actor="daemon", tenant="-", action="write", target=str(i), result="ok")
    assert [w.wait(timeout=120) for w in writers] == [0, 0, 0]
    entries = daemon.audit_since(0, limit=10_000)
    counts = {}
    for e in entries:
        counts[e["actor"]] = counts.get(e["actor"], 0) + 1
    assert counts == {"daemon": 150, "kvctl-1": 150, "kvctl-2": 150, "cron": 150}


_LOOPER = """
import sys
from kvctl.daemon.store import Store
store = Store(sys.argv[1])
print("ready", flush=True)
i = 0
while True:
    store.save_run("soak", {"i": i, "padding": "x" * 4000})
    i += 1
"""


def test_a_writer_killed_mid_write_never_corrupts_the_store(tmp_path):
    path = tmp_path / "kvd.sqlite3"
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", _LOOPER, str(path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        store = Store(path)  # quick_check at open
        assert store.integrity_check() == ["ok"]
        last = store.conn.execute("SELECT max(id) FROM runs").fetchone()[0]
        assert last and store.get_run(last)["document"]["padding"] == "x" * 4000
        store.close()


def test_db_backup_and_check(tmp_path, capsys):
    store = Store(tmp_path / "kvd.sqlite3")
    store.audit(actor="ops", tenant="-", action="pin", target="p", result="ok")
    state = ["--state-dir", str(tmp_path)]
    status, out, _ = cli(capsys, "db", "backup", str(tmp_path / "b" / "copy.sqlite3"), *state, "--json")
    assert status == 0
    copy = Store(tmp_path / "b" / "copy.sqlite3")
    assert [e["target"] for e in copy.audit_since(0)] == ["p"]
    copy.close()
    assert cli(capsys, "db", "backup", str(tmp_path / "b" / "copy.sqlite3"), *state)[0] == 0  # a backup may replace one
    (tmp_path / "notes.txt").write_text("keep me")
    status, _, err = cli(capsys, "db", "backup", str(tmp_path / "notes.txt"), *state)
    assert status == 2 and "exists and is not a SQLite database; it would be overwritten" in err
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    status, _, err = cli(capsys, "db", "backup", str(tmp_path / "kvd.sqlite3"), *state)
    assert status == 2 and "is the store itself; back it up elsewhere" in err
    status, out, _ = cli(capsys, "db", "check", *state, "--json")
    assert status == 0 and json.loads(out)["ok"] is True and json.loads(out)["schema_version"] == SCHEMA_VERSION


def test_db_prune_removes_old_audit_records_and_records_that_it_did(tmp_path, capsys, monkeypatch):
    import getpass

    store = Store(tmp_path / "kvd.sqlite3")
    now = time.time()
    days = 86400
    with store.write() as conn:  # a year of records: 400, 200, 100 and 1 days old
        for age, target in [(400, "a"), (200, "b"), (100, "c"), (1, "d")]:
            conn.execute("INSERT INTO audit (at, actor, tenant, action, target, result, detail) "
                         "VALUES (?, 'ops', '-', 'pin', ?, 'ok', '{}')", (now - age * days, target))
    state = ["--state-dir", str(tmp_path)]
    monkeypatch.setattr(getpass, "getuser", lambda: "alice")
    status, out, _ = cli(capsys, "db", "prune", "--audit-older-than", "150d", "--dry-run", "--json", *state)
    assert status == 0
    dry = json.loads(out)
    assert (dry["removed"], dry["kept"], dry["dry_run"]) == (2, 2, True)
    assert dry["oldest_kept"] == pytest.approx(now - 100 * days)
    assert [e["target"] for e in store.audit_since(0)] == ["d", "c", "b", "a"]  # nothing changed
    status, out, _ = cli(capsys, "db", "prune", "--audit-older-than", "150d", *state)
    assert status == 0
    assert out.startswith("removed 2 audit records from before ") and out.rstrip().endswith(
        f"(150d ago) in {tmp_path / 'kvd.sqlite3'}; 3 remain, the oldest from "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now - 100 * days))}")
    entries = store.audit_since(0)
    assert [(e["action"], e["target"]) for e in entries] == [("db.prune", "audit"), ("pin", "d"), ("pin", "c")]
    assert entries[0]["actor"] == "alice" and entries[0]["detail"]["removed"] == 2
    assert entries[0]["detail"]["before"] == pytest.approx(now - 150 * days, abs=60)
    # an hour, not a second: the first prune's record must stay however slowly the machine runs the calls
    status, out, _ = cli(capsys, "db", "prune", "--audit-older-than", "1h", "--json", *state)
    assert (json.loads(out)["removed"], json.loads(out)["kept"]) == (2, 2)  # the prunes' own records stay
    assert [e["action"] for e in store.audit_since(0)] == ["db.prune", "db.prune"]
    # (a moment after both prunes, not after `now`: a slow machine writes them seconds after it)
    assert store.prune_audit(time.time() + 1, actor="alice", dry_run=True)["removed"] == 2
    for bad in ("90", "-5d", "soon", "infd"):
        status, _, err = cli(capsys, "db", "prune", "--audit-older-than", bad, *state)
        assert status == 2 and err.strip() == (f"error: audit_older_than: invalid value {bad!r}; give an age with "
                                               "its unit (s, m, h, d): 90d, 12h")
    assert len(store.audit_since(0)) == 2


def test_a_prune_goes_a_batch_at_a_time_with_its_record_in_the_first(tmp_path, monkeypatch):
    """A million rows in one transaction held the database for seconds, kvd's engine thread
    waiting on it; each batch is now its own transaction, the record of the prune in the first."""
    store = Store(tmp_path / "kvd.sqlite3")
    with store.write() as conn:
        for i in range(7):
            conn.execute("INSERT INTO audit (at, actor, tenant, action, target, result, detail) "
                         "VALUES (?, 'ops', '-', 'pin', ?, 'ok', '{}')", (1000.0 + i, f"old-{i}"))
    transactions = []
    write = Store.write

    def counted(self):
        transactions.append(self.conn.execute("SELECT count(*) FROM audit WHERE action = 'db.prune'").fetchone()[0])
        return write(self)

    monkeypatch.setattr(Store, "write", counted)
    result = store.prune_audit(2000.0, actor="alice", batch=3)
    assert (result["removed"], result["kept"]) == (7, 1)
    assert transactions == [0, 1, 1]  # 3 (with the record), then 3, then 1: three transactions
    assert [(e["action"], e["detail"]["removed"]) for e in store.audit_since(0)] == [("db.prune", 7)]


def test_audit_reads_the_store_without_a_daemon(tmp_path, capsys):
    store = Store(tmp_path / "kvd.sqlite3")
    store.audit(actor="ops", tenant="acme", action="evict", target="tenant=acme", result="ok")
    store.audit(actor="ops", tenant="acme", action="pin", target="pin-1", result="ok")
    status, out, _ = cli(capsys, "audit", "--state-dir", str(tmp_path), "--action", "evict", "--json")
    assert status == 0
    assert [e["target"] for e in json.loads(out)["entries"]] == ["tenant=acme"]
    for i in range(3):
        store.audit(actor="ops", tenant="acme", action="unpin", target=f"pin-{i + 2}", result="ok")
    status, out, _ = cli(capsys, "audit", "--state-dir", str(tmp_path), "--limit", "2")
    lines = out.splitlines()
    assert [line.split()[-2] for line in lines[1:3]] == ["pin-4", "pin-3"]  # the newest first
    assert lines[3] == "the newest 2 of 5 entries; --limit 0 shows all, --since and --action narrow them"
    status, out, _ = cli(capsys, "audit", "--state-dir", str(tmp_path), "--limit", "2", "--json")
    assert len(json.loads(out)["entries"]) == 5


def test_audit_narrows_to_a_result_an_actor_and_a_tenant(tmp_path, capsys):
    """After an incident the question is what was turned away, and by whom it was asked:
    `--result refused` (with --actor, --tenant) answers it, in the store's query (so that --limit
    and the daemon's 1,000 newest count what matched, not what was read)."""
    store = Store(tmp_path / "kvd.sqlite3")
    store.audit(actor="alice", tenant="acme", action="pin", target="pin-1", result="ok")
    store.audit(actor="alice", tenant="acme", action="pin", target="-", result="refused")
    store.audit(actor="bob", tenant="beta", action="cancel", target="tenant=beta", result="refused")
    store.audit(actor="unix-socket", tenant="-", action="reload", target="config", result="refused")
    store.audit(actor="bob", tenant="beta", action="evict", target="tenant=beta", result="partial")

    def targets(*args):
        status, out, _ = cli(capsys, "audit", "--state-dir", str(tmp_path), *args, "--json")
        assert status == 0
        return [(e["actor"], e["target"]) for e in json.loads(out)["entries"]]

    assert targets("--result", "refused") == [("unix-socket", "config"), ("bob", "tenant=beta"), ("alice", "-")]
    assert targets("--result", "refused", "--actor", "bob") == [("bob", "tenant=beta")]
    assert targets("--tenant", "-") == [("unix-socket", "config")]
    assert targets("--tenant", "acme", "--action", "pin", "--result", "ok") == [("alice", "pin-1")]
    assert targets("--result", "failed") == []
    assert targets("--target", "tenant=beta") == [("bob", "tenant=beta"), ("bob", "tenant=beta")]
    assert targets("--target", "tenant=beta", "--action", "evict") == [("bob", "tenant=beta")]
    assert targets("--target", "pin") == []  # whole, not a part of one
    assert [e["action"] for e in store.audit_since(0, target="pin-1")] == ["pin"]
    assert [e["target"] for e in store.audit_since(0, limit=1, result="refused", tenant="acme")] == ["-"]


def test_audit_table_fits_80_columns_without_cutting_an_action_a_result_or_an_id(tmp_path, capsys, monkeypatch):
    """An 80-column terminal once cut "rollout.complete" to "roll…" and "result" to "resu…". Now the
    target wraps at its spaces and, when that is not enough, each row's time goes below its date."""
    store = Store(tmp_path / "kvd.sqlite3")
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    store.audit(actor="unix-socket", tenant="default", action="pin", target="pin-94776163be18f80b", result="ok")
    store.audit(actor="unix-socket", tenant="-", action="rollout.complete", target="rollout:2", result="refused")
    store.audit(actor="unix-socket", tenant="default", action="evict",
                target="prompt of 104 tokens (tenant default)", result="ok")
    monkeypatch.undo()
    monkeypatch.setenv("COLUMNS", "80")
    status, out, _ = cli(capsys, "audit", "--state-dir", str(tmp_path))
    lines = out.splitlines()
    day, clock = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1_700_000_000.0)).split()
    assert status == 0 and max(map(len, lines)) <= 80
    assert lines[0].split() == ["when", "actor", "tenant", "action", "target", "result"]
    assert lines[1].split() == [day, "unix-socket", "default", "evict", "prompt", "of", "104", "tokens", "ok"]
    assert lines[2].split() == [clock, "(tenant", "default)"]
    assert lines[3].split() == [day, "unix-socket", "-", "rollout.complete", "rollout:2", "refused"]
    assert lines[5].split() == [day, "unix-socket", "default", "pin", "pin-94776163be18f80b", "ok"]
    monkeypatch.setenv("COLUMNS", "120")  # room for the time beside its date: one line a row
    status, out, _ = cli(capsys, "audit", "--state-dir", str(tmp_path))
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [[day, clock]] * 3


def test_bench_replay_save_gives_a_citable_run(tmp_path, capsys):
    status, out, _ = cli(capsys, "bench", "replay", "--demo-requests", "20", "--block-sizes", "64", "--policy",
                         "lru", "--json", "--save", "--state-dir", str(tmp_path))
    assert status == 0
    run_id = json.loads(out)["run_id"]
    stored = Store(tmp_path / "kvd.sqlite3").get_run(run_id)
    assert stored["kind"] == "bench_replay" and stored["document"]["requests"] == 20


@pytest.mark.parametrize("as_json", [True, False])
def test_a_bench_whose_run_the_store_cannot_take_still_shows_its_figures_then_fails(tmp_path, capsys, monkeypatch,
                                                                                    as_json):
    from kvctl.daemon.store import StoreUnavailable

    def full(self, kind, document):
        raise StoreUnavailable(f"store: {str(self.path)!r} cannot be written now (database or disk is full); "
                               "nothing of this change was stored")

    monkeypatch.setattr(Store, "save_run", full)
    status, out, err = cli(capsys, "bench", "replay", "--demo-requests", "20", "--block-sizes", "64", "--policy",
                           "lru", "--save", "--state-dir", str(tmp_path), *(["--json"] if as_json else []))
    assert status == 1
    assert err.strip().splitlines()[-1] == (
        f"error: --save: store: {str(tmp_path / 'kvd.sqlite3')!r} cannot be written now (database or disk is full); "
        "nothing of this change was stored; the figures shown were not stored")
    if as_json:
        document = json.loads(out)
        assert document["run_id"] is None and document["requests"] == 20
    else:
        assert "lru" in out and "stored as run" not in err


def test_a_store_that_is_not_a_database_is_named(tmp_path, capsys):
    (tmp_path / "kvd.sqlite3").write_text("not a database\n")
    with pytest.raises(StoreError, match="cannot be opened: file is not a database"):
        Store(tmp_path / "kvd.sqlite3")
    status, _, err = cli(capsys, "adr", "list", "--state-dir", str(tmp_path))
    assert status == 2 and err.strip() == (f"error: store: {str(tmp_path / 'kvd.sqlite3')!r} cannot be opened: "
                                           "file is not a database")


def test_store_commands_use_the_store_of_the_kvd_kvctl_reaches(tmp_path, capsys, monkeypatch):
    """With neither --state-dir nor KVD_STATE_DIR, `kvctl adr` and `kvctl db` use the store of the kvd
    on kvctl's socket: an ADR written next to a systemd kvd lands where `rollout start --adr` looks,
    and a backup is of the daemon's records, not of an empty store in the operator's home."""
    import threading

    import uvicorn

    from .daemon_fixtures import apps, call, start_service, token_table

    monkeypatch.delenv("KVD_STATE_DIR", raising=False)
    monkeypatch.delenv("KVD_URL", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "home"))
    operator_default = tmp_path / "home" / "kvd" / "kvd.sqlite3"
    (tmp_path / "kvd").mkdir()
    service = start_service(tmp_path / "kvd")
    unix, _ = apps(service, token_table(tmp_path))
    sock = str(tmp_path / "kvd.sock")
    server = uvicorn.Server(uvicorn.Config(unix, uds=sock, log_level="warning", lifespan="off"))
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    try:
        while not server.started:
            time.sleep(0.01)
        status, out, _ = cli(capsys, "--socket", sock, "adr", "new", "--title", "Reserve p95")
        assert status == 0 and out.strip() == "ADR 1 recorded (proposed): Reserve p95"
        assert Records(service.store).get(1).title == "Reserve p95"
        assert not operator_default.exists()
        policy = {"name": "reserve-p95", "settings": {"reservation": "p95"}}
        started = call(unix, "POST", "/admin/rollouts", json={"policy": policy, "cohort": "10%", "adr": 1})
        assert started.status_code == 200, started.text
        backup = tmp_path / "backup.sqlite3"
        status, out, _ = cli(capsys, "--socket", sock, "db", "backup", str(backup))
        store_path = (tmp_path / "kvd" / "kvd.sqlite3").resolve()
        assert status == 0 and out.strip() == f"backed up {store_path} to {backup}"
        assert [a.title for a in Records(Store(backup)).list()] == ["Reserve p95"]
        status, out, _ = cli(capsys, "--socket", sock, "adr", "list", "--state-dir", str(tmp_path / "home" / "kvd"))
        assert status == 2  # --state-dir still wins over the daemon's store
    finally:
        server.should_exit = True
        serving.join(10)
        service.shutdown(1)
    status, _, err = cli(capsys, "--socket", sock, "adr", "list")  # no daemon answers: the default, said
    assert status == 2 and f"no kvd.sqlite3 in {str(operator_default.parent)!r}" in err
    assert " ".join(err.split()).startswith(f"note: no kvd answers at {sock}, so this is the store in the default "
                                            f"state directory (--state-dir or KVD_STATE_DIR names another)")
    status, _, err = cli(capsys, "--url", "http://10.0.0.9:8000", "adr", "list")  # its files are elsewhere
    assert status == 2 and err.splitlines()[0] == ("note: kvd is reached over TCP, so its store is on its own "
                                                   "machine: this is the store on this one (--state-dir or "
                                                   "KVD_STATE_DIR names another)")


def test_kvctl_says_it_waits_for_a_store_another_process_holds_locked_then_writes(tmp_path):
    """`kvctl adr new` against a store a shell holds locked waited without a word (up to 30 s);
    after a second it says why it waits, and writes once the lock goes."""
    import threading

    store = tmp_path / "kvd.sqlite3"
    Store(store).close()
    shell = sqlite3.connect(store, isolation_level=None, check_same_thread=False)
    shell.execute("BEGIN IMMEDIATE")
    threading.Timer(2.5, lambda: shell.execute("ROLLBACK")).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    done = subprocess.run([str(Path(sys.executable).parent / "kvctl"), "adr", "new", "--title", "Block size 32",
                           "--state-dir", str(tmp_path), "--author", "ops"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("waiting for the write lock of") == 1
    assert (f"waiting for the write lock of {str(store)!r}: another process holds it (a sqlite3 shell left in a "
            "transaction, a long kvctl db command?); kvctl waits up to 30 s") in " ".join(done.stderr.split())
    assert [adr.title for adr in Records(Store(store)).list()] == ["Block size 32"]
