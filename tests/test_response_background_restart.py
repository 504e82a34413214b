"""A background response and kvd's stops: with `responses_store_file`, one running when kvd stopped
without ending it (a crash, a kill) is not forgotten: served again at the next start
(test_response_serve_again.py), or kept `failed` where the file has no request of it, and its
tenant's webhook says so; an end's webhook is told once the file has the end, and told again at
a start where its event was not written down; without the file, one kvd's own stop cancels ends
`failed`, not `cancelled` as if its client had asked."""

from __future__ import annotations

import asyncio
import logging
import sqlite3

import pytest

pytest.importorskip("fastapi")

from kvctl.daemon.server.background_file import Untold  # noqa: E402
from kvctl.daemon.server.response_file import ResponseFile  # noqa: E402
from kvctl.daemon.server.response_store import CUT_SHORT, ResponseStore  # noqa: E402

from .test_response_background import gated  # noqa: E402,F401
from .test_webhooks import ACME_SECRET, Receiver, hooks_file, until  # noqa: E402

QUESTION = {"role": "user", "content": "What is a paged KV cache?"}
ITEM = {"id": "msg_1", "type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "What is a paged KV cache?"}]}


class Running:
    """A background response as response_runs.Run shows it to the store: its tenant, and itself now."""

    def __init__(self, tenant: str, response_id: str) -> None:
        self.tenant, self.events = tenant, None
        self.response = {"id": response_id, "object": "response", "status": "queued", "background": True,
                         "output": [], "error": None, "created_at": 1_796_000_000}

    def now(self) -> dict:
        return self.response


def background_rows(path) -> tuple[list[str], list[tuple]]:
    with sqlite3.connect(path) as db:
        return ([row[0] for row in db.execute("SELECT id FROM background_running")],
                list(db.execute("SELECT id, tenant, event_type FROM background_untold")))


def killed(store: ResponseStore) -> None:
    """kvd ends here without its stop: what was written stays, nothing more is written."""
    store.file.flush()
    store.file.queue.put(None)
    store.file.thread.join()
    store.file.db.close()


def test_one_running_when_kvd_was_killed_is_kept_failed_at_the_next_start_and_told_once(tmp_path, caplog):
    path = tmp_path / "responses.sqlite"
    store = ResponseStore(2**20, ResponseFile(path))
    run = Running("acme", "resp_cut")
    store.begin("resp_cut", run, [QUESTION], [ITEM])
    killed(store)
    assert background_rows(path) == (["resp_cut"], [])

    told = []
    with caplog.at_level(logging.WARNING, logger="kvd"):
        again = ResponseStore(2**20, ResponseFile(path))
    assert "1 background responses were running when kvd last stopped without ending them" in caplog.text
    kept = again.get("acme", "resp_cut")
    assert kept.response == {**run.response, "status": "failed", "error": CUT_SHORT}
    assert CUT_SHORT["message"].startswith("kvd stopped before it ended, without ending it (a crash, a kill")
    assert (kept.conversation, kept.inputs) == ((QUESTION,), (ITEM,))  # continued and listed as it would have been
    assert again.get("globex", "resp_cut") is None
    assert again.untold == [Untold("acme", "response.failed", "resp_cut")]
    assert again.tell_untold(lambda *end: told.append(end) or True) == 1
    assert told == [("acme", "response.failed", "resp_cut")]
    again.close()
    assert background_rows(path) == ([], [])

    third = ResponseStore(2**20, ResponseFile(path))
    assert third.get("acme", "resp_cut").response["status"] == "failed" and third.untold == []
    third.close()


def test_an_end_is_told_once_the_file_has_it_and_again_at_a_start_where_its_event_was_not_written(tmp_path):
    path = tmp_path / "responses.sqlite"
    store = ResponseStore(2**20, ResponseFile(path))
    seen = []

    def could_not_write(tenant, event_type, response_id):  # (a full disk: webhooks.Webhooks.told says False)
        seen.append((event_type, response_id, background_rows(path)))
        return False

    store.tell = could_not_write
    run = Running("acme", "resp_done")
    store.begin("resp_done", run, [QUESTION], [ITEM])
    store.put("acme", {**run.response, "status": "completed"}, [QUESTION], [ITEM])
    store.ended("resp_done", run, "response.completed")
    store.file.flush()
    # told after the end was written: no longer running, its end noted as not yet told
    assert seen == [("response.completed", "resp_done", ([], [("resp_done", "acme", "response.completed")]))]
    store.close()

    told = []
    again = ResponseStore(2**20, ResponseFile(path))
    assert again.get("acme", "resp_done").response["status"] == "completed"
    assert again.tell_untold(lambda *end: told.append(end) or True) == 1
    assert told == [("acme", "response.completed", "resp_done")]
    again.close()
    assert background_rows(path) == ([], [])
    third = ResponseStore(2**20, ResponseFile(path))
    assert third.untold == []
    third.close()


def test_without_a_file_an_end_is_told_at_once_and_one_not_told_by_an_event_is_not(tmp_path):
    store = ResponseStore(2**20)
    told = []
    store.tell = lambda *end: told.append(end) or True
    run = Running("acme", "resp_x")
    store.begin("resp_x", run)
    store.ended("resp_x", run, "response.cancelled")
    other = Running("acme", "resp_y")
    store.begin("resp_y", other)
    store.ended("resp_y", other, None)
    assert told == [("acme", "response.cancelled", "resp_x")] and store.runs == {}


def copy_of(path, to):
    """The file as it stands now (as a kill would leave it), beside it."""
    with sqlite3.connect(path) as source, sqlite3.connect(to) as copy:
        source.backup(copy)
    return to


def acme_running(tmp_path, state, gated, tokens: int, file: bool = True, **settings):
    """A kvd (state folder `state`, its responses file in it unless `file` is false) telling acme's
    endpoint, whose model writes `tokens` A's, holding at the third until the test opens `gated`'s
    gate: (service, its TCP app, and `started(acme)`, which makes acme's background response and
    waits for its first output: its id)."""
    from .daemon_fixtures import apps, start_service, token_table

    hooks = hooks_file(tmp_path, f"acme https://acme.example/hooks {ACME_SECRET}\n")
    service = start_service(state, webhooks_file=str(hooks),
                            responses_store_file=str(state / "responses.sqlite") if file else None, **settings)
    gated["script"][:] = service.loaded.tokenizer.encode("A", add_special_tokens=False) * tokens
    gated["hold"] = 2

    async def started(acme) -> str:
        made = await acme.responses.create(model="kvd-demo-llama-v1", input="Hi", max_output_tokens=tokens,
                                           background=True)
        while (await acme.responses.retrieve(made.id)).status != "in_progress":
            await asyncio.sleep(0.02)
        return made.id

    return service, apps(service, token_table(tmp_path))[1], started


def test_kvd_started_after_a_kill_serves_the_response_again_and_its_webhook_is_told_its_end(tmp_path, gated):
    from .daemon_fixtures import USER_TOKEN, apps, start_service, token_table
    from .test_responses_api import client_for

    first = tmp_path / "first"
    first.mkdir()
    service, tcp, started = acme_running(tmp_path, first, gated, 200)
    try:
        async def go():
            made = await started(client_for(tcp, USER_TOKEN))
            service.responses.file.flush()
            copy_of(first / "responses.sqlite", later / "responses.sqlite")  # killed here, mid-reply
            gated["gate"].set()
            return made

        later = tmp_path / "later"
        later.mkdir()
        made = asyncio.run(go())
    finally:
        gated["gate"].set()
        service.shutdown(1)

    from kvctl.daemon.server import serve_again

    hooks = tmp_path / "webhooks.txt"
    gated["script"][:] = gated["script"][:4]  # (served again, it writes four A's)
    for life in range(2):  # the next start serves it again; the one after keeps it so and tells nothing again
        service = start_service(later, webhooks_file=str(hooks), responses_store_file=str(later / "responses.sqlite"))
        receiver = Receiver()
        service.webhooks.transport = receiver.transport
        try:
            unix, tcp = apps(service, token_table(tmp_path))

            async def after():
                acme = client_for(tcp, USER_TOKEN)
                await asyncio.gather(*serve_again.start(service, unix))
                while (await acme.responses.retrieve(made)).status in ("queued", "in_progress"):
                    await asyncio.sleep(0.02)
                service.webhooks.start()
                await until(lambda: not service.webhooks.pending)
                await asyncio.sleep(0.05)
                items = await acme.responses.input_items.list(made)
                return await acme.responses.retrieve(made), [item.content[0].text for item in items.data]

            kept, inputs = asyncio.run(after())
            assert (kept.status, kept.background, kept.output_text) == ("completed", True, "AAAA")
            assert inputs == ["Hi"]
            assert [(event.type, event.data.id) for event in receiver.events()] == (
                [] if life else [("response.completed", made)])
        finally:
            service.shutdown(1)


def test_without_a_file_one_kvd_s_stop_cancels_past_its_deadline_ends_failed_not_cancelled(tmp_path, gated):
    from .daemon_fixtures import USER_TOKEN
    from .test_responses_api import client_for

    service, tcp, started = acme_running(tmp_path, tmp_path, gated, 4000, file=False, num_blocks=512)

    async def go():
        made = await started(client_for(tcp, USER_TOKEN))
        run = service.responses.running("acme", made)
        gated["gate"].set()
        await asyncio.get_running_loop().run_in_executor(None, service.shutdown, 0.2)  # its 4,000 tokens outlast it
        await asyncio.wait({run.task})
        return made, run.final

    made, final = asyncio.run(go())
    assert (final["status"], final["error"]) == (
        "failed", {"code": "server_error", "message": "kvd stopped serving it before it ended"})
    assert final["output"][0]["status"] == "incomplete"
    # its webhook says so (written down before kvd's stop ended, delivered at the next start)
    assert [path.name for path in (tmp_path / "webhooks").iterdir()] == [
        service.webhooks.event_id("acme", "response.failed", made) + ".json"]
