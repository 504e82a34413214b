"""Requests in flight: `GET /admin/requests` lists them (never their tokens), `POST /admin/cancel`
stops them by id or tenant as if their clients had left, and kvctl shows and drives both."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from .daemon_fixtures import apps, blocks_all_back, start_service, token_table  # noqa: E402

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}


async def serving(app, path):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, uds=path, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task


def test_requests_in_flight_are_listed_and_cancelled_by_id_or_tenant(tmp_path):
    service = start_service(tmp_path, num_blocks=256, max_running=1)
    unix, _ = apps(service, token_table(tmp_path))
    path = str(tmp_path / "kvd.sock")

    async def scenario():
        server, task = await serving(unix, path)
        try:
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path), base_url="http://kvd",
                                         timeout=60) as client:
                async with client.stream("POST", "/v1/chat/completions", headers={"X-KVD-Tenant": "acme"}, json={
                        "messages": [{"role": "user", "content": "Tell a long story."}], **LONG}) as first:
                    lines = first.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")  # it decodes
                    async with client.stream("POST", "/v1/completions", headers={"X-KVD-Tenant": "globex"},
                                             json={"prompt": "Wait your turn.", "guided_regex": "[a-z]{1,4000}",
                                                   **LONG}) as second:
                        listed = (await client.get("/admin/requests")).json()
                        only = (await client.get("/admin/requests", params={"tenant": "globex"})).json()
                        cancelled = (await client.post("/admin/cancel", json={
                            "request_ids": [first.headers["x-kvd-request-id"], "req-000000000000"]})).json()
                        tail = [line async for line in lines]
                        by_tenant = (await client.post("/admin/cancel", json={"tenant": "globex"})).json()
                        second_tail = [line async for line in second.aiter_lines()]
                        unknown = await client.post("/admin/cancel", json={"request_ids": ["req-ffffffffffff"]})
                        bad = await client.post("/admin/cancel", json={"request_ids": ["x"], "tenant": "acme"})
                        return (first.headers, second.headers, listed, only, cancelled, tail, by_tenant,
                                second_tail, unknown, bad)
        finally:
            server.should_exit = True
            await task

    try:
        (first, second, listed, only, cancelled, tail, by_tenant, second_tail, unknown,
         bad) = asyncio.run(scenario())
        ids = [first["x-kvd-request-id"], second["x-kvd-request-id"]]
        assert all(i.startswith("req-") for i in ids)
        rows = listed["requests"]
        assert [r["request_id"] for r in rows] == ids  # oldest first
        assert (listed["running"], listed["waiting"]) == (1, 1)
        running, waiting = rows
        assert (running["tenant"], running["api"], running["state"]) == ("acme", "chat", "decode")
        assert running["output_tokens"] >= 1 and running["blocks"] >= 1 and running["max_tokens"] == 3000
        assert running["prompt_tokens"] == len(service.chat_prompt([{"role": "user", "content": "Tell a long story."}]))
        assert (waiting["tenant"], waiting["api"], waiting["state"], waiting["blocks"]) == (
            "globex", "completions", "waiting", 0)
        assert waiting["output_tokens"] == 0 and waiting["queued_seconds"] == waiting["age_seconds"]
        assert set(running) == {"request_id", "tenant", "api", "state", "age_seconds", "queued_seconds",
                                "prompt_tokens", "cached_tokens", "restored_tokens", "output_tokens", "max_tokens",
                                "n", "preemptions", "blocks", "fetching_prefix", "waiting_for_lora_turn", "priority",
                                "cohort", "shape", "adapter", "drafted_tokens",
                                "kept_draft_tokens"}  # no tokens, no text
        assert running["adapter"] is None  # the model's own, not a LoRA adapter's
        assert running["drafted_tokens"] == running["kept_draft_tokens"] == 0  # no speculative_config here
        # the field that holds a reply to a shape (never the shape itself), or None
        assert (running["shape"], waiting["shape"]) == (None, "guided_regex")
        assert (running["fetching_prefix"], waiting["fetching_prefix"]) == (False, False)  # no lower tier here
        assert (running["waiting_for_lora_turn"], waiting["waiting_for_lora_turn"]) == (False, False)
        assert [r["request_id"] for r in only["requests"]] == [ids[1]]

        [gone] = cancelled["cancelled"]
        assert (gone["request_id"], gone["tenant"], gone["state"]) == (ids[0], "acme", "decode")
        assert cancelled["not_found"] == ["req-000000000000"] and cancelled["held_blocks"] == gone["blocks"]
        events = [json.loads(line[6:]) for line in tail if line.startswith("data: {")]
        assert any(e["choices"] and e["choices"][0]["finish_reason"] == "cancelled" for e in events)
        assert [c["request_id"] for c in by_tenant["cancelled"]] == [ids[1]]
        assert any('"finish_reason": "cancelled"' in line for line in second_tail)
        assert unknown.status_code == 404 and unknown.json()["error"]["message"] == (
            "request_ids: 'req-ffffffffffff' not in flight here (finished, or never here: `kvctl requests` "
            "lists those that are)")
        assert bad.status_code == 400 and bad.json()["error"]["message"] == "cancel: give request_ids or a tenant"
        audit = service.store.audit_since(action="cancel")
        assert sorted((a["tenant"], a["target"]) for a in audit) == [
            ("acme", f"request={ids[0]}"), ("globex", f"request={ids[1]}")]
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)


def kvctl_shows(args: list[str], body: dict) -> tuple[int, str]:
    """kvctl's exit status and output for the daemon's (or router's) answer `body`."""
    from typer.testing import CliRunner

    from kvctl.cli import app as kvctl_app

    class Answering:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def get(self, path, **params):
            return body

        def post(self, path, body_):
            return body

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("kvctl.requests_cmd.client_for", lambda ctx, tenant=None: Answering())
        result = CliRunner().invoke(kvctl_app, args, env={"COLUMNS": "120"})
    return result.exit_code, result.output


def unix_app(service):
    from kvctl.daemon.server.app import create_app

    return create_app(service, service.metrics, front="unix")


def test_at_the_router_every_replica_s_requests_are_listed_and_a_cancel_finds_its_replica(tmp_path):
    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.server.router import create_router_app
    from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
    from kvctl.daemon.server.calls import Principal
    from kvctl.policies.routing import make_router

    services = [start_service(tmp_path / name, num_blocks=512, max_running=1) for name in "ab"]
    long = SamplingParams(max_tokens=3000, ignore_eos=True)
    try:
        placed = []
        for service, tenants in zip(services, (("acme", "acme"), ("globex",))):
            for tenant in tenants:
                [request] = service.submit_nowait([service.tokenize(f"{tenant} asks a long question")], long,
                                                  Principal(tenant, "user", "test"), lambda event: None).result(30)
                placed.append(request.request_id)
        for service in services:  # until each replica's first request is past its prompt
            from kvctl.daemon.server.inflight import list_requests

            for _ in range(500):
                if list_requests(service)["requests"][0]["state"] == "decode":
                    break
                time.sleep(0.01)
        replicas = [Replica(f"replica-{i}", replica_client(f"/run/r{i}.sock",
                                                           transport=httpx.ASGITransport(app=unix_app(s))))
                    for i, s in enumerate(services)]
        router = create_router_app(RouterService(replicas, make_router("prefix"), view="ask"))

        async def calls(*steps):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://r") as client:
                return [await step(client) for step in steps]

        listed, by_id = asyncio.run(calls(
            lambda c: c.get("/admin/requests"),
            lambda c: c.post("/admin/cancel", json={"request_ids": [placed[2], "req-000000000000"]})))
        rows = listed.json()["requests"]
        assert sorted((r["request_id"], r["replica"], r["tenant"]) for r in rows) == sorted([
            (placed[0], "replica-0", "acme"), (placed[1], "replica-0", "acme"), (placed[2], "replica-1", "globex")])
        assert [r["age_seconds"] for r in rows] == sorted((r["age_seconds"] for r in rows), reverse=True)
        assert (listed.json()["running"], listed.json()["waiting"]) == (2, 1)
        status, shown = kvctl_shows(["requests"], listed.json())
        assert status == 0 and "2 running, 1 waiting" in shown and "#0: replica-0" in shown and "#1: replica-1" in shown
        [line] = [x for x in shown.splitlines() if x.startswith(placed[1])]
        assert line.split()[1:5] == ["#0", "acme", "completions", "waiting"]
        quiet = {"requests": [], "running": 0, "waiting": 0,
                 "replicas": [{"replica": "replica-0", "status": 200}, {"replica": "replica-1", "status": 200}]}
        assert kvctl_shows(["requests"], quiet)[1].strip() == "0 running, 0 waiting on 2 replicas"  # no legend

        body = by_id.json()
        assert [c["request_id"] for c in body["cancelled"]] == [placed[2]]
        assert body["not_found"] == ["req-000000000000"] and body["result"] == "ok"
        assert [(r["replica"], r["status"]) for r in body["replicas"]] == [("replica-0", 404), ("replica-1", 200)]
        status, shown = kvctl_shows(["cancel", placed[2], "req-000000000000"], body)
        assert status == 3 and shown.splitlines()[0].startswith(f"cancelled {placed[2]} (tenant globex, decode")
        assert "  replica-0: nothing of it" in shown and "not in flight: req-000000000000" in shown

        [by_tenant] = asyncio.run(calls(lambda c: c.post("/admin/cancel", json={"tenant": "acme"})))
        assert sorted(c["request_id"] for c in by_tenant.json()["cancelled"]) == sorted(placed[:2])
        for service in services:
            for _ in range(100):
                if blocks_all_back(service):
                    break
                time.sleep(0.02)
            assert blocks_all_back(service)
    finally:
        for service in services:
            service.shutdown(1)


def test_kvctl_requests_watch_redraws_the_table_until_stopped():
    from rich.console import Console

    from kvctl.requests_cmd import render_requests

    from .watch_frames import watch_frames

    def row(request_id, state):
        return {"request_id": request_id, "tenant": "acme", "api": "chat", "state": state, "age_seconds": 1.5,
                "queued_seconds": 0.1, "prompt_tokens": 120, "cached_tokens": 96, "restored_tokens": 0,
                "output_tokens": 7, "max_tokens": 64, "n": 1, "preemptions": 0, "blocks": 9, "priority": 0,
                "cohort": None, "shape": None}

    frames = [{"requests": [row("req-000000000001", "decode")], "running": 1, "waiting": 0},
              {"requests": [], "running": 0, "waiting": 0}]
    fetched, shown = watch_frames(frames, render_requests)
    assert fetched == 2 and shown.strip() == "0 running, 0 waiting"  # the latest picture
    first = Console(record=True, width=120)
    first.print(render_requests(frames[0]))
    lines = first.export_text().splitlines()
    assert lines[1].split() == ["req-000000000001", "acme", "chat", "decode", "1.50", "s", "120", "96", "7/64", "9"]
    assert lines[2] == "1 running, 0 waiting"
    shaped = Console(record=True, width=120)
    shaped.print(render_requests({"requests": [{**row("req-000000000002", "decode"), "shape": "tool_choice"}],
                                  "running": 1, "waiting": 0}))
    assert shaped.export_text().splitlines()[1].split()[:4] == ["req-000000000002", "acme", "chat:tool_choice",
                                                                "decode"]
    adapted = Console(record=True, width=120)
    adapted.print(render_requests({"requests": [{**row("req-000000000003", "decode"), "adapter": "sql"},
                                                row("req-000000000004", "prefill")], "running": 2, "waiting": 0}))
    lines = adapted.export_text().splitlines()
    assert lines[0].split()[:4] == ["request", "tenant", "adapter", "api"]
    assert lines[1].split()[:5] == ["req-000000000003", "acme", "sql", "chat", "decode"]
    assert lines[2].split()[:5] == ["req-000000000004", "acme", "-", "chat", "prefill"]
    assert lines[1].split()[-1] == "9"  # the counts stay in their columns
