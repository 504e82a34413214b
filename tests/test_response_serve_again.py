"""Background responses kvd's stop cut short are served again from the start at the next start,
under the same id and as their caller's, once at most (serve_again.py); one cut short again, one
refused when served again, and one written down by a kvd that kept no request end `failed`."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from kvctl.daemon.server.background_file import Cut  # noqa: E402
from kvctl.daemon.server.response_file import ResponseFile  # noqa: E402
from kvctl.daemon.server.response_store import CUT_SHORT, CUT_SHORT_AGAIN, ResponseStore  # noqa: E402

from .test_response_background import gated  # noqa: E402,F401
from .test_response_background_restart import (ITEM, QUESTION, Running, acme_running, background_rows,  # noqa: E402
                                               killed)
from .test_webhooks import Receiver, until  # noqa: E402

ASKED = {"model": "kvd-demo-llama-v1", "input": "Hi", "background": True, "max_output_tokens": 5}


def test_one_written_down_with_its_request_is_served_again_and_one_served_again_before_is_kept_failed(
        tmp_path, caplog):
    path = tmp_path / "responses.sqlite"
    store = ResponseStore(2**20, ResponseFile(path))
    first, second = Running("acme", "resp_first"), Running("acme", "resp_second")
    store.begin("resp_first", first, [QUESTION], [ITEM], ASKED, "user", 0)
    store.begin("resp_second", second, [QUESTION], [ITEM], ASKED, "user", 1)  # (served again once already)
    killed(store)

    with caplog.at_level(logging.WARNING, logger="kvd"):
        again = ResponseStore(2**20, ResponseFile(path))
    assert ("2 background responses were running when kvd last stopped without ending them: 1 served again from "
            "the start; 1 kept failed") in caplog.text
    assert again.take_again() == [Cut("acme", first.response, [QUESTION], [ITEM], ASKED, "user", 0)]
    assert again.take_again() == []  # (each taken once)
    assert again.get("acme", "resp_first") is None  # (not failed: it runs again)
    assert again.get("acme", "resp_second").response == {**second.response, "status": "failed",
                                                         "error": CUT_SHORT_AGAIN}
    assert [(end.event_type, end.response_id) for end in again.untold] == [("response.failed", "resp_second")]
    again.close()
    assert background_rows(path)[0] == ["resp_first"]  # still written down until it ends


def test_a_file_a_kvd_wrote_before_requests_were_kept_is_read_and_its_cut_responses_kept_failed(tmp_path):
    path = tmp_path / "responses.sqlite"
    with sqlite3.connect(path) as db:  # (the background table as kvd wrote it before)
        db.execute("CREATE TABLE background_running (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, response TEXT NOT "
                   "NULL, conversation TEXT NOT NULL, inputs TEXT NOT NULL)")
        db.execute("INSERT INTO background_running VALUES (?, ?, ?, ?, ?)",
                   ("resp_old", "acme", json.dumps(Running("acme", "resp_old").response), "[]", "[]"))
    store = ResponseStore(2**20, ResponseFile(path))
    assert store.take_again() == []
    assert store.get("acme", "resp_old").response["error"] == CUT_SHORT
    store.close()
    with sqlite3.connect(path) as db:
        assert [row[1] for row in db.execute("PRAGMA table_info(background_running)")][-3:] == [
            "request", "role", "attempts"]


def restarted(tmp_path, state, gated, hooks):  # noqa: F811
    """kvd started again on `state` (its responses file and webhooks as before), with a receiver of
    its webhooks: (service, unix app, TCP app, receiver)."""
    from .daemon_fixtures import apps, start_service, token_table

    service = start_service(state, webhooks_file=str(hooks), responses_store_file=str(state / "responses.sqlite"),
                            num_blocks=512)
    receiver = Receiver()
    service.webhooks.transport = receiver.transport
    unix, tcp = apps(service, token_table(tmp_path))
    return service, unix, tcp, receiver


def stopped_while_it_ran(tmp_path, gated) -> str:  # noqa: F811
    """acme's background response of 4,000 tokens, running when kvd's stop's deadline passes: its id."""
    from .daemon_fixtures import USER_TOKEN
    from .test_responses_api import client_for

    service, tcp, started = acme_running(tmp_path, tmp_path, gated, 4000, num_blocks=512)

    async def go():
        made = await started(client_for(tcp, USER_TOKEN))
        run = service.responses.running("acme", made)
        gated["gate"].set()
        await asyncio.get_running_loop().run_in_executor(None, service.shutdown, 0.2)
        await asyncio.wait({run.task})
        return made, run.final

    made, final = asyncio.run(go())
    assert final["status"] == "queued"  # not failed: set aside for the next start
    assert background_rows(tmp_path / "responses.sqlite") == ([made], [])
    with sqlite3.connect(tmp_path / "responses.sqlite") as db:
        [(request, role, attempts)] = db.execute("SELECT request, role, attempts FROM background_running")
    assert (json.loads(request)["input"], json.loads(request)["background"], role, attempts) == ("Hi", True, "user", 0)
    assert not (tmp_path / "webhooks").exists() or list((tmp_path / "webhooks").iterdir()) == []  # nothing told
    return made


def test_a_background_response_kvd_s_stop_cut_short_is_served_again_at_the_next_start_under_its_id(
        tmp_path, gated):  # noqa: F811
    from kvctl.daemon.server import serve_again

    from .daemon_fixtures import GLOBEX_TOKEN, USER_TOKEN
    from .test_responses_api import client_for

    made = stopped_while_it_ran(tmp_path, gated)
    gated["script"][:] = gated["script"][:5]  # (served again, it writes five tokens)
    service, unix, tcp, receiver = restarted(tmp_path, tmp_path, gated, tmp_path / "webhooks.txt")
    try:
        async def go():
            acme = client_for(tcp, USER_TOKEN)
            tasks = serve_again.start(service, unix)
            before = await acme.responses.retrieve(made)  # waiting to be served again
            await asyncio.gather(*tasks)
            while (now := await acme.responses.retrieve(made)).status in ("queued", "in_progress"):
                await asyncio.sleep(0.02)
            service.webhooks.start()
            await until(lambda: receiver.events())
            try:
                await client_for(tcp, GLOBEX_TOKEN).responses.retrieve(made)
            except Exception as exc:  # noqa: BLE001
                return before, now, exc.status_code
            return before, now, 200

        before, now, globex = asyncio.run(go())
        assert globex == 404  # (served again as acme's)
        assert (before.id, before.status) == (made, "queued")
        assert (now.id, now.status, now.output_text, now.created_at) == (made, "completed", "AAAAA",
                                                                          before.created_at)
        assert [(event.type, event.data.id) for event in receiver.events()] == [("response.completed", made)]
        assert background_rows(tmp_path / "responses.sqlite")[0] == []
        from .daemon_fixtures import call
        assert "kvd_responses_served_again_total 1.0" in call(unix, "GET", "/metrics").text
        kept = service.responses.get("acme", made)
        assert [item["content"][0]["text"] for item in kept.inputs] == ["Hi"]
    finally:
        service.shutdown(1)


def test_one_cut_short_again_when_served_again_ends_failed_and_one_refused_then_says_why(tmp_path, gated):  # noqa: F811
    from kvctl.daemon.server import serve_again

    from .daemon_fixtures import USER_TOKEN
    from .test_responses_api import client_for

    made = stopped_while_it_ran(tmp_path, gated)
    service, unix, tcp, receiver = restarted(tmp_path, tmp_path, gated, tmp_path / "webhooks.txt")

    async def cut_again():
        acme = client_for(tcp, USER_TOKEN)
        await asyncio.gather(*serve_again.start(service, unix))
        while (await acme.responses.retrieve(made)).status != "in_progress":
            await asyncio.sleep(0.02)
        run = service.responses.running("acme", made)
        await asyncio.get_running_loop().run_in_executor(None, service.shutdown, 0.2)
        await asyncio.wait({run.task})
        return run.final

    final = asyncio.run(cut_again())
    assert (final["status"], final["error"]["message"]) == ("failed", "kvd stopped serving it before it ended")
    assert background_rows(tmp_path / "responses.sqlite") == ([], [])  # struck off, its end told:
    assert [path.name for path in (tmp_path / "webhooks").iterdir()] == [
        service.webhooks.event_id("acme", "response.failed", made) + ".json"]

    second = tmp_path / "second"
    second.mkdir()
    made = stopped_while_it_ran(second, gated)
    with sqlite3.connect(second / "responses.sqlite") as db:  # its LoRA adapter, say, is not served any more
        db.execute("UPDATE background_running SET request = json_set(request, '$.model', 'gone-adapter')")
    service, unix, tcp, receiver = restarted(tmp_path, second, gated, second / "webhooks.txt")
    try:
        async def refused():
            await asyncio.gather(*serve_again.start(service, unix))
            service.webhooks.start()
            await until(lambda: receiver.events())
            return await client_for(tcp, USER_TOKEN).responses.retrieve(made)

        kept = asyncio.run(refused())
        assert (kept.status, kept.error.code) == ("failed", "model_not_found")
        assert kept.error.message.startswith("kvd's stop cut it short, and served again it was refused (404): ")
        assert "gone-adapter" in kept.error.message
        assert [(event.type, event.data.id) for event in receiver.events()] == [("response.failed", made)]
    finally:
        service.shutdown(1)


def test_one_waiting_to_be_served_again_is_queued_and_can_be_cancelled(tmp_path, gated):  # noqa: F811
    from kvctl.daemon.server import serve_again

    from .daemon_fixtures import USER_TOKEN
    from .test_responses_api import client_for

    made = stopped_while_it_ran(tmp_path, gated)
    service, unix, tcp, receiver = restarted(tmp_path, tmp_path, gated, tmp_path / "webhooks.txt")
    service.draining = True  # (kvctl drain: it takes no new request, so the response waits)
    try:
        async def go():
            acme = client_for(tcp, USER_TOKEN)
            tasks = serve_again.start(service, unix)
            await asyncio.sleep(0.1)
            waiting = await acme.responses.retrieve(made)
            cancelled = await acme.responses.cancel(made)
            await asyncio.gather(*tasks)
            service.webhooks.start()
            await until(lambda: receiver.events())
            return waiting, cancelled, await acme.responses.retrieve(made)

        waiting, cancelled, kept = asyncio.run(go())
        assert (waiting.status, cancelled.status, kept.status) == ("queued", "cancelled", "cancelled")
        assert [(event.type, event.data.id) for event in receiver.events()] == [("response.cancelled", made)]
        assert background_rows(tmp_path / "responses.sqlite")[0] == []
    finally:
        service.shutdown(1)
