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
        assert (waiting["tenant"], waiting["api"], waiting["state"], waiting["blocks"], waiting["reserved_blocks"]) == (
            "globex", "completions", "waiting", 0, 0)
        # reserving all of max_tokens (fraction:1), what it holds and what it reserves are its prompt and
        # its 3,000 tokens' blocks, whatever it has made so far
        assert running["blocks"] + running["reserved_blocks"] == -(-(running["prompt_tokens"] + 3000) // 16)
        assert running["reserved_blocks"] > 0
        assert waiting["output_tokens"] == 0 and waiting["queued_seconds"] == waiting["age_seconds"]
        assert set(running) == {"request_id", "tenant", "api", "state", "age_seconds", "queued_seconds",
                                "prompt_tokens", "cached_tokens", "restored_tokens", "output_tokens", "max_tokens",
                                "n", "preemptions", "blocks", "reserved_blocks", "fetching_prefix",
                                "waiting_for_lora_turn", "priority",
                                "cohort", "shape", "adapter", "drafted_tokens",
                                "kept_draft_tokens", "queue_position", "cached_prefix_tokens",
                                "passed_over", "queue_wait_left_seconds", "explicit_cache_tokens"}  # no tokens, no text
        assert running["explicit_cache_tokens"] is None  # (implicit prompt cache mode, as any request)
        # where the waiting one stands: first in line, the cache holding none of its prefix
        assert (running["queue_position"], waiting["queue_position"], waiting["cached_prefix_tokens"]) == (None, 1, 0)
        assert waiting["queue_wait_left_seconds"] is None  # no max_queue_wait here
        assert listed["queue_order"] == "fifo"
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
        assert line.split()[1:8] == ["#0", "acme", "completions", "waiting,", "1st", "in", "line"]
        assert listed.json()["queue_order"] == "fifo"  # every replica's
        assert "in line: the order kvd tries its waiting requests in (queue_order fifo: as they came), each " \
            "replica its own;" in " ".join(shown.split())
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
    reserving = Console(record=True, width=200)
    reserving.print(render_requests({"requests": [{**row("req-000000000005", "decode"), "reserved_blocks": 3}],
                                     "running": 1, "waiting": 0}))
    lines = reserving.export_text().splitlines()
    assert lines[1].split()[-1] == "9+3"  # held, and reserved for output not made yet
    assert lines[-1] == ("blocks: held+reserved: the blocks its tokens fill, and those its output reservation holds "
                         "for tokens not made yet (kvctl status says what the reservation leaves unwritten)")
    explicit = Console(record=True, width=200)  # explicit prompt cache mode: how far the cache may serve it
    explicit.print(render_requests({"requests": [{**row("req-000000000006", "decode"), "explicit_cache_tokens": 160},
                                                 {**row("req-000000000007", "decode"), "explicit_cache_tokens": 0}],
                                    "running": 2, "waiting": 0}))
    lines = explicit.export_text().splitlines()
    assert "decode, explicit: cached up to 160" in lines[1] and "decode, explicit: no mark, nothing cached" in lines[2]


@pytest.mark.parametrize("order", ["fifo", "lpm"])
def test_a_waiting_request_shows_its_place_in_line_and_what_the_cache_holds_of_it(tmp_path, order):
    """One slot, busy decoding a prompt of 40 tokens. B (a prompt nobody shares) queues, then C (the
    running prompt's first 32 tokens, then its own). `kvctl requests` shows where each stands in
    the order kvd will try them, and the tokens of each prefix the cache holds: under lpm C goes
    first, by what it holds; first come, first served B does."""
    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.server.calls import Principal
    from kvctl.daemon.server.inflight import list_requests

    service = start_service(tmp_path, num_blocks=256, max_running=1, block_size=16, queue_order=order,
                            max_queue_wait=600)
    long, once = SamplingParams(max_tokens=3000, ignore_eos=True), SamplingParams(max_tokens=1, ignore_eos=True)
    running = list(range(10, 50))
    try:
        def submit(prompt, params):
            [request] = service.submit_nowait([prompt], params, Principal("acme", "user", "test"),
                                              lambda event: None).result(30)
            return request.request_id

        first = submit(running, long)
        for _ in range(500):
            if list_requests(service)["requests"][0]["state"] == "decode":
                break
            time.sleep(0.01)
        b, c = submit(list(range(100, 140)), once), submit(running[:32] + [7, 8], once)
        listed = list_requests(service)
        rows = {row["request_id"]: row for row in listed["requests"]}
        assert listed["queue_order"] == order and (listed["running"], listed["waiting"]) == (1, 2)
        assert (rows[first]["queue_position"], rows[first]["cached_prefix_tokens"]) == (None, None)  # it runs
        expected = {b: (1, 0), c: (2, 32)} if order == "fifo" else {b: (2, 0), c: (1, 32)}
        assert {rid: (rows[rid]["queue_position"], rows[rid]["cached_prefix_tokens"]) for rid in (b, c)} == expected
        assert all(row["passed_over"] == 0 for row in rows.values())
        # seconds before max_queue_wait (600 s) turns each waiting one away; none for the running one
        assert rows[first]["queue_wait_left_seconds"] is None
        assert all(590 < rows[rid]["queue_wait_left_seconds"] <= 600 for rid in (b, c))
        status, shown = kvctl_shows(["requests"], listed)
        assert status == 0
        lines = {line.split()[0]: " ".join(line.split()) for line in shown.splitlines() if line.startswith("req-")}
        assert ("waiting, 1st in line" if order == "fifo" else "waiting, 2nd in line") in lines[b]
        assert ("waiting, 2nd in line" if order == "fifo" else "waiting, 1st in line") in lines[c]
        assert lines[c].split()[-3:] == ["(32)", "0/1", "0"]  # cached now, output, blocks
        assert " left " in lines[c] and " left " in lines[b]
        assert lines[b].split()[-3:] == ["(0)", "0/1", "0"]
        words = {"fifo": "queue_order fifo: as they came",
                 "lpm": "queue_order lpm: the most cached first, after any preempted or past lpm's patience"}[order]
        assert f"in line: the order kvd tries its waiting requests in ({words}); (cached): the tokens" in \
            " ".join(shown.split())
    finally:
        service.shutdown(1)


def test_kvctl_requests_says_how_often_a_waiting_request_was_passed_over():
    from rich.console import Console

    from kvctl.requests_cmd import ordinal, render_requests

    row = {"request_id": "req-000000000009", "tenant": "acme", "api": "chat", "state": "waiting",
           "age_seconds": 12.0, "queued_seconds": 12.0, "prompt_tokens": 2048, "cached_tokens": 0,
           "restored_tokens": 0, "output_tokens": 0, "max_tokens": 64, "n": 1, "preemptions": 0, "blocks": 0,
           "priority": 0, "cohort": None, "shape": None, "queue_position": 13, "cached_prefix_tokens": 0,
           "passed_over": 1204, "queue_wait_left_seconds": 17.5}
    console = Console(record=True, width=160)
    console.print(render_requests({"requests": [row], "running": 0, "waiting": 1, "queue_order": "lpm"}))
    line = console.export_text().splitlines()[1]
    assert " ".join(line.split()[1:]) == ("acme chat waiting, 13th in line, passed by 1,204, 17.50 s left 12.00 s "
                                          "2,048 (0) 0/64 0")
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111, 1002)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th", "1,002nd"]


def test_the_router_says_the_queue_order_only_when_every_replica_listed_has_the_same():
    from kvctl.daemon.server.fleet_admin import merge_request_lists

    def listing(order):
        return 200, {"requests": [], "running": 0, "waiting": 0, **({"queue_order": order} if order else {})}

    names = ["replica-0", "replica-1", "replica-2"]
    same = merge_request_lists(names, [listing("lpm"), listing("lpm"), (None, {"error": "refused"})])[1]
    assert same["queue_order"] == "lpm" and same["message"] == "not listed: replica-2 (refused)"
    assert "queue_order" not in merge_request_lists(names, [listing("lpm"), listing("fifo"), listing("lpm")])[1]
    assert "queue_order" not in merge_request_lists(names, [listing("lpm"), listing(None), listing("lpm")])[1]
