"""What /v1/files may keep: `files_store_bytes` for every tenant's files together,
`tenant_files_bytes` for one tenant's, `max_file_bytes` for one upload. An upload past a budget
is refused whole (nothing kept, nothing removed for room); a batch's output is always written; an
operator sees each tenant's take (`kvctl files`) and deletes a file, audited."""

from __future__ import annotations

import asyncio
import io
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from kvctl.daemon.server.batch_files import FileBudgets, FileError, FileStore  # noqa: E402

from .daemon_fixtures import (ADMIN_TOKEN, GLOBEX_TOKEN, USER_TOKEN, apps, assert_admin_only, call,  # noqa: E402
                              start_service, token_table)
from .test_batches_api import CHAT, SYSTEMS, chat_line, jsonl, left_in_progress, until_ended  # noqa: E402
from .test_responses_api import client_for  # noqa: E402

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def store(tmp_path, store_bytes: int, tenants=()) -> FileStore:
    return FileStore(tmp_path / "files", clock=lambda: 1_000.0, budgets=lambda: FileBudgets(store_bytes, tenants))


def kept_on_disk(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "files").glob("*")) if (tmp_path / "files").exists() else []


# ---- the store's budgets ---------------------------------------------------------------------
def test_an_upload_past_its_tenant_s_budget_is_refused_whole_and_the_others_still_upload(tmp_path):
    files = store(tmp_path, 10_000, (("acme", 100), ("*", 300)))
    first = files.add("acme", "a.jsonl", "batch", b"x" * 60)
    with pytest.raises(FileError) as refused:
        files.add("acme", "b.jsonl", "batch", b"y" * 41)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "file", "files_budget_exceeded")
    assert str(refused.value) == (
        "file: 41 bytes more would take tenant acme's files to 101 bytes, over its tenant_files_bytes (100 bytes); "
        "delete files no longer needed (DELETE /v1/files/ID), or ask kvd's operator for more room")
    assert kept_on_disk(tmp_path) == sorted([f"{first.id}.data", f"{first.id}.json"])  # nothing of the refused
    assert files.held("acme") == 60 and files.refused == {"tenant": 1}
    files.add("acme", "c.jsonl", "batch", b"z" * 40)  # up to the budget exactly
    # a tenant tenant_files_bytes does not name has the budget of *
    files.add("globex", "g.jsonl", "batch", b"g" * 300)
    with pytest.raises(FileError, match="tenant globex's files to 301 bytes, over its tenant_files_bytes \\(300"):
        files.add("globex", "h.jsonl", "batch", b"h")
    assert files.tenants() == {"acme": {"files": 2, "bytes": 100, "budget": 100},
                               "globex": {"files": 1, "bytes": 300, "budget": 300}}


def test_past_files_store_bytes_an_upload_is_a_507_that_does_not_say_what_others_keep(tmp_path):
    files = store(tmp_path, 100)
    files.add("acme", "a.jsonl", "batch", b"a" * 90)
    with pytest.raises(FileError) as refused:
        files.add("globex", "g.jsonl", "batch", b"g" * 11)
    assert (refused.value.status, refused.value.code) == (507, "file_storage_full")
    assert str(refused.value) == (
        "file: kvd's store of files has no room for 11 bytes more (files_store_bytes); delete files no longer needed "
        "(DELETE /v1/files/ID), or ask kvd's operator for more room")
    assert files.refused == {"store": 1} and files.held() == 90
    assert files.add("globex", "g.jsonl", "batch", b"g" * 10).bytes == 10


def test_what_kvd_writes_is_kept_past_any_budget_and_then_no_batch_starts(tmp_path):
    files = store(tmp_path, 1_000, (("acme", 50),))
    files.add("acme", "in.jsonl", "batch", b"i" * 40)
    output = files.add("acme", "batch_x_output.jsonl", "batch_output", b"o" * 500)
    assert output.bytes == 500 and files.held("acme") == 540
    refusal = files.no_room_for_output("acme")
    assert (refusal.status, refusal.param) == (400, "input_file_id") and str(refusal) == (
        "input_file_id: tenant acme's files take 540 bytes, its tenant_files_bytes (50 bytes): a batch's output "
        "would have no room; delete files no longer needed (DELETE /v1/files/ID), or ask kvd's operator for more room")
    assert files.no_room_for_output("globex") is None
    files.add("globex", "out.jsonl", "batch_output", b"o" * 460)
    assert files.no_room_for_output("globex").status == 507
    files.delete("acme", output.id)
    assert files.no_room_for_output("acme") is None


def test_an_upload_is_copied_from_its_file_and_counted_while_it_is_written(tmp_path):
    files = store(tmp_path, 150)
    source = io.BytesIO(b"first\n" * 20)
    source.read(7)  # (wherever the form left it: copied from its start)
    stored = files.add("acme", "in.jsonl", "batch", source)
    assert stored.bytes == 120 and files.content("acme", stored.id) == b"first\n" * 20

    class Slow(io.BytesIO):
        """A file whose copy waits until told: an upload being written."""
        def __init__(self, data):
            super().__init__(data)
            self.reading, self.go_on = threading.Event(), threading.Event()

        def read(self, *args):
            self.reading.set()
            self.go_on.wait(5)
            return super().read(*args)

    slow = Slow(b"s" * 20)
    writer = threading.Thread(target=files.add, args=("globex", "s.jsonl", "batch", slow))
    writer.start()
    assert slow.reading.wait(5)
    assert files.held() == 140 and files.held("globex") == 20  # its bytes are taken before it is written
    with pytest.raises(FileError, match="no room for 11 bytes"):
        files.add("acme", "more.jsonl", "batch", b"m" * 11)
    slow.go_on.set()
    writer.join(5)
    assert files.held() == 140 and files.reserved == {}


def test_a_file_replaced_by_its_id_is_counted_once(tmp_path):
    files = store(tmp_path, 1_000)
    files.add("acme", "out.jsonl", "batch_output", b"a" * 100, file_id="file-out0")
    files.add("acme", "out.jsonl", "batch_output", b"b" * 30, file_id="file-out0")
    assert files.held("acme") == 30 and files.tenants()["acme"]["files"] == 1


# ---- through kvd ---------------------------------------------------------------------------------
@pytest.fixture
def budgeted(tmp_path):
    """A kvd whose files take 4 KiB at most, 2 KiB of them acme's; uploads 1 MiB at most:
    (service, unix app, tcp app)."""
    service = start_service(tmp_path, files_store_bytes="4KiB", tenant_files_bytes="acme=2KiB",
                            max_file_bytes="1MiB", max_request_bytes="64KiB")
    try:
        yield (service, *apps(service, token_table(tmp_path)))
    finally:
        service.shutdown(1)


def test_through_openai_s_client_a_tenant_uploads_up_to_its_budget_and_gets_a_400_past_it(budgeted):
    import openai

    service, _, tcp = budgeted
    line = jsonl([chat_line("q", SYSTEMS[0], "Hi?")])

    async def go():
        acme = client_for(tcp, USER_TOKEN)
        kept = [await acme.files.create(file=(f"in{i}.jsonl", line), purpose="batch")
                for i in range(2048 // len(line))]
        try:
            await acme.files.create(file=("more.jsonl", line), purpose="batch")
        except openai.BadRequestError as exc:
            refused = exc
        listed = await acme.files.list()
        globex = client_for(tcp, GLOBEX_TOKEN)
        theirs = await globex.files.create(file=("g.jsonl", line), purpose="batch")
        await acme.files.delete(kept[0].id)
        again = await acme.files.create(file=("more.jsonl", line), purpose="batch")
        return kept, refused, listed, theirs, again

    kept, refused, listed, theirs, again = asyncio.run(go())
    held = len(kept) * len(line)
    assert refused.status_code == 400 and refused.body["code"] == "files_budget_exceeded"
    assert refused.body["message"] == (
        f"file: {len(line)} bytes more would take tenant acme's files to {held + len(line):,} bytes, over its "
        "tenant_files_bytes (2,048 bytes); delete files no longer needed (DELETE /v1/files/ID), or ask kvd's "
        "operator for more room")
    assert sorted(f.id for f in listed.data) == sorted(f.id for f in kept)  # the refused one is nowhere
    assert theirs.bytes == len(line) and again.bytes == len(line)
    assert service.files.held("acme") == held


def test_an_upload_over_max_file_bytes_is_a_413_naming_it_and_one_over_max_request_bytes_is_taken(budgeted):
    service, unix, _ = budgeted
    big = b"x" * (100 * 1024)  # over max_request_bytes (64 KiB), under max_file_bytes
    too_big = b"x" * (1024 * 1024 + 1)
    service.files.budgets = lambda: FileBudgets(2**30)  # (room for both: only the body caps count here)
    kept = call(unix, "POST", "/v1/files", files={"file": ("big.jsonl", big)}, data={"purpose": "batch"})
    assert kept.status_code == 200 and kept.json()["bytes"] == len(big)
    refused = call(unix, "POST", "/v1/files", files={"file": ("huge.jsonl", too_big)}, data={"purpose": "batch"})
    assert refused.status_code == 413
    message = refused.json()["error"]["message"]
    assert message.startswith("body: ") and message.endswith(
        " bytes is over max_file_bytes (1,048,576); upload a smaller file (a batch's input in parts)")
    other = call(unix, "POST", "/v1/completions", json={"prompt": "x" * (65 * 1024), "max_tokens": 1})
    assert other.status_code == 413 and "over max_request_bytes (65,536); send less per request" in \
        other.json()["error"]["message"]
    assert [f.bytes for f in service.files.listed(None)] == [len(big)]


def test_a_reload_changes_the_budgets_live_and_lowering_one_removes_nothing(budgeted):
    from dataclasses import replace

    service, unix, _ = budgeted
    line = jsonl([chat_line("q", SYSTEMS[0], "Hi?")])
    upload = {"files": {"file": ("in.jsonl", line)}, "data": {"purpose": "batch"}}
    first = call(unix, "POST", "/v1/files", **upload)  # (the unix socket's tenant: default, bound by 4 KiB)
    assert first.status_code == 200
    result = service.reload(replace(service.config, files_store_bytes=len(line),
                                    tenant_files_bytes=(("default", 10 * len(line)),)))
    assert {"files_store_bytes", "tenant_files_bytes"} <= set(result["changed"])
    refused = call(unix, "POST", "/v1/files", **upload)
    assert refused.status_code == 507 and refused.json()["error"]["code"] == "file_storage_full"
    assert [f.id for f in service.files.listed(None)] == [first.json()["id"]]
    service.reload(replace(service.config, files_store_bytes=2**20))
    assert call(unix, "POST", "/v1/files", **upload).status_code == 200


def test_a_batch_is_not_started_once_its_tenant_s_files_fill_its_budget_and_one_started_keeps_its_output(budgeted):
    import openai

    service, _, tcp = budgeted
    lines = [chat_line(f"q{i}", SYSTEMS[0], f"Question {i}?", max_tokens=40, ignore_eos=True) for i in range(3)]
    content = jsonl(lines)

    async def go():
        acme = client_for(tcp, USER_TOKEN)
        uploaded = await acme.files.create(file=("in.jsonl", content), purpose="batch")
        done = await until_ended(acme, (await acme.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                                                 completion_window="24h")).id)
        try:
            await acme.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        except openai.BadRequestError as exc:
            return uploaded, done, exc

    uploaded, done, refused = asyncio.run(go())
    output = service.files.get("acme", done.output_file_id)
    assert done.status == "completed" and done.request_counts.completed == 3
    assert uploaded.bytes + output.bytes > 2048  # its output took acme past its budget, and was kept whole
    assert refused.body["message"] == (
        f"input_file_id: tenant acme's files take {uploaded.bytes + output.bytes:,} bytes, its tenant_files_bytes "
        "(2,048 bytes): a batch's output would have no room; delete files no longer needed (DELETE /v1/files/ID), "
        "or ask kvd's operator for more room")
    assert [b.id for b in service.batches.listed("acme")] == [done.id]


def shown(answer: dict, now: float) -> str:
    """`kvctl files` as it draws /admin/files' answer, its words on one line."""
    from rich.console import Console

    from kvctl.files_cmd import files_view

    console = Console(record=True, width=250)
    console.print(files_view(answer, now))
    return " ".join(console.export_text().split())


def test_an_operator_sees_each_tenant_s_files_and_budget_and_deletes_one_audited(budgeted):
    service, _, tcp = budgeted
    line = jsonl([chat_line("q", SYSTEMS[0], "Hi?")])

    async def go():
        acme, globex = client_for(tcp, USER_TOKEN), client_for(tcp, GLOBEX_TOKEN)
        mine = await acme.files.create(file=("in\x1b[31m.jsonl", line), purpose="batch",
                                       expires_after={"anchor": "created_at", "seconds": 7200})
        theirs = await globex.files.create(file=("g.jsonl", line), purpose="batch")
        return mine, theirs

    mine, theirs = asyncio.run(go())
    seen = call(tcp, "GET", "/admin/files", headers=ADMIN).json()
    assert sorted((f["id"], f["tenant"]) for f in seen["files"]) == sorted([(mine.id, "acme"), (theirs.id, "globex")])
    assert seen["tenants"] == {"acme": {"files": 1, "bytes": len(line), "budget": 2048},
                               "globex": {"files": 1, "bytes": len(line), "budget": None}}
    assert (seen["bytes"], seen["store_bytes"], seen["max_file_bytes"]) == (2 * len(line), 4096, 2**20)
    assert f"tenant acme: 1 files, {len(line)} B of 2.0 KiB (tenant_files_bytes) tenant globex: 1 files, " \
           f"{len(line)} B of files_store_bytes {2 * len(line)} B of 4.0 KiB kept" in shown(seen, mine.created_at)
    only = call(tcp, "GET", "/admin/files?tenant=acme", headers=ADMIN).json()
    assert [f["id"] for f in only["files"]] == [mine.id]
    drawn = shown(only, now=mine.created_at + 60)
    assert drawn == (
        f"{mine.id} batch {len(line)} B (tenant acme, made 1m ago, expires in 1h 59m) in?[31m.jsonl "
        f"tenant acme: 1 files, {len(line)} B of 2.0 KiB (tenant_files_bytes) "
        f"{2 * len(line)} B of 4.0 KiB kept (files_store_bytes); uploads up to 1.0 MiB (max_file_bytes); since kvd "
        "started 0 refused past a tenant's budget, 0 past files_store_bytes")
    assert_admin_only(tcp, "GET", "/admin/files")
    assert_admin_only(tcp, "DELETE", f"/admin/files/{theirs.id}")
    gone = call(tcp, "DELETE", f"/admin/files/{theirs.id}", headers=ADMIN)
    assert gone.status_code == 200 and gone.json() == {"id": theirs.id, "object": "file", "deleted": True,
                                                       "tenant": "globex", "bytes": len(line)}
    [record] = service.store.audit_since(0, action="file_delete")
    assert (record["tenant"], record["target"], record["result"], record["actor"]) == (
        "globex", theirs.id, "ok", "token:2")
    assert record["detail"] == {"bytes": len(line), "purpose": "batch"}
    missing = call(tcp, "DELETE", f"/admin/files/{theirs.id}", headers=ADMIN)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == (
        f"file_id: no file {theirs.id!r} is kept here")


def test_an_operator_cannot_delete_the_input_of_a_batch_in_progress_and_the_refusal_is_audited(budgeted):
    service, _, tcp = budgeted
    batch = left_in_progress(tcp, GLOBEX_TOKEN, 2)
    refused = call(tcp, "DELETE", f"/admin/files/{batch.input_file_id}", headers=ADMIN)
    assert refused.status_code == 409 and refused.json()["error"]["message"] == (
        f"file_id: file {batch.input_file_id!r} is the input of batch {batch.id}, which is in_progress; cancel the "
        "batch or let it end first")
    [record] = service.store.audit_since(0, action="file_delete")
    assert (record["tenant"], record["result"]) == ("globex", "refused")
    assert batch.input_file_id in service.files.files


def test_the_metrics_count_the_files_their_bytes_and_the_uploads_refused(budgeted):
    _, unix, _ = budgeted
    call(unix, "POST", "/v1/files", files={"file": ("a.jsonl", b"a" * 3000)}, data={"purpose": "batch"})
    assert call(unix, "POST", "/v1/files", files={"file": ("b.jsonl", b"b" * 1200)},
                data={"purpose": "batch"}).status_code == 507
    scraped = call(unix, "GET", "/metrics").text
    for line in ("kvd_files 1.0", "kvd_files_bytes 3000.0", "kvd_files_store_budget_bytes 4096.0",
                 'kvd_file_uploads_refused_total{budget="store"} 1.0',
                 'kvd_file_uploads_refused_total{budget="tenant"} 0.0'):
        assert line in scraped.splitlines(), line
