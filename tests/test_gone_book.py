"""gone_book.py: why a kept response or conversation went, told to its own tenant only, for the
last GONE_KEPT ids."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from kvctl.daemon.server.gone_book import GoneBook  # noqa: E402


def test_the_book_tells_its_tenant_why_and_when_and_forgets_the_oldest_first():
    now = [86400.0 * 365]
    book = GoneBook(kept=2, clock=lambda: now[0])
    book.note("acme", "conv_1", "kvd let it go for room")
    now[0] += 61
    book.note("acme", "conv_2", "an operator purged it")
    assert book.why("acme", "conv_1") == "kvd let it go for room, 1971-01-01 00:00:00 UTC"
    assert book.why("acme", "conv_2") == "an operator purged it, 1971-01-01 00:01:01 UTC"
    assert book.why("globex", "conv_1") is None  # another tenant learns nothing of it
    book.note("globex", "conv_3", "older than responses_max_age")
    assert book.why("acme", "conv_1") is None and book.why("globex", "conv_3") is not None  # (two kept at most)


def test_with_a_responses_file_a_restart_still_tells_why_a_response_or_conversation_went(tmp_path):
    from .test_conversations import closed, item, stores

    path = tmp_path / "responses.sqlite"
    conversations, responses = stores(path)
    talk = conversations.create("acme", [item("hi", "msg_1")], {}, 1)
    responses.put("acme", {"id": "resp_1", "created_at": 1, "output": []}, [{"role": "user", "content": "hi"}])
    responses.put("globex", {"id": "resp_2", "created_at": 1, "output": []}, [])
    responses.purge("acme", None)
    conversations.purge("acme", None, expired=True)
    said = (responses.gone.why("acme", "resp_1"), conversations.gone.why("acme", talk.id))
    assert said[0].startswith("an operator purged it (kvctl responses purge), ")
    assert said[1].startswith("unchanged for longer than responses_max_age, ")
    closed(conversations, responses)
    again, responses = stores(path)
    try:
        assert (responses.gone.why("acme", "resp_1"), again.gone.why("acme", talk.id)) == said  # (the same time)
        assert responses.gone.why("globex", "resp_1") is None and again.gone.why("acme", "resp_1") is None
        assert responses.gone.why("globex", "resp_2") is None and responses.get("globex", "resp_2") is not None
    finally:
        closed(again, responses)
    import sqlite3

    with sqlite3.connect(path) as db:  # ids, tenants and reasons: no text
        assert [row[0] for row in db.execute("SELECT kind FROM gone ORDER BY seq")] == ["responses", "conversations"]
    db.close()


def test_the_file_keeps_each_kind_s_newest_notes_and_a_note_again_moves_to_the_end(tmp_path, monkeypatch):
    from kvctl.daemon.server import gone_book
    from kvctl.daemon.server.response_file import ResponseFile

    monkeypatch.setattr(gone_book, "GONE_TRIM", 4)  # (trimmed at every fourth note)
    file = ResponseFile(tmp_path / "responses.sqlite")
    file.start()
    now = [1000.0]
    books = {kind: gone_book.GoneBook(kept=3, clock=lambda: now[0], file=gone_book.GoneFile(file, kind, kept=3))
             for kind in ("responses", "conversations")}
    books["conversations"].note("acme", "conv_a", "purged")
    for n in range(1, 8):
        now[0] += 1
        books["responses"].note("acme", f"resp_{n}", "for room")
    books["responses"].note("acme", "resp_5", "purged")  # noted again: now the newest
    file.flush()
    count = dict(file.db.execute("SELECT kind, COUNT(*) FROM gone GROUP BY kind"))
    assert count["conversations"] == 1 and 3 <= count["responses"] < 3 + 4  # (trimmed now and then)
    assert [(key, why) for _, key, why, _ in gone_book.GoneFile(file, "responses", kept=3).load()] == [
        ("resp_6", "for room"), ("resp_7", "for room"), ("resp_5", "purged")]
    assert [key for _, key, _, _ in gone_book.GoneFile(file, "conversations", kept=3).load()] == ["conv_a"]
    assert list(books["responses"].book) == [("acme", "resp_6"), ("acme", "resp_7"), ("acme", "resp_5")]
    file.close()
