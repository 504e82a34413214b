"""OpenAI's Files and Batch APIs on kvd (`/v1/files`, `/v1/batches`), driven with OpenAI's own
client: a batch's answers are the ones its requests get when sent alone, each tenant sees its
own files and batches only, and an operator sees and cancels every tenant's (audited)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from .daemon_fixtures import ADMIN_TOKEN, GLOBEX_TOKEN, USER_TOKEN, assert_admin_only, call  # noqa: E402
from .test_responses_api import client_for, kvd  # noqa: E402,F401

CHAT = "/v1/chat/completions"
SYSTEMS = ["You answer about blocks.", "You answer about tiers."]


def chat_line(custom_id: str, system: str, question: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                     "max_tokens": 6, "temperature": 0, **body}}


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def shown(answer: dict, now: float) -> str:
    """`kvctl batches` as it draws /admin/batches' answer, its words on one line."""
    from rich.console import Console

    from kvctl.batches_cmd import batches_view

    console = Console(record=True, width=250)
    console.print(batches_view(answer, now))
    return " ".join(console.export_text().split())


def left_in_progress(tcp, token: str, lines: int):
    """A batch of `lines` long requests made by `token`'s tenant in an event loop that then ends:
    its lines stop with the loop, so it stays in_progress."""
    long_lines = [chat_line(f"l{i}", SYSTEMS[1], f"Long {i}", max_tokens=400, ignore_eos=True) for i in range(lines)]

    async def go():
        client = client_for(tcp, token)
        uploaded = await client.files.create(file=("in.jsonl", jsonl(long_lines)), purpose="batch")
        return await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")

    return asyncio.run(go())


async def until_ended(client, batch_id: str):
    for _ in range(1200):
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        await asyncio.sleep(0.05)
    raise AssertionError(f"{batch_id} still {batch.status}")


def test_a_batch_s_answers_are_those_its_requests_get_alone_written_in_its_file_s_order(kvd):  # noqa: F811
    from .daemon_fixtures import blocks_all_back

    service, _, tcp = kvd
    lines = [chat_line(f"q{i}", SYSTEMS[i % 2], f"Question {i}?") for i in range(6)]
    lines.append(chat_line("bad", SYSTEMS[0], "Too many?", max_tokens=-1))

    async def go():
        client = client_for(tcp, USER_TOKEN)
        uploaded = await client.files.create(file=("questions.jsonl", jsonl(lines)), purpose="batch")
        assert (uploaded.filename, uploaded.purpose, uploaded.bytes) == ("questions.jsonl", "batch",
                                                                         len(jsonl(lines)))
        made = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
                                           metadata={"job": "eval"})
        assert made.status == "in_progress" and made.request_counts.total == 7
        done = await until_ended(client, made.id)
        written = [json.loads(r) for r in (await client.files.content(done.output_file_id)).text.splitlines()]
        errors = [json.loads(r) for r in (await client.files.content(done.error_file_id)).text.splitlines()]
        alone = [await client.chat.completions.create(model="kvd-demo-llama-v1", **row["body"]) for row in lines[:6]]
        listed = await client.batches.list()
        return done, written, errors, alone, listed

    done, written, errors, alone, listed = asyncio.run(go())
    assert done.status == "completed" and done.metadata == {"job": "eval"}
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 1)
    assert [row["custom_id"] for row in written] == [f"q{i}" for i in range(6)]
    assert [row["response"]["body"]["choices"][0]["message"]["content"] for row in written] == [
        answer.choices[0].message.content for answer in alone]
    # sent as flex, served as default: under a FIFO queue nothing is deferred (a priority queue defers flex)
    assert {row["response"]["body"]["service_tier"] for row in written} == {"default"}
    assert done.usage.input_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert done.usage.output_tokens == sum(a.usage.completion_tokens for a in alone)
    [error] = errors
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "max_tokens"
    assert [b.id for b in listed.data] == [done.id]
    # served as acme's requests: its tenant's book counts them (the batch's and the same sent alone)
    tenants = {row["tenant"]: row for row in call(tcp, "GET", "/admin/tenants", headers={
        "Authorization": f"Bearer {ADMIN_TOKEN}"}).json()["tenants"]}
    assert tenants["acme"]["prompt_tokens"] == 2 * done.usage.input_tokens
    lines_ = call(tcp, "GET", "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).text.splitlines()
    assert {'kvd_batch_requests_total{outcome="completed"} 6.0', 'kvd_batch_requests_total{outcome="failed"} 1.0',
            'kvd_batches{status="completed"} 1.0', 'kvd_batches{status="in_progress"} 0.0',
            "kvd_batch_requests_waiting 0.0"} <= set(lines_)
    assert blocks_all_back(service)


def test_each_tenant_sees_its_own_files_and_batches_only(kvd):  # noqa: F811
    _, _, tcp = kvd

    async def go():
        acme, globex = client_for(tcp, USER_TOKEN), client_for(tcp, GLOBEX_TOKEN)
        uploaded = await acme.files.create(file=("in.jsonl", jsonl([chat_line("a", SYSTEMS[0], "Hi")])),
                                           purpose="batch")
        batch = await acme.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        await until_ended(acme, batch.id)
        refusals = []
        for attempt in (globex.files.retrieve(uploaded.id), globex.files.content(uploaded.id),
                        globex.files.delete(uploaded.id), globex.batches.retrieve(batch.id),
                        globex.batches.cancel(batch.id),
                        globex.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")):
            try:
                await attempt
            except Exception as exc:  # noqa: BLE001
                refusals.append((exc.status_code, exc.body["message"]))
        return uploaded, batch, refusals, await globex.files.list(), await globex.batches.list(), \
            await acme.files.list(purpose="batch")

    uploaded, batch, refusals, globex_files, globex_batches, acme_files = asyncio.run(go())
    assert refusals == [(404, f"file_id: no file {uploaded.id!r} is kept here")] * 3 + [
        (404, f"batch_id: no batch {batch.id!r} is kept here")] * 2 + [
        (404, f"input_file_id: no file {uploaded.id!r} is kept here")]
    assert globex_files.data == [] and globex_batches.data == []
    assert [f.id for f in acme_files.data] == [uploaded.id]  # (its output file is purpose batch_output)


def test_a_running_batch_s_input_cannot_be_deleted_and_bad_uploads_are_refused(kvd):  # noqa: F811
    _, unix, _ = kvd
    long_lines = [chat_line(f"l{i}", SYSTEMS[0], f"Long {i}", max_tokens=400, ignore_eos=True) for i in range(4)]

    async def go():
        client = client_for(unix)
        uploaded = await client.files.create(file=("in.jsonl", jsonl(long_lines)), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        outcomes = []
        try:
            await client.files.delete(uploaded.id)
        except Exception as exc:  # noqa: BLE001
            outcomes.append((exc.status_code, exc.body["message"]))
        cancelling = await client.batches.cancel(batch.id)
        ended = await until_ended(client, batch.id)
        deleted = await client.files.delete(uploaded.id)
        for bad in (client.files.create(file=("in.jsonl", b"{}"), purpose="fine-tune"),
                    client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h"),
                    client.batches.create(input_file_id="file-x", endpoint="/v1/embeddings", completion_window="24h")):
            try:
                await bad
            except Exception as exc:  # noqa: BLE001
                outcomes.append((exc.status_code, exc.body["message"]))
        return batch, cancelling, ended, deleted, outcomes

    batch, cancelling, ended, deleted, outcomes = asyncio.run(go())
    assert cancelling.status == "cancelling" and ended.status == "cancelled"
    assert ended.request_counts.completed + ended.request_counts.failed < 4
    assert deleted.deleted
    assert outcomes == [
        (409, f"file_id: file {batch.input_file_id!r} is the input of batch {batch.id}, which is in_progress; "
              "cancel the batch or let it end first"),
        (400, "purpose: kvd keeps files for batch, got 'fine-tune'"),
        (404, f"input_file_id: no file {batch.input_file_id!r} is kept here"),
        (400, "endpoint: kvd serves batches of /v1/chat/completions, /v1/completions, /v1/responses, got "
              "'/v1/embeddings'")]


def test_an_operator_sees_every_tenant_s_batches_and_cancels_one_audited(kvd):  # noqa: F811
    service, _, tcp = kvd
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    batch = left_in_progress(tcp, GLOBEX_TOKEN, 3)
    seen = call(tcp, "GET", "/admin/batches", headers=admin).json()
    assert [(b["id"], b["tenant"], b["status"]) for b in seen["batches"]] == [(batch.id, "globex", "in_progress")]
    assert seen["concurrency"] == 8
    assert shown(seen, now=batch.created_at + 90) == (
        f"{batch.id} in_progress (tenant globex, made 1m ago) 0 of 3 answered, 0 failed, 0 in flight; 0 input "
        "tokens (0 cached), 0 output "
        "1 batches kept; 8 requests served at once (batch_concurrency); since kvd started 0 answered 2xx, 0 failed")
    assert_admin_only(tcp, "GET", "/admin/batches")
    cancelled = call(tcp, "POST", f"/admin/batches/{batch.id}/cancel", headers=admin)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling"
    [record] = service.store.audit_since(0, action="batch_cancel")
    assert (record["tenant"], record["target"], record["result"]) == ("globex", batch.id, "ok")
    missing = call(tcp, "POST", "/admin/batches/batch_nope/cancel", headers=admin)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == (
        "batch_id: no batch 'batch_nope' is kept here")


def test_a_file_is_removed_once_past_the_expiry_its_caller_gave_and_a_batch_s_outputs_too(kvd):  # noqa: F811
    service, unix, _ = kvd
    expiring = {"anchor": "created_at", "seconds": 3600}

    async def go():
        client = client_for(unix)
        kept = await client.files.create(file=("in.jsonl", jsonl([chat_line("a", SYSTEMS[0], "Hi")])),
                                          purpose="batch", expires_after=expiring)
        batch = await client.batches.create(input_file_id=kept.id, endpoint=CHAT, completion_window="24h",
                                            output_expires_after={"anchor": "created_at", "seconds": 7200})
        done = await until_ended(client, batch.id)
        output = await client.files.retrieve(done.output_file_id)
        refusals = []
        for bad in (client.files.create(file=("in.jsonl", b"{}"), purpose="batch",
                                        expires_after={"anchor": "created_at", "seconds": 10}),
                    client.batches.create(input_file_id=kept.id, endpoint=CHAT, completion_window="24h",
                                          output_expires_after={"anchor": "last_active_at", "seconds": 3600})):
            try:
                await bad
            except Exception as exc:  # noqa: BLE001
                refusals.append((exc.status_code, exc.body["message"]))
        return kept, output, refusals

    kept, output, refusals = asyncio.run(go())
    assert kept.expires_at == kept.created_at + 3600 and output.expires_at == output.created_at + 7200
    assert refusals == [
        (400, "expires_after.seconds: must be a whole number from 3600 to 2,592,000 (1 hour to 30 days), got '10'"),
        (400, "output_expires_after.anchor: must be 'created_at', got 'last_active_at'")]
    service.files.clock = lambda: kept.created_at + 3600  # housekeeping's sweep, an hour on
    service._expire_files()
    assert set(service.files.files) == {output.id}
    assert not service.files.data_path(kept.id).exists()
    gone = call(unix, "GET", f"/v1/files/{kept.id}/content")
    assert gone.status_code == 404 and gone.json()["error"]["message"] == f"file_id: no file {kept.id!r} is kept here"


def test_files_max_age_removes_each_file_that_old_whatever_its_own_expiry_and_says_so(kvd, caplog):  # noqa: F811
    import logging
    from dataclasses import replace

    from kvctl.daemon.config import resolve
    from kvctl.files_cmd import files_view

    service, unix, _ = kvd
    assert resolve({"state_dir": "/tmp/x", "files_max_age": "30d"}, env={}).files_max_age == 30 * 86400
    with pytest.raises(Exception, match="files_max_age"):
        resolve({"state_dir": "/tmp/x", "files_max_age": "0"}, env={})
    service.config = replace(service.config, files_max_age=7200.0)  # (as a reload sets it)

    async def go():
        client = client_for(unix)
        made = []
        for name, after in (("plain", None), ("later", 3 * 86400), ("sooner", 3600)):
            extra = {} if after is None else {"expires_after": {"anchor": "created_at", "seconds": after}}
            made.append(await client.files.create(file=(f"{name}.jsonl", b"{}\n"), purpose="batch", **extra))
        return made, [await client.files.retrieve(f.id) for f in made]

    made, again = asyncio.run(go())
    created = made[0].created_at
    assert [f.expires_at - f.created_at for f in made] == [7200, 7200, 3600]  # the earlier of the two
    assert [f.expires_at for f in again] == [f.expires_at for f in made]
    listed = call(unix, "GET", "/admin/files", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()
    assert listed["max_age"] == 7200.0 and {row["expires_at"] for row in listed["files"]} == {
        created + 7200, made[2].created_at + 3600}
    from rich.console import Console
    console = Console(width=400, record=True)
    console.print(files_view(listed, now=created))
    assert "each removed 2h after it was made at the latest (files_max_age)" in console.export_text()
    service.files.clock = lambda: created + 3600
    service._expire_files()
    assert set(service.files.files) == {made[0].id, made[1].id}
    service.files.clock = lambda: created + 7200
    with caplog.at_level(logging.INFO, logger="kvd"):
        service._expire_files()
    assert service.files.files == {} and dict(service.files.expired) == {"expires_after": 1, "files_max_age": 2}
    assert (f"removed 2 files past files_max_age (2h): {made[0].id} of tenant default, {made[1].id} of tenant "
            "default") in caplog.text
    metrics = call(unix, "GET", "/metrics").text
    assert 'kvd_files_expired_total{set_by="files_max_age"} 2.0' in metrics
    assert 'kvd_files_expired_total{set_by="expires_after"} 1.0' in metrics


def test_a_batch_of_responses_gives_what_each_gets_alone_and_sums_their_usage(kvd):  # noqa: F811
    _, unix, _ = kvd
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses", "body": {
        "instructions": SYSTEMS[i % 2], "input": f"Question {i}?", "max_output_tokens": 5, "temperature": 0,
        "store": False}} for i in range(4)]

    async def go():
        client = client_for(unix)
        uploaded = await client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses",
                                            completion_window="24h")
        done = await until_ended(client, batch.id)
        written = [json.loads(r) for r in (await client.files.content(done.output_file_id)).text.splitlines()]
        alone = [await client.responses.create(model="kvd-demo-llama-v1", **row["body"]) for row in rows]
        background = jsonl([{**rows[0], "body": {**rows[0]["body"], "background": True}}])
        faulty = await client.files.create(file=("bad.jsonl", background), purpose="batch")
        failed = await client.batches.create(input_file_id=faulty.id, endpoint="/v1/responses",
                                             completion_window="24h")
        return done, written, alone, failed

    done, written, alone, failed = asyncio.run(go())
    assert done.status == "completed" and done.request_counts.completed == 4
    assert [row["custom_id"] for row in written] == ["r0", "r1", "r2", "r3"]
    assert [row["response"]["body"]["output"][-1]["content"][0]["text"] for row in written] == [
        answer.output_text for answer in alone]
    assert done.usage.input_tokens == sum(a.usage.input_tokens for a in alone)
    assert done.usage.output_tokens == sum(a.usage.output_tokens for a in alone)
    assert failed.status == "failed" and failed.errors.data[0].message == (
        "line 1: body.background: a batch's requests are served while their caller is away already; leave "
        "background out")
