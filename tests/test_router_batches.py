"""kvd router and `/v1/files`, `/v1/batches`: a file is kept at the replica it was uploaded to, a
batch is made and served where its input file is (its output files are written there too), and
every request about either goes there; lists are the caller's at every replica."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from .test_router import drive, replicas, router_app  # noqa: E402,F401

CHAT = "/v1/chat/completions"


def lines(n: int, system: str) -> bytes:
    return "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Q{i}?"}],
        "max_tokens": 3, "temperature": 0, "ignore_eos": True}}) + "\n" for i in range(n)).encode()


async def ended(client, batch_id: str) -> dict:
    for _ in range(1200):
        answer = await client.get(f"/v1/batches/{batch_id}")
        if answer.json()["status"] in ("completed", "failed", "expired", "cancelled"):
            return answer
        await asyncio.sleep(0.05)
    raise AssertionError(f"{batch_id} did not end")


def test_a_batch_is_served_where_its_file_is_and_found_there_by_a_router_that_did_not_see_it(replicas):
    _, app = router_app(replicas, "round_robin")
    seen = {}

    async def make(client):
        uploads = [await client.post("/v1/files", files={"file": ("in.jsonl", lines(n, f"System {n}."))},
                                     data={"purpose": "batch"}) for n in (3, 2)]
        seen["uploads"] = uploads
        made = await client.post("/v1/batches", json={"input_file_id": uploads[1].json()["id"], "endpoint": CHAT,
                                                      "completion_window": "24h"})
        seen["made"] = made
        seen["done"] = await ended(client, made.json()["id"])
        seen["output"] = await client.get(f"/v1/files/{seen['done'].json()['output_file_id']}/content")
        seen["files"] = await client.get("/v1/files")
        seen["batches"] = await client.get("/v1/batches", params={"limit": "1"})
        seen["missing"] = await client.get("/v1/batches/batch_nope")
        seen["no_file"] = await client.post("/v1/batches", json={"input_file_id": "file-nope", "endpoint": CHAT,
                                                                 "completion_window": "24h"})
        return made

    drive(app, [make])
    first, second = (u.headers["x-kvd-replica"] for u in seen["uploads"])
    assert first != second  # (two uploads: two replicas, as conversations are spread)
    assert seen["made"].status_code == 200 and seen["made"].headers["x-kvd-replica"] == second
    done = seen["done"].json()
    assert done["status"] == "completed" and done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert seen["output"].headers["x-kvd-replica"] == second  # (its id asked of each replica: only there)
    assert [json.loads(row)["custom_id"] for row in seen["output"].text.splitlines()] == ["c0", "c1"]
    ids = {u.json()["id"] for u in seen["uploads"]} | {done["output_file_id"]}
    assert {f["id"] for f in seen["files"].json()["data"]} == ids  # every replica's
    page = seen["batches"].json()
    assert [b["id"] for b in page["data"]] == [done["id"]] and page["has_more"] is False
    assert seen["missing"].status_code == 404 and seen["missing"].json()["error"]["message"] == (
        "batch_id: no replica keeps batch 'batch_nope' (for this tenant)")
    assert seen["no_file"].status_code == 404 and seen["no_file"].json()["error"]["message"] == (
        "input_file_id: no replica keeps file 'file-nope' (for this tenant)")

    _, again = router_app(replicas, "round_robin")  # a router that did not see it made (restarted, another)

    async def read(client):
        return await client.get(f"/v1/batches/{done['id']}")

    async def operator(client):
        return await client.get("/admin/batches")

    async def cancel_ended(client):
        return await client.post(f"/admin/batches/{done['id']}/cancel")

    async def files_seen(client):
        return await client.get("/admin/files")

    async def delete_first(client):  # (the first upload, kept at the first replica)
        return await client.delete(f"/admin/files/{seen['uploads'][0].json()['id']}")

    async def resend(client):  # (its replica keeps it, and has no endpoint for it: its 409, not the other's 404)
        return await client.post(f"/admin/webhooks/resend/{done['id']}")

    found, listed, refused, files, deleted, resent = drive(
        again, [read, operator, cancel_ended, files_seen, delete_first, resend])
    assert found.status_code == 200 and found.headers["x-kvd-replica"] == second
    rows = {row["replica"]: [b["id"] for b in row["report"]["batches"]] for row in listed.json()["replicas"]}
    assert rows[second][0] == done["id"] and done["id"] not in rows[first]
    from .test_batches_api import shown  # (kvctl batches at the router: each replica's under its name)
    drawn = shown(listed.json(), now=done["created_at"] + 5)
    assert f"replica {second} {done['id']} completed (tenant default, made 5s ago) 2 of 2 answered" in drawn
    assert f"replica {first} " in drawn
    assert refused.status_code == 409 and refused.json()["error"]["message"] == (
        f"batch_id: batch {done['id']!r} has ended (completed); only a batch that has not can be cancelled")
    kept = {row["replica"]: {f["id"] for f in row["report"]["files"]} for row in files.json()["replicas"]}
    assert kept == {first: {seen["uploads"][0].json()["id"]},
                    second: {seen["uploads"][1].json()["id"], done["output_file_id"]}}
    from .test_file_budgets import shown as files_shown  # (kvctl files at the router: each replica's)
    assert f"replica {first} {seen['uploads'][0].json()['id']} batch" in files_shown(files.json(), done["created_at"])
    assert deleted.status_code == 200 and deleted.json()["replica"] == first and deleted.json()["tenant"] == "default"
    assert resent.status_code == 409 and resent.json()["error"]["message"] == (
        "id: tenant default has no endpoint in webhooks_file: kvd sends it no webhook")


class ClosesAfterReading(httpx.AsyncBaseTransport):
    """A replica that reads a POST's whole body, then closes the connection without answering
    (`read`: their bodies); it answers a GET (the router asking what a tenant's files take) with none."""

    def __init__(self) -> None:
        self.read: list[bytes] = []

    async def handle_async_request(self, request):
        if request.method == "GET":
            return httpx.Response(200, json={"files": [], "tenants": {}})
        self.read.append(b"".join([piece async for piece in request.stream]))
        raise httpx.RemoteProtocolError("server disconnected without sending a response", request=request)


def test_an_upload_goes_on_in_pieces_and_whole_again_to_the_next_replica_when_one_closes_reading_it(replicas):
    from kvctl.daemon.server.router import UPLOAD_PIECE, create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService
    from kvctl.policies.routing import make_router

    from .test_router import Counting, replica_client

    closing = ClosesAfterReading()
    fleet = [Replica("replica-0", replica_client("/run/replica-0.sock", transport=closing)),
             Replica("replica-1", replica_client("/run/replica-1.sock", transport=Counting(replicas[1])))]
    service = RouterService(fleet, make_router("round_robin"), view="ask", load_interval=0.05)
    content = lines(1, "System.") * (3 * UPLOAD_PIECE // len(lines(1, "System.")) + 1)  # (over 3 pieces)

    async def upload(client):
        uploaded = await client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
        return uploaded, await client.get(f"/v1/files/{uploaded.json()['id']}/content")

    [(uploaded, read_back)] = drive(create_router_app(service), [upload])
    assert uploaded.status_code == 200 and uploaded.headers["x-kvd-replica"] == "replica-1"
    assert uploaded.json()["bytes"] == len(content) and read_back.content == content
    [sent] = closing.read  # the whole form went to replica-0, and the whole of it again to replica-1
    assert content in sent and fleet[0].rerouted == 1


def test_an_upload_over_the_router_s_max_file_bytes_is_a_413_naming_it(replicas):
    from kvctl.daemon.server.router import create_router_app

    service, _ = router_app(replicas, "round_robin")
    app = create_router_app(service, max_file_bytes=8192)

    async def uploads(client):
        return [await client.post("/v1/files", files={"file": ("in.jsonl", lines(n, "S."))}, data={"purpose": "batch"})
                for n in (1, 200)]

    [(small, big)] = drive(app, [uploads])
    assert small.status_code == 200
    assert big.status_code == 413 and big.json()["error"]["message"].endswith(
        " bytes is over max_file_bytes (8,192); upload a smaller file (a batch's input in parts)")


class Tally(httpx.AsyncBaseTransport):
    """A replica's app, counting the chat completions it is sent and the tenant each is sent as."""

    def __init__(self, app) -> None:
        self.inner, self.chats = httpx.ASGITransport(app=app), []

    async def handle_async_request(self, request):
        if request.url.path == CHAT:
            self.chats.append(request.headers.get("x-kvd-tenant"))
        return await self.inner.handle_async_request(request)


@pytest.fixture
def fleet(tmp_path):
    """Two replicas (kvd services, the first sending its batches' requests through the router:
    batch_via) and a round-robin kvd router over them: (services, router unix app, tallies)."""
    from kvctl.daemon.server.app import create_app
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService
    from kvctl.policies.routing import make_router

    from .daemon_fixtures import start_service
    from .test_router import replica_client

    services = [start_service(tmp_path / f"r{i}", num_blocks=64, **({"batch_via": "/run/kvd/router.sock"}
                                                                    if i == 0 else {})) for i in range(2)]
    try:
        tallies = [Tally(create_app(s, s.metrics, front="unix")) for s in services]
        fleet = [Replica(f"replica-{i}", replica_client(f"/run/replica-{i}.sock", transport=t))
                 for i, t in enumerate(tallies)]
        router = create_router_app(RouterService(fleet, make_router("round_robin"), view="ask", load_interval=0.05))
        services[0].batches.transport_to = lambda socket: httpx.ASGITransport(app=router)
        yield services, router, tallies
    finally:
        for service in services:
            service.shutdown(deadline=5)


def test_with_batch_via_a_batch_s_requests_go_through_the_router_to_every_replica_as_its_tenant(fleet):
    from .daemon_fixtures import call

    services, _, tallies = fleet
    home = services[0].batches.lines_app  # (the first replica's Unix app: create_app set it)
    content = lines(6, "System for the fleet.")

    async def go():
        transport = httpx.ASGITransport(app=home)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvd", timeout=60) as client:
            uploaded = await client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"},
                                         headers={"X-KVD-Tenant": "acme"})
            made = await client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": CHAT,
                                                          "completion_window": "24h"}, headers={"X-KVD-Tenant": "acme"})
            done = await ended_as(client, made.json()["id"], "acme")
            output = await client.get(f"/v1/files/{done.json()['output_file_id']}/content",
                                      headers={"X-KVD-Tenant": "acme"})
            return done.json(), output

    done, output = asyncio.run(go())
    assert done["status"] == "completed" and done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert [json.loads(row)["custom_id"] for row in output.text.splitlines()] == [f"c{i}" for i in range(6)]
    assert [len(t.chats) for t in tallies] == [3, 3]  # round robin: each replica half of them
    assert {tenant for t in tallies for tenant in t.chats} == {"acme"}
    seen = call(home, "GET", "/admin/batches").json()
    assert seen["via"] == "/run/kvd/router.sock"
    from .test_batches_api import shown
    assert shown(seen, now=done["created_at"]).endswith(
        "0 failed; sent through kvd router at /run/kvd/router.sock (batch_via)")


async def batch_served(home, content: bytes) -> dict:
    """Upload `content` to kvd's Unix app `home`, make a batch of it and wait for it to end: the batch."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=home), base_url="http://kvd", timeout=60) as client:
        uploaded = await client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
        made = await client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": CHAT,
                                                      "completion_window": "24h"})
        return (await ended_as(client, made.json()["id"], "default")).json()


async def ended_as(client, batch_id: str, tenant: str):
    for _ in range(1200):
        answer = await client.get(f"/v1/batches/{batch_id}", headers={"X-KVD-Tenant": tenant})
        if answer.json()["status"] in ("completed", "failed", "expired", "cancelled"):
            return answer
        await asyncio.sleep(0.05)
    raise AssertionError(f"{batch_id} did not end")


class Flaky(httpx.AsyncBaseTransport):
    """The router's socket: refusing connections `down` times, then answering 502 `failing` times
    (a replica that failed), then the router itself."""

    def __init__(self, router, down: int, failing: int) -> None:
        self.inner, self.down, self.failing = httpx.ASGITransport(app=router), down, failing

    async def handle_async_request(self, request):
        if self.down:
            self.down -= 1
            raise httpx.ConnectError("connection refused", request=request)
        if self.failing:
            self.failing -= 1
            return httpx.Response(502, json={"error": {"message": "replica replica-0 failed",
                                                       "code": "replica_failed"}})
        return await self.inner.handle_async_request(request)


def test_a_router_down_or_a_replica_failing_behind_it_has_the_line_served_again_not_failed(fleet, caplog):
    services, router, _ = fleet
    flaky = Flaky(router, down=3, failing=2)
    services[0].batches.transport_to = lambda socket: flaky
    with caplog.at_level("WARNING", logger="kvd"):
        done = asyncio.run(batch_served(services[0].batches.lines_app, lines(4, "S.")))
    assert (flaky.down, flaky.failing) == (0, 0)
    assert done["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    sent = [r.getMessage() for r in caplog.records if "could not be sent" in r.getMessage()]
    assert sent[0].startswith("batch " + done["id"] + ": a request could not be sent to kvd router at "
                              "/run/kvd/router.sock (ConnectError: connection refused); it is served again")
    assert len(sent) == 1  # (the others like it held back: one line every few seconds)


def test_at_the_router_kvctl_webhooks_shows_each_replica_s_and_a_retry_reaches_each(fleet):
    from rich.console import Console

    from kvctl.webhooks_cmd import webhooks_view

    _, router, _ = fleet  # (neither replica has a webhooks_file: no endpoint, nothing waiting)

    async def ask(client):
        return (await client.get("/admin/webhooks")).json(), (await client.post("/admin/webhooks/retry")).json()

    [(seen, retried)] = drive(router, [ask])
    assert [(r["replica"], r["report"]["endpoints"], r["report"]["pending"]) for r in seen["replicas"]] == [
        ("replica-0", [], []), ("replica-1", [], [])]
    console = Console(record=True, width=200)
    console.print(webhooks_view(seen))
    assert " ".join(console.export_text().split()).startswith(
        "replica replica-0 no endpoint: webhooks_file names none (kvd sends no webhook) 0 waiting; since kvd "
        "started 0 delivered, 0 tries failed, 0 dropped")
    assert retried["retried"] == 0 and retried["result"] == "ok"
    assert [(r["replica"], r["retried"]) for r in retried["replicas"]] == [("replica-0", 0), ("replica-1", 0)]


ROUTER_URL = "https://router.fleet.example:8443"
BATCH_TOKEN, USER_TOKEN = "b" * 32, "u" * 32  # of the router's clients_file: an admin's, a user's


class Paths(httpx.AsyncBaseTransport):
    """The router's TCP front, noting the path of each request it is sent."""

    def __init__(self, app) -> None:
        self.inner, self.paths = httpx.ASGITransport(app=app), []

    async def handle_async_request(self, request):
        self.paths.append(request.url.path)
        return await self.inner.handle_async_request(request)


@pytest.fixture
def tcp_fleet(tmp_path):
    """Two replicas, the first sending its batches' requests to a kvd router's TCP front
    (batch_via a URL, with a token file), and that router (round robin, not yet trusted_proxy):
    (services, router service, its TCP front as Paths, tallies)."""
    from kvctl.daemon.server.app import create_app
    from kvctl.daemon.server.auth import TokenEntry, TokenTable
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService
    from kvctl.policies.routing import make_router

    from .daemon_fixtures import start_service
    from .test_router import replica_client

    token_file = tmp_path / "router-token"
    token_file.write_text(BATCH_TOKEN + "\n")
    token_file.chmod(0o600)
    services = [start_service(tmp_path / f"r{i}", num_blocks=64, **(
        {"batch_via": ROUTER_URL, "batch_via_token_file": str(token_file)} if i == 0 else {})) for i in range(2)]
    try:
        tallies = [Tally(create_app(s, s.metrics, front="unix")) for s in services]
        fleet = [Replica(f"replica-{i}", replica_client(f"/run/replica-{i}.sock", transport=t))
                 for i, t in enumerate(tallies)]
        router = RouterService(fleet, make_router("round_robin"), view="ask", load_interval=0.05)
        tokens = TokenTable([TokenEntry(BATCH_TOKEN.encode(), "ops", "admin", "token:1"),
                             TokenEntry(USER_TOKEN.encode(), "acme", "user", "token:2")])
        front = Paths(create_router_app(router, front="tcp", tokens=tokens))
        services[0].batches.transport_to = lambda via: front
        yield services, router, front, tallies
    finally:
        for service in services:
            service.shutdown(deadline=5)


def test_a_batch_via_a_routers_url_waits_until_it_serves_lines_as_their_tenant_then_goes_through_it(
        tcp_fleet, caplog, monkeypatch):
    """batch_via a router's TCP front: its lines carry the token of batch_via_token_file; while
    the router would serve them as that token's tenant (no --trusted-proxy) none is sent, each
    waiting with a WARNING that says why; once it serves them as the batch's tenant they go,
    its word asked once, not a line at a time."""
    from .daemon_fixtures import call

    services, router, front, tallies = tcp_fleet
    home = services[0].batches.lines_app

    async def go():
        transport = httpx.ASGITransport(app=home)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvd", timeout=60) as client:
            uploaded = await client.post("/v1/files", files={"file": ("in.jsonl", lines(4, "System via TCP."))},
                                         data={"purpose": "batch"}, headers={"X-KVD-Tenant": "acme"})
            made = await client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": CHAT,
                                                          "completion_window": "24h"}, headers={"X-KVD-Tenant": "acme"})
            for _ in range(200):  # until every line has been refused a first time, and tried again
                if front.paths.count("/router/status") >= 8:
                    break
                await asyncio.sleep(0.05)
            waiting = (await client.get(f"/v1/batches/{made.json()['id']}", headers={"X-KVD-Tenant": "acme"})).json()
            operator = (await client.get("/admin/batches")).json()
            monkeypatch.setattr(health_checks, "UNSENT_WARN_S", 0.0)  # (a minute, else)
            checked = (await client.get("/admin/checks")).json()["checks"]
            asked_while_refused = len(front.paths)
            router.trusted_proxy = True
            done = await ended_as(client, made.json()["id"], "acme")
            return waiting, operator, checked, asked_while_refused, done.json()

    from kvctl.daemon.server import health_checks

    with caplog.at_level("WARNING", logger="kvd"):
        waiting, operator, checked, asked_while_refused, done = asyncio.run(go())
    [via_check] = [c for c in checked if c["check"] == "batch via"]
    assert via_check["status"] == "warning" and via_check["detail"].startswith(
        f"requests of /v1/batches have not gone through kvd router at {ROUTER_URL} for ")
    assert waiting["status"] == "in_progress" and waiting["request_counts"]["completed"] == 0
    from .test_batches_api import shown
    assert shown(operator, now=operator["via_unsent"]["since"] + 3).endswith(
        f"sent through kvd router at {ROUTER_URL} (batch_via) requests have not gone through kvd router for 3s: kvd "
        f"router at {ROUTER_URL} serves a TCP caller's request under its token's tenant, not the batch's: start it "
        "with --trusted-proxy (trusted_proxy: true); they wait, and are sent once it takes them")
    assert set(front.paths[:asked_while_refused]) == {"/router/status"}  # (no line went while refused)
    unsent = [r.getMessage() for r in caplog.records if "was not sent" in r.getMessage()]
    assert unsent[0] == (f"batch {done['id']}: a request was not sent to kvd router at {ROUTER_URL}: kvd router at "
                         f"{ROUTER_URL} serves a TCP caller's request under its token's tenant, not the batch's: "
                         "start it with --trusted-proxy (trusted_proxy: true); it is served again")
    assert done["status"] == "completed" and done["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    sent = front.paths[asked_while_refused:]
    assert sent.count(CHAT) == 4 and sent.count("/router/status") <= 4  # (asked until a first yes, then held)
    assert [len(t.chats) for t in tallies] == [2, 2]
    assert {tenant for t in tallies for tenant in t.chats} == {"acme"}  # the batch's tenant, not the token's
    seen = call(home, "GET", "/admin/batches").json()
    assert (seen["via"], seen["via_unsent"]) == (ROUTER_URL, None)  # (it took them)


def test_a_routers_word_on_the_tenant_it_serves_lines_as_is_read_from_its_status(tcp_fleet, tmp_path):
    from kvctl.daemon.server.batch_via import refusal

    services, router, front, _ = tcp_fleet

    async def ask(token: str, app=None):
        transport = httpx.ASGITransport(app=app) if app is not None else front
        async with httpx.AsyncClient(transport=transport, base_url=ROUTER_URL,
                                     headers={"Authorization": f"Bearer {token}"}) as client:
            return await refusal(client, ROUTER_URL)

    assert asyncio.run(ask("n" * 32)) == f"kvd router at {ROUTER_URL} does not take the token of " \
                                         "batch_via_token_file (401)"
    assert asyncio.run(ask(USER_TOKEN)) == (f"kvd router at {ROUTER_URL} gives the token of batch_via_token_file no "
                                            "admin role (403): give it an admin token of the router's clients_file")
    assert "start it with --trusted-proxy" in asyncio.run(ask(BATCH_TOKEN))
    router.trusted_proxy = True
    assert asyncio.run(ask(BATCH_TOKEN)) is None
    from kvctl.daemon.server.app import create_app

    replica = create_app(services[1], services[1].metrics, front="unix")  # (a kvd, not a router)
    assert asyncio.run(ask(BATCH_TOKEN, replica)) == (f"{ROUTER_URL} answered /router/status with 404, not as a "
                                                      "kvd router")


def test_batch_via_s_token_is_read_at_start_and_again_at_a_reload_and_a_bad_one_refused(tmp_path):
    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.batch_via import BatchViaError, via_router
    from kvctl.daemon.server.calls import ServiceError

    from .daemon_fixtures import start_service

    token_file = tmp_path / "router-token"
    token_file.write_text("first-token-0123456789 # a comment after it\n")
    token_file.chmod(0o644)
    settings = {"state_dir": str(tmp_path), "socket": str(tmp_path / "kvd.sock"), "num_blocks": 64,
                "batch_via": ROUTER_URL, "batch_via_token_file": str(token_file)}
    with pytest.raises(BatchViaError) as opened:
        via_router(resolve(settings, env={}))
    assert str(opened.value) == (f"batch_via_token_file: {str(token_file)!r} is open to every user on the machine "
                                 f"(mode 0644); restrict it, e.g. chmod 600 {token_file}")
    token_file.chmod(0o600)
    bad_ca = tmp_path / "ca.pem"
    bad_ca.write_text("not a certificate\n")
    with pytest.raises(BatchViaError) as no_ca:
        via_router(resolve({**settings, "batch_via_ca_file": str(bad_ca)}, env={}))
    assert str(no_ca.value).startswith(f"batch_via_ca_file: {str(bad_ca)!r} does not load as CA certificates")
    service = start_service(tmp_path, batch_via=ROUTER_URL, batch_via_token_file=str(token_file))
    try:
        assert (service.batch_via.target, service.batch_via.token) == (ROUTER_URL, "first-token-0123456789")
        service.config_source = lambda: resolve(settings, env={})
        token_file.write_text("")
        with pytest.raises(ServiceError) as refused:
            service.reload_from_source("test")
        assert str(refused.value) == (f"reload refused, nothing changed: batch_via_token_file: {str(token_file)!r} "
                                      "holds no token")
        assert service.batch_via.token == "first-token-0123456789"
        token_file.write_text("second-token-0123456789\n")
        service.reload_from_source("test")
        assert service.batch_via.token == "second-token-0123456789"
        service.config_source = lambda: resolve({**settings, "batch_via": "/run/kvd/router.sock",
                                                 "batch_via_token_file": None}, env={})
        service.reload_from_source("test")
        assert (service.batch_via.target, service.batch_via.token) == ("/run/kvd/router.sock", None)
    finally:
        service.shutdown(1)


class TokenRotated(httpx.AsyncBaseTransport):
    """The router's TCP front, which refuses kvd's token for its first chat (rotated there, then
    put back)."""

    def __init__(self, front: Paths) -> None:
        self.front, self.refused = front, 1

    async def handle_async_request(self, request):
        if request.url.path == CHAT and self.refused:
            self.refused -= 1
            self.front.paths.append("401")
            return httpx.Response(401, json={"error": {"message": "invalid bearer token", "code": "unauthenticated"}})
        return await self.front.handle_async_request(request)


def test_a_line_whose_token_the_router_refuses_is_served_again_and_the_router_asked_again(tcp_fleet):
    services, router, front, _ = tcp_fleet
    router.trusted_proxy = True
    rotated = TokenRotated(front)
    services[0].batches.transport_to = lambda via: rotated
    done = asyncio.run(batch_served(services[0].batches.lines_app, lines(1, "S.")))
    assert done["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    assert front.paths == ["/router/status", "401", "/router/status", CHAT]


@pytest.fixture
def budgeted(tmp_path):
    """Two replicas whose tenant acme may keep 3,000 bytes of files, and their Unix apps."""
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import start_service

    services = [start_service(tmp_path / f"r{i}", num_blocks=64, tenant_files_bytes="acme=3000") for i in range(2)]
    try:
        yield services, [create_app(s, s.metrics, front="unix") for s in services]
    finally:
        for service in services:
            service.shutdown(deadline=5)


ACME = {"X-KVD-Tenant": "acme"}


def upload(client, size: int):
    return client.post("/v1/files", files={"file": ("in.jsonl", lines(1, "S.").ljust(size - 1) + b"\n")},
                       data={"purpose": "batch"}, headers=ACME)


def test_behind_the_router_a_tenant_s_files_budget_counts_its_files_at_every_replica(budgeted):
    """tenant_files_bytes is the fleet's behind kvd router: two uploads spread over two replicas
    take 2,400 of acme's 3,000 bytes, and a third of 1,200 is refused wherever it would go (each
    replica alone holds 1,200), saying the fleet's count; a batch finds no room for its output
    once acme's files across the fleet are at the budget."""
    services, apps = budgeted
    _, app = router_app(apps, "round_robin")

    async def go(client):
        first, second = await upload(client, 1200), await upload(client, 1200)
        third = await upload(client, 1200)
        fourth = await upload(client, 600)  # (fits: 3,000 across the fleet)
        batch = await client.post("/v1/batches", json={"input_file_id": first.json()["id"], "endpoint": CHAT,
                                                       "completion_window": "24h"}, headers=ACME)
        return first, second, third, fourth, batch, (await client.get("/admin/files")).json()

    [(first, second, third, fourth, batch, operator)] = drive(app, [go])
    assert first.status_code == second.status_code == 200
    assert first.headers["x-kvd-replica"] != second.headers["x-kvd-replica"]  # (spread: each holds 1,200)
    assert third.status_code == 400 and third.json()["error"]["message"] == (
        "file: 1,200 bytes more would take tenant acme's files to 3,600 bytes across the fleet (1,200 at kvd "
        "router's other replicas), over its tenant_files_bytes (3,000 bytes); delete files no longer needed "
        "(DELETE /v1/files/ID), or ask kvd's operator for more room")
    assert fourth.status_code == 200
    assert batch.status_code == 400 and batch.json()["error"]["message"].startswith(
        "input_file_id: tenant acme's files take 3,000 bytes across the fleet (")
    assert sorted(s.files.held("acme") for s in services) == [1200, 1800]
    from .test_file_budgets import shown
    assert shown(operator, now=first.json()["created_at"]).endswith(
        "tenant acme across the fleet: 3 files, 2.9 KiB of 2.9 KiB (tenant_files_bytes)")


def test_two_uploads_of_a_tenant_at_once_through_the_router_cannot_both_pass_its_budget(budgeted):
    _, apps = budgeted
    _, app = router_app(apps, "round_robin")

    async def both(client):
        return await asyncio.gather(upload(client, 1600), upload(client, 1600))

    [answers] = drive(app, [both])
    assert sorted(a.status_code for a in answers) == [200, 400]


def test_only_an_admin_says_what_a_tenant_s_files_take_elsewhere(tmp_path):
    """X-KVD-Tenant-Files-Elsewhere is kvd router's word: a user's is not read (it is served as
    if it had not said it), an admin's is counted, and one that is not a number is refused."""
    from .daemon_fixtures import ADMIN_TOKEN, USER_TOKEN, apps, call, start_service, token_table

    service = start_service(tmp_path, tenant_files_bytes="acme=3000,ops=3000")
    try:
        _, tcp = apps(service, token_table(tmp_path))

        def sent(token: str, elsewhere: str):
            return call(tcp, "POST", "/v1/files", files={"file": ("in.jsonl", b"x" * 1000)},
                        data={"purpose": "batch"}, headers={"Authorization": f"Bearer {token}",
                                                            "X-KVD-Tenant-Files-Elsewhere": elsewhere})

        user, admin, bad = sent(USER_TOKEN, "2500"), sent(ADMIN_TOKEN, "2500"), sent(ADMIN_TOKEN, "-1")
        odd = [sent(ADMIN_TOKEN, said) for said in (b"\xb2", "9" * 5000)]  # ("²", read as latin-1: a digit)
        assert [a.status_code for a in odd] == [400, 400]
        assert user.status_code == 200 and user.json()["bytes"] == 1000
        assert admin.status_code == 400 and admin.json()["error"]["message"].startswith(
            "file: 1,000 bytes more would take tenant ops's files to 3,500 bytes across the fleet (2,500 at kvd "
            "router's other replicas), over its tenant_files_bytes (3,000 bytes)")
        assert bad.status_code == 400 and bad.json()["error"] == {
            "message": "X-KVD-Tenant-Files-Elsewhere: invalid value '-1'; use a whole number of bytes",
            "type": "invalid_request_error", "param": "X-KVD-Tenant-Files-Elsewhere", "code": None}
    finally:
        service.shutdown(1)


def test_kvctl_check_warns_of_batch_requests_that_have_not_gone_through_the_router_for_a_minute():
    from kvctl.daemon.server.health_checks import status_checks

    def via(unsent):
        status = {"batch_via": {"target": "https://router:8443", "unsent": unsent}}
        return [c.describe() for c in status_checks(status, now=1000.0) if c.name == "batch via"]

    assert via(None) == [{"check": "batch via", "status": "ok",
                          "detail": "requests of /v1/batches go through kvd router at https://router:8443"}]
    assert via({"why": "it could not be reached (ConnectError)", "since": 950.0})[0]["status"] == "ok"  # (50 s)
    assert via({"why": "it could not be reached (ConnectError)", "since": 880.0}) == [{
        "check": "batch via", "status": "warning",
        "detail": "requests of /v1/batches have not gone through kvd router at https://router:8443 for 2 min: it "
                  "could not be reached (ConnectError); they wait"}]
    assert [c for c in status_checks({}, now=1000.0) if c.name == "batch via"] == []  # (served here)
