"""OpenAI's webhooks sent by kvd (daemon/server/webhooks.py): signed as OpenAI signs them (its own
client verifies them), each tenant's to its own endpoint, written down before they are sent,
tried again with backoff, and sent when a batch or a background response ends."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from kvctl.daemon.server import webhooks as webhooks_module  # noqa: E402
from kvctl.daemon.server.webhooks import Webhooks, WebhooksFileError, new_secret, read_endpoints  # noqa: E402

ACME_SECRET, SHARED_SECRET = new_secret(), new_secret()


def hooks_file(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "webhooks.txt"
    path.write_text(text)
    path.chmod(mode)
    return path


class Receiver:
    """Tenants' endpoints: each request kept (url, headers, body); answered as `answers` say
    (a status, or an exception to raise), then 200."""

    def __init__(self, answers=()) -> None:
        self.got: list[tuple[str, dict, bytes]] = []
        self.answers = list(answers)
        self.transport = httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.got.append((str(request.url), dict(request.headers), request.content))
        answer = self.answers.pop(0) if self.answers else 200
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer)

    def events(self, secret: str = ACME_SECRET) -> list:
        """What was delivered, each verified and read by OpenAI's own client."""
        client = openai.OpenAI(api_key="unused")
        return [client.webhooks.unwrap(body, headers, secret=secret) for _, headers, body in self.got]


async def a_completed_batch(client):
    """A batch of one chat line, made by `client` (OpenAI's, of a tenant) and waited for until it ends."""
    from .test_batches_api import CHAT, SYSTEMS, chat_line, jsonl, until_ended

    kept = await client.files.create(file=("in.jsonl", jsonl([chat_line("a", SYSTEMS[0], "Hi?")])), purpose="batch")
    return await until_ended(client, (await client.batches.create(input_file_id=kept.id, endpoint=CHAT,
                                                                  completion_window="24h")).id)


def kvd_telling_acme(tmp_path):
    """A kvd whose webhooks_file names tenant acme's endpoint, its events delivered to a Receiver:
    (service, receiver, its TCP app)."""
    from .daemon_fixtures import apps, start_service, token_table

    path = hooks_file(tmp_path, f"acme https://acme.example/hooks {ACME_SECRET}\n")
    service = start_service(tmp_path, webhooks_file=str(path))
    receiver = Receiver()
    service.webhooks.transport = receiver.transport
    return service, receiver, apps(service, token_table(tmp_path))[1]


async def until(condition, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not in time")


# ---- the file ------------------------------------------------------------------------------
def test_the_file_names_each_tenant_s_endpoint_and_star_for_the_others(tmp_path):
    path = hooks_file(tmp_path, f"# tenant url secret\nacme https://acme.example/hooks {ACME_SECRET}\n\n"
                                f"* https://ops.example/kvd {SHARED_SECRET}  # everyone else\n")
    endpoints = read_endpoints(path)
    assert [(e.tenant, e.url, e.line) for e in endpoints.values()] == [
        ("acme", "https://acme.example/hooks", 2), ("*", "https://ops.example/kvd", 4)]
    hooks = Webhooks(tmp_path / "state", lambda: endpoints)
    assert hooks.endpoint_for("acme").url == "https://acme.example/hooks"
    assert hooks.endpoint_for("globex").url == "https://ops.example/kvd"
    assert Webhooks(tmp_path / "state", lambda: {"acme": endpoints["acme"]}).send("globex", "batch.completed",
                                                                                  "batch_x") is None


@pytest.mark.parametrize("text, message", [
    ("acme https://a.example\n", "line 1 of {path!r}: expected TENANT URL SECRET, got 2 fields"),
    ("acme ftp://a.example whsec_x\n",
     "line 1 of {path!r}: the URL must be http:// or https://, got 'ftp://a.example'"),
    ("acme https://a.example whsec_c2hvcnQ=\n", "line 1 of {path!r}: the secret must be whsec_ and 24 or more bytes "
                                                "in base64 (as `kvd webhook-secret` makes one)"),
    ("acme https://a.example SECRET\nacme https://b.example SECRET\n",
     "line 2 of {path!r}: tenant 'acme' has an endpoint on line 1 too"),
    ("ac/me https://a.example SECRET\n", "line 1 of {path!r}: 'ac/me' is not a tenant name"),
])
def test_a_faulty_line_is_named_and_its_secret_never_is(tmp_path, text, message):
    path = hooks_file(tmp_path, text.replace("SECRET", ACME_SECRET))
    with pytest.raises(WebhooksFileError) as refused:
        read_endpoints(path)
    assert str(refused.value).startswith("webhooks_file: " + message.format(path=str(path)))
    assert ACME_SECRET not in str(refused.value)


def test_a_file_every_user_may_read_is_refused(tmp_path):
    path = hooks_file(tmp_path, f"acme https://a.example {ACME_SECRET}\n", mode=0o644)
    with pytest.raises(WebhooksFileError, match="is open to every user on the machine \\(mode 0644\\)"):
        read_endpoints(path)


# ---- delivering ----------------------------------------------------------------------------
def test_an_event_is_signed_as_openai_signs_and_tried_again_until_it_is_delivered(tmp_path, monkeypatch):
    monkeypatch.setattr(webhooks_module, "FIRST_RETRY_S", 0.05)
    endpoints = read_endpoints(hooks_file(tmp_path, f"acme https://acme.example/hooks {ACME_SECRET}\n"))
    receiver = Receiver([500, httpx.ConnectError("refused")])
    hooks = Webhooks(tmp_path / "state", lambda: endpoints, transport=receiver.transport)

    async def go():
        hooks.start()
        sent = hooks.send("acme", "batch.completed", "batch_0123")
        await until(lambda: not hooks.pending)
        return sent

    sent = asyncio.run(go())
    assert [url for url, _, _ in receiver.got] == ["https://acme.example/hooks"] * 3
    assert {headers["webhook-id"] for _, headers, _ in receiver.got} == {sent.id}  # one event, tried three times
    [*_, delivered] = receiver.events()[-1:]
    assert (delivered.type, delivered.data.id, delivered.id, delivered.object) == (
        "batch.completed", "batch_0123", sent.id, "event")
    assert hooks.figures() == {"pending": 0, "delivered": 1, "retried": 2, "dropped": 0}
    assert list((tmp_path / "state").glob("*.json")) == []  # delivered: its file gone
    with pytest.raises(openai.InvalidWebhookSignatureError):  # another tenant's secret does not verify it
        receiver.events(secret=SHARED_SECRET)


def test_an_event_not_delivered_before_a_restart_is_delivered_after_it(tmp_path):
    endpoints = read_endpoints(hooks_file(tmp_path, f"acme https://acme.example/hooks {ACME_SECRET}\n"))
    first = Webhooks(tmp_path / "state", lambda: endpoints)
    sent = first.send("acme", "response.completed", "resp_42")  # (no loop yet: kvd stopped before it went)
    assert [p.name for p in (tmp_path / "state").glob("*.json")] == [f"{sent.id}.json"]
    receiver = Receiver()
    again = Webhooks(tmp_path / "state", lambda: endpoints, transport=receiver.transport)

    async def go():
        again.start()
        await until(lambda: not again.pending)

    asyncio.run(go())
    [event] = receiver.events()
    assert (event.id, event.type, event.data.id) == (sent.id, "response.completed", "resp_42")


def test_the_same_end_told_again_keeps_its_event_id_and_another_end_has_its_own(tmp_path):
    endpoints = read_endpoints(hooks_file(tmp_path, f"acme https://acme.example/hooks {ACME_SECRET}\n"))
    hooks = Webhooks(tmp_path / "state", lambda: endpoints)
    first = hooks.send("acme", "batch.completed", "batch_1")
    again = hooks.send("acme", "batch.completed", "batch_1")
    other = hooks.send("acme", "batch.completed", "batch_2")
    assert first.id == again.id == Webhooks.event_id("acme", "batch.completed", "batch_1") != other.id
    assert sorted(hooks.pending) == sorted([first.id, other.id])
    assert len(list((tmp_path / "state").glob("evt_*.json"))) == 2
    assert hooks.told("globex", "batch.completed", "batch_3") is True  # (no endpoint: nothing to tell)
    assert len(hooks.pending) == 2


def test_an_event_is_dropped_once_past_three_days_and_said_in_the_log(tmp_path, monkeypatch, caplog):
    endpoints = read_endpoints(hooks_file(tmp_path, f"acme https://acme.example/hooks {ACME_SECRET}\n"))
    clock = [1_000_000.0]
    receiver = Receiver([503])
    hooks = Webhooks(tmp_path / "state", lambda: endpoints, clock=lambda: clock[0], transport=receiver.transport)
    sent = hooks.send("acme", "batch.expired", "batch_old")
    clock[0] += webhooks_module.KEEP_TRYING_S

    async def go():
        hooks.start()
        await until(lambda: not hooks.pending)

    asyncio.run(go())
    assert hooks.figures() == {"pending": 0, "delivered": 0, "retried": 1, "dropped": 1}
    assert f"webhook {sent.id} (batch.expired of tenant acme) dropped: not delivered in 72 h (1 tries; answered " \
           "503)" in caplog.text


# ---- from kvd --------------------------------------------------------------------------------
def test_kvd_tells_each_tenant_s_endpoint_when_its_batch_or_background_response_ends(tmp_path):
    from .daemon_fixtures import ADMIN_TOKEN, USER_TOKEN, call
    from .test_batches_api import CHAT
    from .test_responses_api import client_for

    service, receiver, tcp = kvd_telling_acme(tmp_path)
    try:

        async def go():
            service.webhooks.start()
            acme = client_for(tcp, USER_TOKEN)
            done = await a_completed_batch(acme)
            bad = await acme.files.create(file=("bad.jsonl", b"{not json\n"), purpose="batch")
            failed = await acme.batches.create(input_file_id=bad.id, endpoint=CHAT, completion_window="24h")
            background = await acme.responses.create(model="kvd-demo-llama-v1", input="Say hi.", background=True,
                                                     max_output_tokens=4, extra_body={"ignore_eos": True})
            while (background := await acme.responses.retrieve(background.id)).status in ("queued", "in_progress"):
                await asyncio.sleep(0.05)
            await until(lambda: len(receiver.got) == 3 and not service.webhooks.pending)
            return done, failed, background

        done, failed, background = asyncio.run(go())
        events = receiver.events()
        assert background.status == "incomplete"  # (its 4 tokens ran out, no EOS: response.incomplete, as OpenAI's)
        assert sorted((e.type, e.data.id) for e in events) == sorted([
            ("batch.completed", done.id), ("batch.failed", failed.id), ("response.incomplete", background.id)])
        assert {url for url, _, _ in receiver.got} == {"https://acme.example/hooks"}
        assert all(json.loads(body)["object"] == "event" for _, _, body in receiver.got)
        scraped = call(tcp, "GET", "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).text.splitlines()
        assert 'kvd_webhook_deliveries_total{outcome="delivered"} 3.0' in scraped
        assert "kvd_webhooks_pending 0.0" in scraped
    finally:
        service.shutdown(1)


def test_a_batch_end_whose_event_could_not_be_written_is_told_at_kvd_s_next_start(tmp_path, caplog):
    from .daemon_fixtures import USER_TOKEN, apps, start_service, token_table
    from .test_responses_api import client_for

    path = hooks_file(tmp_path, f"acme https://acme.example/hooks {ACME_SECRET}\n")
    (tmp_path / "webhooks").write_text("")  # (where kvd writes its events down: a file, not a folder)
    service = start_service(tmp_path, webhooks_file=str(path))
    try:
        _, tcp = apps(service, token_table(tmp_path))

        async def go():
            acme = client_for(tcp, USER_TOKEN)
            return await a_completed_batch(acme)

        done = asyncio.run(go())
        assert done.status == "completed"
        assert service.webhooks.figures() == {"pending": 0, "delivered": 0, "retried": 0, "dropped": 1}
        assert "(batch.completed of tenant acme) dropped: it could not be written down" in caplog.text
    finally:
        service.shutdown(1)
    (tmp_path / "webhooks").unlink()  # (room again)
    for life in range(2):  # the next start tells it; the one after does not again
        service = start_service(tmp_path, webhooks_file=str(path))
        receiver = Receiver()
        service.webhooks.transport = receiver.transport
        try:
            async def deliver():
                service.webhooks.start()
                await until(lambda: not service.webhooks.pending)
                await asyncio.sleep(0.05)

            asyncio.run(deliver())
            told = [(event.id, event.type, event.data.id) for event in receiver.events()]
            assert told == ([] if life else [
                (Webhooks.event_id("acme", "batch.completed", done.id), "batch.completed", done.id)])
        finally:
            service.shutdown(1)


def test_a_reload_reads_the_file_again_and_a_faulty_one_is_refused_keeping_the_old(tmp_path):
    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.calls import ServiceError

    from .daemon_fixtures import start_service

    path = hooks_file(tmp_path, f"acme https://acme.example/hooks {ACME_SECRET}\n")
    service = start_service(tmp_path, webhooks_file=str(path))
    try:
        settings = {"state_dir": str(tmp_path), "socket": str(tmp_path / "kvd.sock"), "num_blocks": 64,
                    "webhooks_file": str(path)}
        service.config_source = lambda: resolve(settings, env={})
        path.write_text(f"acme https://acme.example/v2 {ACME_SECRET}\nglobex https://globex.example\n")
        with pytest.raises(ServiceError) as refused:
            service.reload_from_source("test")
        assert f"webhooks_file: line 2 of {str(path)!r}: expected TENANT URL SECRET, got 2 fields" in str(refused.value)
        assert service.webhook_endpoints["acme"].url == "https://acme.example/hooks"
        path.write_text(f"acme https://acme.example/v2 {ACME_SECRET}\n")
        service.reload_from_source("test")
        assert service.webhook_endpoints["acme"].url == "https://acme.example/v2"
    finally:
        service.shutdown(1)


def test_an_operator_sees_the_endpoints_and_the_events_waiting_and_tries_them_now_audited(tmp_path, monkeypatch,
                                                                                          caplog):
    from rich.console import Console

    from kvctl.webhooks_cmd import webhooks_view

    from .daemon_fixtures import ADMIN_TOKEN, apps, assert_admin_only, start_service, token_table

    monkeypatch.setattr(webhooks_module, "FIRST_RETRY_S", 600.0)
    path = hooks_file(tmp_path, f"acme https://ops:pw@acme.example:8443/hooks?key=abc {ACME_SECRET}\n")
    service = start_service(tmp_path, webhooks_file=str(path))
    receiver = Receiver([500])
    service.webhooks.transport = receiver.transport
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        _, tcp = apps(service, token_table(tmp_path))

        async def go():
            service.webhooks.start()
            sent = service.webhooks.send("acme", "batch.completed", "batch_7")
            await until(lambda: receiver.got)
            await asyncio.sleep(0.05)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=tcp), base_url="http://kvd",
                                         headers=admin) as client:
                seen = (await client.get("/admin/webhooks")).json()
                retried = (await client.post("/admin/webhooks/retry")).json()
            await until(lambda: not service.webhooks.pending)
            return sent, seen, retried

        sent, seen, retried = asyncio.run(go())
        assert seen["endpoints"] == [{"tenant": "acme", "url": "https://acme.example:8443/hooks"}]  # no user, key
        [waiting] = seen["pending"]
        assert (waiting["id"], waiting["type"], waiting["attempts"], waiting["last_error"]) == (
            sent.id, "batch.completed", 1, "answered 500")
        assert 590 < waiting["next_in"] <= 600
        console = Console(record=True, width=200)
        console.print(webhooks_view({**seen, "pending": [{**waiting, "next_in": 597.0}]}))
        assert " ".join(console.export_text().split()) == (
            f"tenant acme: https://acme.example:8443/hooks {sent.id} batch.completed of tenant acme: 1 tries, next "
            "in 9m (last: answered 500) 1 waiting; since kvd started 0 delivered, 1 tries failed, 0 dropped")
        assert retried == {"retried": 1} and len(receiver.got) == 2 and receiver.events()[-1].data.id == "batch_7"
        [record] = service.store.audit_since(0, action="webhooks_retry")
        assert (record["result"], record["detail"]) == ("ok", {"events": 1})
        assert ACME_SECRET not in json.dumps(seen) and "pw@" not in caplog.text and "key=abc" not in caplog.text
        assert "to https://acme.example:8443/hooks: answered 500; tried again in 600 s" in caplog.text
        assert_admin_only(tcp, "GET", "/admin/webhooks")
        assert_admin_only(tcp, "POST", "/admin/webhooks/retry")
    finally:
        service.shutdown(1)


def test_an_operator_tells_an_ended_batch_s_or_background_response_s_end_again_under_its_event_id(tmp_path):
    from .daemon_fixtures import ADMIN_TOKEN, GLOBEX_TOKEN, USER_TOKEN, assert_admin_only
    from .test_responses_api import client_for

    service, receiver, tcp = kvd_telling_acme(tmp_path)
    try:

        async def background(client, **fields):
            made = await client.responses.create(model="kvd-demo-llama-v1", input="Say hi.", max_output_tokens=2,
                                                 extra_body={"ignore_eos": True}, **fields)  # (incomplete: 2 tokens)
            while made.status in ("queued", "in_progress"):
                await asyncio.sleep(0.05)
                made = await client.responses.retrieve(made.id)
            return made

        async def go():
            service.webhooks.start()
            acme = client_for(tcp, USER_TOKEN)
            done = await a_completed_batch(acme)
            ran = await background(acme, background=True)
            plain = await background(acme)
            elsewhere = await background(client_for(tcp, GLOBEX_TOKEN), background=True)  # (no endpoint)
            await until(lambda: len(receiver.got) == 2 and not service.webhooks.pending)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=tcp), base_url="http://kvd",
                                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as client:
                answers = [await client.post(f"/admin/webhooks/resend/{object_id}") for object_id in (
                    done.id, ran.id, plain.id, elsewhere.id, "batch_nope", "resp_nope", "file-abc")]
            await until(lambda: len(receiver.got) == 4 and not service.webhooks.pending)
            return done, ran, plain, elsewhere, answers

        done, ran, plain, elsewhere, answers = asyncio.run(go())
        batch_event = Webhooks.event_id("acme", "batch.completed", done.id)
        response_event = Webhooks.event_id("acme", "response.incomplete", ran.id)
        assert [a.json() for a in answers[:2]] == [
            {"id": batch_event, "type": "batch.completed", "tenant": "acme", "object_id": done.id},
            {"id": response_event, "type": "response.incomplete", "tenant": "acme", "object_id": ran.id}]
        told = [(event.id, event.type, event.data.id) for event in receiver.events()]
        first = [(batch_event, "batch.completed", done.id), (response_event, "response.incomplete", ran.id)]
        assert told == first * 2  # told again as first told: the same ids
        refused = [(a.status_code, a.json()["error"]["message"]) for a in answers[2:]]
        assert refused == [
            (409, f"id: response {plain.id!r} was not made with background: true: no webhook tells of its end"),
            (409, "id: tenant globex has no endpoint in webhooks_file: kvd sends it no webhook"),
            (404, "id: no batch 'batch_nope' is kept here"),
            (404, "id: no response 'resp_nope' is kept here"),
            (400, "id: a batch's id (batch_...) or a background response's (resp_...), got 'file-abc'")]
        records = service.store.audit_since(0, action="webhook_resend")[::-1]  # (it lists the newest first)
        assert [(r["target"], r["tenant"], r["result"]) for r in records] == [
            (done.id, "acme", "ok"), (ran.id, "acme", "ok"), (plain.id, "acme", "refused"),
            (elsewhere.id, "globex", "refused"), ("batch_nope", "ops", "refused"), ("resp_nope", "ops", "refused"),
            ("file-abc", "ops", "refused")]
        assert records[0]["detail"] == {"event": batch_event, "type": "batch.completed"}
        assert_admin_only(tcp, "POST", f"/admin/webhooks/resend/{done.id}")
    finally:
        service.shutdown(1)


def test_kvctl_webhooks_resend_says_what_was_sent_again_and_by_which_replica():
    from .kvctl_fakes import kvctl_answered

    sent: list = []
    told = {"id": "evt_1", "type": "batch.completed", "tenant": "acme", "object_id": "batch_7"}
    alone = kvctl_answered(["webhooks", "resend", "batch_7"], told, sent)
    assert alone.exit_code == 0 and alone.output == "batch.completed of batch_7 (tenant acme) sent again as evt_1\n"
    assert sent == [("/admin/webhooks/resend/batch_7", {})]
    fleet = kvctl_answered(["webhooks", "resend", "batch_7"], {**told, "replica": "b"})
    assert fleet.output == "batch.completed of batch_7 (tenant acme) sent again as evt_1 by replica b\n"


def test_kvctl_webhooks_retry_says_what_each_replica_tried_and_what_one_could_not_do():
    from .kvctl_fakes import kvctl_answered

    sent: list = []
    alone = kvctl_answered(["webhooks", "retry"], {"retried": 2}, sent)
    assert alone.exit_code == 0 and alone.output == "2 events tried now\n" and sent == [("/admin/webhooks/retry", {})]
    fleet = kvctl_answered(["webhooks", "retry"], {
        "retried": 3, "result": "partial", "message": "b: not reached (ConnectError: refused)",
        "replicas": [{"replica": "a", "status": 200, "retried": 3}, {"replica": "b", "status": None}]})
    assert fleet.output == ("replica a: 3 events tried now\nreplica b: not reached\n"
                            "3 events tried now; b: not reached (ConnectError: refused)\n")
