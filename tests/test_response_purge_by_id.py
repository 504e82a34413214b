"""`kvctl responses purge --id`: an operator removes the responses and conversations a user asked
to forget, by id, whoever's they are (with --tenant, that tenant's only), audited; an id kvd does
not keep is named, and kvctl exits 3; at kvd router, an id is missing only where no replica kept it."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from .kvctl_fakes import kvctl_answered  # noqa: E402
from .test_conversations import item  # noqa: E402
from .test_responses_api import kvd, scripted  # noqa: E402,F401


def test_an_operator_purges_responses_and_conversations_by_id_and_is_told_which_were_not_kept(kvd):
    from .daemon_fixtures import GLOBEX_TOKEN, USER_TOKEN, call

    service, unix, tcp = kvd
    for tenant, response_id in (("acme", "resp_a1"), ("acme", "resp_a2"), ("globex", "resp_g1")):
        service.responses.put(tenant, {"id": response_id, "created_at": 1, "output": []},
                              [{"role": "user", "content": f"about {response_id}"}])
    talk = service.conversations.create("acme", [item("hello", "msg_1")], {}, 1)
    asked = ["resp_a1", talk.id, "resp_g1", "resp_never"]

    dry = call(unix, "POST", "/admin/responses/purge", json={"ids": asked, "dry_run": True}).json()
    assert (dry["responses"], dry["tenants"], dry["conversations"]["conversations"]) == (2, {"acme": 1, "globex": 1}, 1)
    assert (dry["ids"], dry["ids_not_found"]) == (sorted(asked), ["resp_never"])
    assert service.responses.get("acme", "resp_a1") is not None  # (a dry run removes nothing)

    only = call(unix, "POST", "/admin/responses/purge", json={"ids": ["resp_a1", "resp_g1"], "tenant": "globex"})
    assert only.json()["tenants"] == {"globex": 1} and only.json()["ids_not_found"] == ["resp_a1"]
    assert service.responses.get("acme", "resp_a1") is not None  # another tenant's, with tenant named: kept

    done = call(unix, "POST", "/admin/responses/purge", json={"ids": asked}).json()
    assert (done["responses"], done["tenants"], done["conversations"]["tenants"]) == (1, {"acme": 1}, {"acme": 1})
    assert done["ids_not_found"] == ["resp_g1", "resp_never"]  # (resp_g1 went in the purge before)
    acme, globex = ({"Authorization": f"Bearer {token}"} for token in (USER_TOKEN, GLOBEX_TOKEN))
    gone = call(tcp, "GET", f"/v1/conversations/{talk.id}", headers=acme)
    assert gone.status_code == 404 and "is no longer kept: an operator purged it (kvctl responses purge), " in \
        gone.json()["error"]["message"]
    assert call(tcp, "GET", "/v1/responses/resp_a2", headers=acme).status_code == 200  # not named: kept
    other = call(tcp, "GET", "/v1/responses/resp_a1", headers=globex)  # another tenant learns nothing of why
    assert other.status_code == 404 and "purged" not in other.json()["error"]["message"]
    records = call(unix, "GET", "/admin/audit?action=responses.purge").json()["entries"]
    assert [(r["tenant"], r["target"]) for r in records] == [("-", "ids:4"), ("globex", "tenant:globex,ids:2")]
    assert records[0]["detail"]["ids_not_found"] == ["resp_g1", "resp_never"]

    for body, message, param in [
            ({"ids": ["resp_a2"], "older_than": "1h"}, "ids: purges the responses and conversations named, whatever "
                                                       "their age; leave older_than out", "ids"),
            ({"ids": ["resp_a2"], "all": True}, "all: purges every kept response and conversation; leave tenant, "
                                                "older_than and ids out, or all", "all")]:
        refused = call(unix, "POST", "/admin/responses/purge", json=body)
        assert refused.status_code == 400
        assert (refused.json()["error"]["message"], refused.json()["error"]["param"]) == (message, param)
    bad = call(unix, "POST", "/admin/responses/purge", json={"ids": ["resp_a2", "msg_1"]})
    assert (bad.status_code, bad.json()["error"]["param"], bad.json()["error"]["message"]) == (
        400, "ids", "ids: String should match pattern '^(resp|conv)_[A-Za-z0-9_-]{1,128}$' (got 'msg_1')")
    assert call(unix, "POST", "/admin/responses/purge", json={"ids": []}).status_code == 400
    assert service.responses.get("acme", "resp_a2") is not None  # refused: nothing removed


def test_a_background_response_named_by_id_is_cancelled_then_purged():
    import asyncio
    from types import SimpleNamespace

    from kvctl.daemon.server.conversation_store import ConversationStore
    from kvctl.daemon.server.response_admin import purge
    from kvctl.daemon.server.response_runs import Run
    from kvctl.daemon.server.response_store import ResponseStore

    responses = ResponseStore(2**20)
    done_log = []

    class Store:
        def audit(self, **record) -> None:
            done_log.append(("audit", record["target"]))

    async def main():
        stops = {}
        for response_id in ("resp_run", "resp_other"):
            run = Run("acme", f"req-{response_id}", False,
                      lambda status, rid=response_id: {"id": rid, "created_at": 1, "status": status})
            stops[run.request_id] = asyncio.Event()
            run.task = asyncio.create_task(stops[run.request_id].wait())
            responses.begin(response_id, run)

        def cancel(request_id: str) -> None:  # the engine stops it: it ends, and is kept as it stood
            done_log.append(request_id)
            responses.put("acme", {"id": "resp_run", "created_at": 1, "output": []}, [])
            run = responses.runs["resp_run"]
            responses.ended("resp_run")
            run.end({"id": "resp_run", "status": "cancelled"})
            stops[request_id].set()

        service = SimpleNamespace(responses=responses, conversations=ConversationStore(2**20), store=Store(),
                                  cancel=cancel)
        who = SimpleNamespace(actor="ops")
        dry = await purge(service, None, None, False, True, who, ["resp_run"])
        done = await purge(service, None, None, False, False, who, ["resp_run"])
        for stop in stops.values():
            stop.set()
        return dry, done

    dry, done = asyncio.run(main())
    assert (dry["running"], dry["responses"], dry["ids_not_found"]) == (1, 0, [])  # running counts as found
    assert (done["cancelled"], done["responses"], done["ids_not_found"]) == (1, 1, [])
    assert done_log == ["req-resp_run", ("audit", "ids:1")]
    assert list(responses.runs) == ["resp_other"]  # not named: it runs on


def test_at_the_router_an_id_is_missing_only_where_no_replica_keeps_it():
    from kvctl.daemon.server.fleet_admin import merge_response_purges

    def body(found: list[str], missing: list[str]) -> dict:
        return {"responses": len(found), "bytes": 10 * len(found), "cancelled": 0, "running": 0,
                "tenants": {"acme": len(found)} if found else {}, "conversations": {"conversations": 0, "bytes": 0,
                                                                                    "tenants": {}},
                "dry_run": False, "tenant": None, "older_than_s": None, "all": False,
                "ids": ["resp_1", "resp_2", "resp_3"], "ids_not_found": missing}

    merged = merge_response_purges([body(["resp_1"], ["resp_2", "resp_3"]), body(["resp_2"], ["resp_1", "resp_3"])])
    assert (merged["responses"], merged["tenants"]) == (2, {"acme": 2})
    assert (merged["ids"], merged["ids_not_found"]) == (["resp_1", "resp_2", "resp_3"], ["resp_3"])


def test_kvctl_names_the_ids_not_kept_and_exits_3():
    sent = []
    answer = {"responses": 1, "bytes": 2048, "tenants": {"acme": 1}, "running": 0, "cancelled": 0, "dry_run": False,
              "tenant": None, "older_than_s": None, "all": False,
              "conversations": {"conversations": 1, "bytes": 1024, "tenants": {"acme": 1}},
              "ids": ["conv_1", "resp_1", "resp_9"], "ids_not_found": ["resp_9"]}
    printed = kvctl_answered(["responses", "purge", "--id", "resp_1", "--id", "conv_1", "--id", "resp_9"], answer,
                             sent)
    assert printed.exit_code == 3, printed.output
    assert sent == [("/admin/responses/purge", {"ids": ["resp_1", "conv_1", "resp_9"], "all": False,
                                                "dry_run": False})]
    assert printed.output.splitlines() == [
        "removed 1 responses (2.0 KiB): acme 1; and 1 conversations (1.0 KiB): acme 1", "not kept: resp_9"]
