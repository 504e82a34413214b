"""`kvctl responses` and `kvctl responses purge`: the operator sees the kept responses by tenant
(counts, bytes, ages; never their text) and removes a tenant's, those older than a span, or every
one, from memory and the file, audited; a tenant's background response still running is
cancelled first; what would name nothing, or too much, is refused by name."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from kvctl.daemon.server.conversation_store import ConversationStore  # noqa: E402
from kvctl.daemon.server.response_store import ResponseStore  # noqa: E402

from .test_response_background import LONG, gated  # noqa: E402,F401
from .test_responses_api import client_for, kvd, scripted  # noqa: E402,F401
from .test_router import replicas  # noqa: E402,F401


def response(response_id: str, created_at: float) -> dict:
    return {"id": response_id, "object": "response", "created_at": created_at, "output": []}


def test_the_store_counts_each_tenant_s_shared_messages_once_and_purges_by_tenant_and_age():
    store = ResponseStore(2**20)
    question, answer, more = {"role": "user", "content": "q" * 100}, {"role": "assistant", "content": "a" * 50}, \
        {"role": "user", "content": "m" * 30}
    store.put("acme", response("resp_1", 100.0), [question, answer])
    store.put("acme", response("resp_2", 200.0), [question, answer, more])  # shares the first two
    store.put("globex", response("resp_3", 150.0), [{"role": "user", "content": "g"}])
    size = lambda part: len(json.dumps(part, sort_keys=True))  # noqa: E731
    own = lambda rid, at: len(json.dumps(response(rid, at)))  # noqa: E731
    acme_bytes = own("resp_1", 100.0) + own("resp_2", 200.0) + size(question) + size(answer) + size(more)
    rows = store.tenants()
    assert rows == [
        {"tenant": "acme", "responses": 2, "bytes": acme_bytes, "oldest": 100.0, "newest": 200.0, "running": 0,
         "replay_bytes": 0},
        {"tenant": "globex", "responses": 1, "bytes": own("resp_3", 150.0) + size({"role": "user", "content": "g"}),
         "oldest": 150.0, "newest": 150.0, "running": 0, "replay_bytes": 0}]
    assert sum(row["bytes"] for row in rows) == store.used

    # acme's older one: its shared messages stay (the newer one holds them), only `more`... is the newer's
    dry = store.purge("acme", 150.0, dry_run=True)
    assert dry == {"responses": 1, "bytes": own("resp_1", 100.0), "tenants": {"acme": 1}}
    assert store.get("acme", "resp_1") is not None  # a dry run changes nothing
    used = store.used
    assert store.purge("acme", 150.0) == dry and store.used == used - dry["bytes"]
    assert store.get("acme", "resp_1") is None and store.get("acme", "resp_2") is not None
    # the tenant's whole: what no other response holds comes back
    gone = store.purge("acme", None)
    assert gone == {"responses": 1, "bytes": acme_bytes - own("resp_1", 100.0), "tenants": {"acme": 1}}
    assert [row["tenant"] for row in store.tenants()] == ["globex"]
    assert store.purge(None, None) == {"responses": 1, "bytes": rows[1]["bytes"], "tenants": {"globex": 1}}
    assert store.used == 0 and store.held == {}


def test_a_purge_leaves_the_file_too(tmp_path):
    from kvctl.daemon.server.response_file import ResponseFile

    path = tmp_path / "responses.sqlite"
    store = ResponseStore(2**20, ResponseFile(str(path)))
    store.put("acme", response("resp_1", 100.0), [{"role": "user", "content": "forget me " * 50}])
    store.put("globex", response("resp_2", 100.0), [{"role": "user", "content": "keep me"}])
    assert store.file.db.execute("PRAGMA secure_delete").fetchone() == (1,)  # (whatever SQLite's build defaults to)
    store.file.flush()
    store.file.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the text is in the file's pages now
    assert b"forget me" in path.read_bytes()
    assert store.purge("acme", None)["responses"] == 1
    store.close()
    assert b"keep me" in path.read_bytes()
    again = ResponseStore(2**20, ResponseFile(str(path)))
    try:
        assert again.get("acme", "resp_1") is None and again.get("globex", "resp_2") is not None
        # overwritten where it stood (secure_delete), not left in a free page
        assert not any(b"forget me" in p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith(path.name))
    finally:
        again.close()


def test_an_operator_lists_and_purges_a_tenant_s_responses_audited(kvd, scripted):
    from .daemon_fixtures import GLOBEX_TOKEN, USER_TOKEN, call

    service, unix, tcp = kvd
    scripted.extend(service.loaded.tokenizer.encode("Noted.", add_special_tokens=False))
    acme, globex = ({"Authorization": f"Bearer {token}"} for token in (USER_TOKEN, GLOBEX_TOKEN))
    made = {name: [call(tcp, "POST", "/v1/responses", headers=headers,
                        json={"input": f"Hi {n}", "max_output_tokens": 8}).json()["id"] for n in range(count)]
            for name, headers, count in (("acme", acme, 2), ("globex", globex, 1))}
    listed = call(unix, "GET", "/admin/responses").json()
    assert [(row["tenant"], row["responses"], row["running"]) for row in listed["tenants"]] == [
        ("acme", 2, 0), ("globex", 1, 0)]
    assert listed["responses"] == 3 and listed["bytes"] == sum(row["bytes"] for row in listed["tenants"])
    assert "Hi 0" not in json.dumps(listed)  # never their text

    dry = call(unix, "POST", "/admin/responses/purge", json={"tenant": "acme", "dry_run": True}).json()
    assert (dry["responses"], dry["tenants"], dry["dry_run"]) == (2, {"acme": 2}, True)
    assert call(tcp, "GET", f"/v1/responses/{made['acme'][0]}", headers=acme).status_code == 200
    done = call(unix, "POST", "/admin/responses/purge", json={"tenant": "acme"}).json()
    assert (done["responses"], done["bytes"], done["cancelled"]) == (2, dry["bytes"], 0)
    for response_id in made["acme"]:
        gone = call(tcp, "GET", f"/v1/responses/{response_id}", headers=acme)
        assert gone.status_code == 404 and gone.json()["error"]["message"].startswith(
            f"response_id: response {response_id!r} is no longer kept: an operator purged it (kvctl responses purge), ")
    assert call(tcp, "GET", f"/v1/responses/{made['globex'][0]}", headers=globex).status_code == 200
    [record] = call(unix, "GET", "/admin/audit?action=responses.purge").json()["entries"]
    assert (record["tenant"], record["target"], record["detail"]["responses"]) == ("acme", "tenant:acme", 2)
    # an age that spares the rest
    spared = call(unix, "POST", "/admin/responses/purge", json={"older_than": "1h", "tenant": "globex"}).json()
    assert spared["responses"] == 0
    record = call(unix, "GET", "/admin/audit?action=responses.purge").json()["entries"][0]
    assert (record["tenant"], record["target"]) == ("globex", "tenant:globex,older_than:1h")
    assert call(unix, "POST", "/admin/responses/purge", json={"all": True}).json()["tenants"] == {"globex": 1}

    for body, message, param in [
            ({}, "tenant: name a tenant, older_than or ids, or send all: true to purge every kept response and "
                 "conversation", "tenant"),
            ({"all": True, "tenant": "acme"}, "all: purges every kept response and conversation; leave tenant, "
                                              "older_than and ids out, or all", "all"),
            ({"older_than": "soon"}, "older_than: must be a duration (90, 30m, 12h, 7d), got 'soon'", "older_than")]:
        refused = call(unix, "POST", "/admin/responses/purge", json=body)
        assert refused.status_code == 400
        assert (refused.json()["error"]["message"], refused.json()["error"]["param"]) == (message, param)
    assert call(tcp, "POST", "/admin/responses/purge", headers=acme, json={"tenant": "acme"}).status_code == 403


def test_a_purge_cancels_the_tenant_s_background_response_first_and_removes_it(kvd, gated):
    import httpx

    from .daemon_fixtures import blocks_all_back, settled

    service, unix, _ = kvd
    gated["script"][:] = service.loaded.tokenizer.encode("A", add_special_tokens=False) * LONG
    gated["hold"] = 5

    async def go():
        client = client_for(unix)
        made = await client.responses.create(input="Hi", max_output_tokens=LONG, background=True)
        while (await client.responses.retrieve(made.id)).status != "in_progress":
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=unix), base_url="http://kvd") as admin:
            dry = (await admin.post("/admin/responses/purge", json={"tenant": "default", "dry_run": True})).json()
            gated["gate"].set()
            done = (await admin.post("/admin/responses/purge", json={"tenant": "default"})).json()
        return made, dry, done

    made, dry, done = asyncio.run(go())
    assert (dry["responses"], dry["running"], dry["cancelled"]) == (0, 1, 0)
    assert (done["responses"], done["cancelled"], done["tenants"]) == (1, 1, {"default": 1})
    assert service.responses.get("default", made.id) is None and service.responses.figures()["running"] == 0
    assert settled(lambda: blocks_all_back(service), bool)


def test_kvctl_shows_the_tenants_and_what_a_purge_removed():
    from rich.console import Console

    from kvctl.responses_cmd import purge_text, responses_view

    listing = {"tenants": [{"tenant": "acme", "responses": 12, "bytes": 40960, "oldest": 1000.0, "newest": 3400.0,
                            "running": 1}], "responses": 12, "bytes": 40960, "budget_bytes": 64 * 2**20,
               "dropped": 3, "running": 1, "replay_bytes": 3 * 2**10}
    console = Console(width=100, record=True)
    console.print(responses_view(listing, now=3600.0))
    text = console.export_text()
    assert "acme" in text and "40.0 KiB" in text and "43m ago" in text and "3m ago" in text
    assert ("12 kept in 40.0 KiB of 64.0 MiB; 3 let go for room; 1 running in the background; 3.0 KiB of events "
            "kept to stream again") in " ".join(text.split())
    assert purge_text({"responses": 2, "bytes": 2048, "tenants": {"acme": 2}, "dry_run": True, "running": 1,
                       "cancelled": 0}) == ("would remove 2 responses (2.0 KiB): acme 2; would cancel 1 running in "
                                            "the background first")
    console = Console(width=100, record=True)
    console.print(responses_view({"replicas": [{"replica": "a", "status": 200, "report": listing},
                                               {"replica": "b", "status": None, "error": "ConnectError"}]}, now=3600.0))
    lines = console.export_text().splitlines()
    assert lines[0] == "replica a" and "replica b: no answer (ConnectError)" in lines
    assert sum("acme" in line for line in lines) == 1
    fleet = {"responses": 3, "bytes": 4096, "tenants": {"acme": 3}, "dry_run": False, "running": 0, "cancelled": 0,
             "result": "partial", "replicas": [{"replica": "a", "status": 200}, {"replica": "b", "status": None}],
             "message": "b: not reached (connection refused)"}
    assert purge_text(fleet) == ("removed 3 responses (4.0 KiB): acme 3 on 1 of 2 replicas\n"
                                 "b: not reached (connection refused)")


def test_at_the_router_a_purge_reaches_every_replica_and_adds_up(replicas):
    from .test_router import drive, router_app

    _, app = router_app(replicas)
    made = drive(app, [lambda c, n=n: c.post("/v1/responses", json={"input": f"Question {n}", "max_output_tokens": 1})
                       for n in range(3)])
    assert [answer.status_code for answer in made] == [200] * 3
    listed, done, gone = drive(app, [lambda c: c.get("/admin/responses"),
                                     lambda c: c.post("/admin/responses/purge", json={"tenant": "default"}),
                                     lambda c: c.get(f"/v1/responses/{made[0].json()['id']}")])
    rows = listed.json()["replicas"]
    assert [row["replica"] for row in rows] == ["replica-0", "replica-1"]
    assert sum(row["report"]["responses"] for row in rows) == 3
    body = done.json()
    assert (body["responses"], body["tenants"], body["result"]) == (3, {"default": 3}, "ok")
    assert [row["status"] for row in body["replicas"]] == [200, 200]
    assert gone.status_code == 404


def test_responses_past_responses_max_age_are_let_go_by_housekeeping(tmp_path):
    import time
    from types import SimpleNamespace

    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.response_admin import expire

    assert resolve({"state_dir": str(tmp_path), "responses_max_age": "30d"}, env={}).responses_max_age == 30 * 86400
    with pytest.raises(Exception, match="responses_max_age"):
        resolve({"state_dir": str(tmp_path), "responses_max_age": "soon"}, env={})
    store = ResponseStore(2**20)
    now = time.time()
    store.put("acme", response("resp_old", now - 7200), [{"role": "user", "content": "old"}])
    store.put("acme", response("resp_new", now - 60), [{"role": "user", "content": "new"}])
    service = SimpleNamespace(responses=store, conversations=ConversationStore(2**20),
                              config=SimpleNamespace(responses_max_age=3600.0))
    assert expire(service) == 1 and store.figures()["expired"] == 1
    assert store.get("acme", "resp_old") is None and store.get("acme", "resp_new") is not None
    assert expire(service) == 0
    service.config.responses_max_age = None
    assert expire(service) == 0 and store.get("acme", "resp_new") is not None


def test_responses_max_age_reloads_live_and_housekeeping_applies_it(kvd):
    import time
    from dataclasses import replace

    from kvctl.daemon.server.response_admin import expire

    service, _, _ = kvd
    service.responses.put("acme", response("resp_old", time.time() - 7200), [{"role": "user", "content": "old"}])
    assert expire(service) == 0  # (none set: kept)
    result = service.reload(replace(service.config, responses_max_age=3600.0))
    assert result["changed"] == {"responses_max_age": 3600.0} and result["needs_restart"] == []
    assert expire(service) == 1 and service.responses.get("acme", "resp_old") is None
    assert service.status()["responses"]["expired"] == 1
    from .daemon_fixtures import call

    assert "kvd_responses_expired_total 1.0" in call(kvd[1], "GET", "/metrics").text
