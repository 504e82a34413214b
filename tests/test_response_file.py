"""`responses_store_file`: the kept responses written to a SQLite file as well, so a restart
keeps them: each message and item stored once however many responses hold it, everything the
memory store lets go deleted from the file too, and the file readable by kvd's user alone."""

from __future__ import annotations

import json
import sqlite3
import stat

import pytest

pytest.importorskip("fastapi")

from kvctl.daemon.server.response_file import ResponseFile, ResponseFileError  # noqa: E402
from kvctl.daemon.server.response_store import ResponseStore  # noqa: E402


def conversation_of(turns: int, tag: str = "") -> list[tuple[dict, list[dict], list[dict]]]:
    """(response, conversation, inputs) of each turn of one conversation, each continuing the
    last: its messages are the last turn's (the same objects) and two of its own."""
    out, conversation, inputs = [], [], []
    for n in range(turns):
        question = {"role": "user", "content": f"{tag}question {n} " + "q" * 100}
        reply = {"role": "assistant", "content": f"{tag}answer {n} " + "a" * 100}
        conversation = [*conversation, question, reply]
        inputs = [*inputs, {"id": f"msg_{tag}{n}", "type": "message", "role": "user",
                            "content": [{"type": "input_text", "text": question["content"]}]}]
        out.append(({"id": f"resp_{tag}{n}", "object": "response", "output": []}, conversation, inputs))
    return out


def rows(path) -> tuple[list[str], int]:
    with sqlite3.connect(path) as db:
        ids = [row[0] for row in db.execute("SELECT id FROM responses ORDER BY seq")]
        return ids, db.execute("SELECT COUNT(*) FROM parts").fetchone()[0]


def test_a_restart_reads_back_every_kept_response_and_its_shared_messages_as_one(tmp_path):
    path = tmp_path / "responses.sqlite"
    store = ResponseStore(2**20, ResponseFile(path))
    for response, conversation, inputs in conversation_of(3) + conversation_of(2, "b"):
        assert store.put("acme" if not response["id"].startswith("resp_b") else "globex", response, conversation,
                         inputs)
    before = store.figures()
    store.close()
    assert store.file.failed == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the conversations' text
    ids, parts = rows(path)
    assert ids == ["resp_0", "resp_1", "resp_2", "resp_b0", "resp_b1"]
    assert parts == 3 * 3 + 2 * 3  # each turn's question, reply and item, once

    again = ResponseStore(2**20, ResponseFile(path))
    try:
        assert again.figures() == before  # the same bytes: what the turns share is one object again
        last = again.get("acme", "resp_2")
        assert [m["content"][:10] for m in last.conversation] == ["question 0", "answer 0 a", "question 1",
                                                                   "answer 1 a", "question 2", "answer 2 a"]
        assert last.conversation[0] is again.get("acme", "resp_0").conversation[0]
        assert again.get("globex", "resp_2") is None and again.get("globex", "resp_b1") is not None
        assert [i["id"] for i in last.inputs] == ["msg_0", "msg_1", "msg_2"]
    finally:
        again.close()


def test_what_memory_lets_go_leaves_the_file_too(tmp_path):
    path = tmp_path / "responses.sqlite"
    turns = conversation_of(3)
    whole = sum(len(json.dumps(p)) for p in turns[2][1] + turns[2][2])
    own = len(json.dumps(turns[0][0]))
    store = ResponseStore(whole + 2 * own, ResponseFile(path))  # room for two turns' own bytes: the first goes
    for response, conversation, inputs in turns:
        store.put("acme", response, conversation, inputs)
    store.file.flush()
    assert rows(path) == (["resp_1", "resp_2"], 9)  # the first turn's messages are the others' too: kept
    assert store.delete("acme", "resp_2")
    store.file.flush()
    assert rows(path) == (["resp_1"], 6)  # the third turn's question, reply and item went with it
    assert not store.put("acme", {"id": "resp_big", "pad": "x" * (whole + 3 * own)}, [], [])
    response, conversation, inputs = turns[1]  # put again under its id: it replaces itself, sharing all it had
    assert store.put("acme", {**response, "again": True}, conversation, inputs)
    store.file.flush()
    assert rows(path) == (["resp_1"], 6) and store.get("acme", "resp_1").response["again"] is True
    store.close()
    assert store.file.failed == 0
    smaller = ResponseStore(own + 10, ResponseFile(path))  # a smaller budget at the restart: what no longer fits
    try:
        smaller.file.flush()
        assert smaller.figures()["responses"] == 0 and rows(path) == ([], 0)
    finally:
        smaller.close()


def test_a_file_with_no_budget_or_that_is_not_sqlite_is_refused_by_name(tmp_path):
    with pytest.raises(ResponseFileError) as refused:
        ResponseStore(0, ResponseFile(tmp_path / "responses.sqlite"))
    assert str(refused.value) == ("responses_store_file: needs responses_store_bytes above 0 (with 0 kvd keeps no "
                                  "response, and would empty the file)")
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database at all" * 100)
    with pytest.raises(ResponseFileError, match=r"^responses_store_file: cannot use '.*garbage.sqlite': "):
        ResponseFile(garbage)


def test_a_conversation_continues_after_kvd_restarts(tmp_path):
    pytest.importorskip("torch")
    from .daemon_fixtures import call, kvd_in

    path = str(tmp_path / "responses.sqlite")
    with kvd_in(tmp_path, "first", responses_store_file=path) as (_, unix):
        made = call(unix, "POST", "/v1/responses", json={"instructions": "Be brief.", "input": "Hi",
                                                          "max_output_tokens": 3, "temperature": 0})
        assert made.status_code == 200
    with kvd_in(tmp_path, "second", responses_store_file=path) as (_, unix):  # (a new kvd on the same file)
        kept = call(unix, "GET", f"/v1/responses/{made.json()['id']}")
        assert kept.status_code == 200 and kept.json() == made.json()
        turned = call(unix, "POST", "/v1/responses", json={"instructions": "Be brief.", "input": "More",
                                                            "previous_response_id": made.json()["id"],
                                                            "max_output_tokens": 3, "temperature": 0})
        assert turned.status_code == 200
        listed = call(unix, "GET", f"/v1/responses/{turned.json()['id']}/input_items",
                      params={"order": "asc"}).json()["data"]
        assert [item["type"] for item in listed] == ["message", "message", "message"]  # Hi, the reply, More
        assert (listed[0]["content"][0]["text"], listed[2]["content"][0]["text"]) == ("Hi", "More")


def test_a_restart_keeps_the_order_of_use_and_the_least_recently_used_go_first(tmp_path):
    from kvctl.daemon.server.response_file import ResponseFile
    from kvctl.daemon.server.response_store import ResponseStore

    path = tmp_path / "responses.sqlite"
    store = ResponseStore(2**20, ResponseFile(str(path)))
    for n in (1, 2, 3):
        store.put("acme", {"id": f"resp_{n}", "created_at": n}, [{"role": "user", "content": f"q{n}"}])
    each = store.used // 3  # (the three are the same size)
    assert store.get("acme", "resp_1") is not None  # now the most recently used
    store.close()
    again = ResponseStore(2**20, ResponseFile(str(path)))
    assert list(again.entries) == ["resp_2", "resp_3", "resp_1"]
    again.put("acme", {"id": "resp_4", "created_at": 4}, [{"role": "user", "content": "q4"}])
    again.file.close()  # a crash: no order written since (resp_4 follows those ranked at the last stop)
    smaller = ResponseStore(2 * each, ResponseFile(str(path)))
    try:
        assert list(smaller.entries) == ["resp_1", "resp_4"]  # the least recently used went for room
    finally:
        smaller.close()


def test_a_write_that_does_not_land_is_counted_named_and_shown_to_the_operator(tmp_path):
    """A full disk (here: the file held to the pages it has) fails a write: memory serves the
    response on, and the store's figures, kvctl responses and kvctl status say how many writes did
    not land and why (what they held will not outlive a restart), where before only the log did."""
    from rich.console import Console

    from kvctl.responses_cmd import file_line, responses_view

    path = tmp_path / "responses.sqlite"
    store = ResponseStore(2**20, ResponseFile(path))
    [(first, talk, items)] = conversation_of(1)
    assert store.put("acme", first, talk, items)
    store.file.flush()
    assert store.figures()["file"] == {"path": str(path), "failed_writes": 0, "last_failure": None}
    pages = store.file.db.execute("PRAGMA page_count").fetchone()[0]
    store.file.db.execute(f"PRAGMA max_page_count = {pages}")  # no room for one more page
    [(big, talk, items)] = conversation_of(1, "big" + "x" * 20_000)
    assert store.put("acme", big, talk, items)
    store.file.flush()
    assert store.get("acme", big["id"]) is not None  # served from memory all the same
    figures = store.figures()
    assert figures["file"] == {"path": str(path), "failed_writes": 1, "last_failure": "database or disk is full"}
    console = Console(width=300, record=True)
    console.print(responses_view({"tenants": [], **figures}))
    assert console.export_text().splitlines()[-1] == (
        f"written to {path} as well: a restart keeps them; 1 write did not land (database or disk is full): what "
        "it held is in memory only")
    assert file_line(None).plain == ("kept in memory only: a restart forgets them (responses_store_file writes them "
                                     "to disk)")
    store.close()
    again = ResponseStore(2**20, ResponseFile(path))
    try:
        assert again.get("acme", first["id"]) is not None and again.get("acme", big["id"]) is None
    finally:
        again.close()
