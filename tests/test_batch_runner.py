"""The batch runner (daemon/server/batches.py) against a stand-in for kvd's API: the order lines
are served in, how many at once, what is served again (429, 503, kvd stopping) and what is
written, a cancel, the completion window, and serving what was left after a restart."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402

from kvctl.daemon.server.batch_files import FileError, FileStore  # noqa: E402
from kvctl.daemon.server.batches import BatchError, BatchRunner  # noqa: E402

CHAT = "/v1/chat/completions"


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class StandIn:
    """kvd's API, standing in: each request noted (tenant, custom prompt, tier) and answered as
    `answer(body)` says: (status, JSON); `gate`, where set, holds every answer until it opens."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, str]] = []
        self.answer = lambda body: (200, {"id": "x", "usage": {"prompt_tokens": 10, "completion_tokens": 2,
                                                               "prompt_tokens_details": {"cached_tokens": 4}}})
        self.most_at_once = self.at_once = 0
        self.gate: asyncio.Event | None = None
        self.holds: dict[str, asyncio.Event] = {}  # a prompt's answer waits for its event
        self.app = FastAPI()

        @self.app.post(CHAT)
        async def chat(http: Request):
            body = await http.json()
            self.asked.append((http.headers["x-kvd-tenant"], body["messages"][0]["content"], body["service_tier"]))
            self.at_once += 1
            self.most_at_once = max(self.most_at_once, self.at_once)
            try:
                if self.gate is not None:
                    await self.gate.wait()
                if body["messages"][0]["content"] in self.holds:
                    await self.holds[body["messages"][0]["content"]].wait()
                await asyncio.sleep(0)
                status, content = self.answer(body)
            finally:
                self.at_once -= 1
            return JSONResponse(content, status_code=status)


def line(custom_id: str, prompt: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": prompt}], **body}}


def runner_for(tmp_path, stand_in: StandIn, concurrency: int = 2, clock=None, on_end=None) -> BatchRunner:
    runner = BatchRunner(tmp_path / "batches", FileStore(tmp_path / "files"), lambda: concurrency,
                         clock=clock or Clock(), **({"on_end": on_end} if on_end else {}))
    runner.lines_app = stand_in.app
    return runner


def upload(runner: BatchRunner, tenant: str, lines: list[dict]) -> str:
    content = "".join(json.dumps(row) + "\n" for row in lines).encode()
    return runner.files.add(tenant, "in.jsonl", "batch", content).id


async def ended(runner: BatchRunner, batch_id: str, *statuses: str) -> dict:
    for _ in range(2000):
        batch = runner.get(None, batch_id)
        if batch.status in (statuses or ("completed", "failed", "expired", "cancelled")):
            return batch.public()
        await asyncio.sleep(0.005)
    raise AssertionError(f"{batch_id} still {runner.get(None, batch_id).status}")


def output(runner: BatchRunner, tenant: str, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(r) for r in runner.files.content(tenant, file_id).splitlines()]


def test_lines_are_served_in_the_order_of_their_prompts_and_written_in_the_file_s(tmp_path):
    stand_in = StandIn()
    runner = runner_for(tmp_path, stand_in, concurrency=1)
    prompts = ["doc B: q1", "doc A: q1", "doc B: q2", "doc C: q1", "doc A: q2", "doc B: q3"]
    file_id = upload(runner, "acme", [line(f"req-{i}", p) for i, p in enumerate(prompts)])

    async def go():
        batch = runner.create("acme", file_id, CHAT, "24h", {"job": "nightly"})
        return await ended(runner, batch.id)

    done = asyncio.run(go())
    # one at a time, each document's questions one after another (its prefix computed once while cached)
    assert [prompt for _, prompt, _ in stand_in.asked] == sorted(prompts)
    assert {(tenant, tier) for tenant, _, tier in stand_in.asked} == {("acme", "flex")}
    assert done["status"] == "completed" and done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert done["metadata"] == {"job": "nightly"} and done["error_file_id"] is None
    assert done["usage"] == {"input_tokens": 60, "output_tokens": 12, "total_tokens": 72,
                             "input_tokens_details": {"cached_tokens": 24},
                             "output_tokens_details": {"reasoning_tokens": 0}}
    written = output(runner, "acme", done["output_file_id"])
    assert [row["custom_id"] for row in written] == [f"req-{i}" for i in range(6)]  # the input's order
    assert all(row["response"]["status_code"] == 200 and row["error"] is None for row in written)
    assert written[0]["response"]["request_id"] == written[0]["id"] and written[0]["id"].startswith("batch_req_")
    assert runner.files.get("acme", done["output_file_id"]).purpose == "batch_output"
    assert not (tmp_path / "batches" / f"{done['id']}.done.jsonl").exists()  # (its answers are in the file now)


def test_a_line_s_own_tier_is_kept_and_its_error_goes_to_the_error_file(tmp_path):
    stand_in = StandIn()
    stand_in.answer = lambda body: (400, {"error": {"message": "max_tokens: must be >= 1, got 0"}}) \
        if body.get("max_tokens") == 0 else (200, {"id": "ok"})
    runner = runner_for(tmp_path, stand_in)
    file_id = upload(runner, "acme", [line("good", "a"), line("bad", "b", max_tokens=0),
                                      line("mine", "c", service_tier="default")])

    async def go():
        return await ended(runner, runner.create("acme", file_id, CHAT, "24h", {}).id)

    done = asyncio.run(go())
    assert sorted(tier for _, _, tier in stand_in.asked) == ["default", "flex", "flex"]
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert [row["custom_id"] for row in output(runner, "acme", done["output_file_id"])] == ["good", "mine"]
    [error] = output(runner, "acme", done["error_file_id"])
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"] == {"error": {"message": "max_tokens: must be >= 1, got 0"}}


def test_at_most_concurrency_lines_run_at_once_taking_each_batch_in_turn(tmp_path):
    stand_in = StandIn()
    runner = runner_for(tmp_path, stand_in, concurrency=3)
    big = upload(runner, "acme", [line(f"a{i}", f"acme {i:02}") for i in range(12)])
    small = upload(runner, "globex", [line(f"g{i}", f"globex {i}") for i in range(3)])

    async def go():
        first = runner.create("acme", big, CHAT, "24h", {})
        second = runner.create("globex", small, CHAT, "24h", {})
        return await ended(runner, first.id), await ended(runner, second.id)

    done = asyncio.run(go())
    assert stand_in.most_at_once == 3
    tenants = [tenant for tenant, _, _ in stand_in.asked]
    # globex's 3 lines did not wait behind acme's 12: all were served among the first 8
    assert [i for i, t in enumerate(tenants) if t == "globex"][-1] < 8
    assert [d["request_counts"]["completed"] for d in done] == [12, 3]


def test_a_tenant_with_many_batches_takes_no_more_of_the_lines_at_once_than_one_with_one(tmp_path):
    stand_in = StandIn()
    runner = runner_for(tmp_path, stand_in, concurrency=2)
    many = [upload(runner, "acme", [line(f"a{b}-{i}", f"acme {b} {i}") for i in range(6)]) for b in range(3)]
    one = upload(runner, "globex", [line(f"g{i}", f"globex {i}") for i in range(6)])

    async def go():
        made = [runner.create("acme", file_id, CHAT, "24h", {}) for file_id in many]
        made.append(runner.create("globex", one, CHAT, "24h", {}))
        return [await ended(runner, batch.id) for batch in made]

    done = asyncio.run(go())
    tenants = [tenant for tenant, _, _ in stand_in.asked]
    # globex's 6 lines were served as fast as acme's, not one in four: all among the first 13 of 24
    assert tenants.count("globex") == 6 and [i for i, t in enumerate(tenants) if t == "globex"][-1] < 13
    assert [d["request_counts"]["completed"] for d in done] == [6, 6, 6, 6]


def test_a_line_answered_429_or_503_is_served_again_and_not_counted_failed(tmp_path):
    stand_in = StandIn()
    refusals = [429, 503]

    def answer(body):
        return (refusals.pop(0), {"error": {"message": "busy"}}) if refusals else (200, {"id": "ok"})

    stand_in.answer = answer
    clock = Clock()
    runner = runner_for(tmp_path, stand_in, clock=clock)
    file_id = upload(runner, "acme", [line("only", "a")])

    async def go():
        batch = runner.create("acme", file_id, CHAT, "24h", {})
        for _ in range(200):
            clock.now += 0.5  # (each retry is due after RETRY_S)
            await asyncio.sleep(0.01)
            if batch.status == "completed":
                break
        return await ended(runner, batch.id)

    done = asyncio.run(go())
    assert len(stand_in.asked) == 3 and done["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    assert runner.served == {"completed": 1, "failed": 0}


def test_a_cancelled_batch_ends_once_its_lines_in_flight_end_with_their_answers(tmp_path):
    stand_in = StandIn()
    runner = runner_for(tmp_path, stand_in, concurrency=2)
    file_id = upload(runner, "acme", [line(f"r{i}", f"p{i}") for i in range(6)])

    async def go():
        stand_in.gate = asyncio.Event()
        batch = runner.create("acme", file_id, CHAT, "24h", {})
        while len(stand_in.asked) < 2:
            await asyncio.sleep(0.005)
        with pytest.raises(BatchError, match="no batch"):
            runner.cancel("globex", batch.id)  # (another tenant's: not there for it)
        assert runner.cancel("acme", batch.id).public()["status"] == "cancelling"
        stand_in.gate.set()
        done = await ended(runner, batch.id)
        with pytest.raises(BatchError, match=r"has ended \(cancelled\); only a batch that has not can be cancelled"):
            runner.cancel("acme", batch.id)
        return done

    done = asyncio.run(go())
    assert len(stand_in.asked) == 2  # no line was handed out after the cancel
    assert done["status"] == "cancelled" and done["cancelling_at"] is not None and done["cancelled_at"] is not None
    assert done["request_counts"] == {"total": 6, "completed": 2, "failed": 0}
    assert [row["custom_id"] for row in output(runner, "acme", done["output_file_id"])] == ["r0", "r1"]


def test_a_batch_whose_window_passes_expires_with_each_line_not_served_an_error(tmp_path):
    stand_in = StandIn()
    clock = Clock()
    runner = runner_for(tmp_path, stand_in, concurrency=1, clock=clock)
    file_id = upload(runner, "acme", [line(f"r{i}", f"p{i}") for i in range(3)])

    async def go():
        stand_in.gate = asyncio.Event()
        batch = runner.create("acme", file_id, CHAT, "24h", {})
        while not stand_in.asked:
            await asyncio.sleep(0.005)
        clock.now += 86_400  # its 24 h pass while its first line runs
        stand_in.gate.set()
        return await ended(runner, batch.id)

    done = asyncio.run(go())
    assert done["status"] == "expired" and done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert [row["custom_id"] for row in output(runner, "acme", done["output_file_id"])] == ["r0"]
    assert [(row["custom_id"], row["response"], row["error"]["code"])
            for row in output(runner, "acme", done["error_file_id"])] == [("r1", None, "batch_expired"),
                                                                          ("r2", None, "batch_expired")]


def test_after_a_restart_what_was_left_is_served_and_what_was_served_is_not_again(tmp_path):
    stand_in = StandIn()
    runner = runner_for(tmp_path, stand_in, concurrency=1)
    file_id = upload(runner, "acme", [line(f"r{i}", f"p{i}") for i in range(5)])

    async def first_life():
        stand_in.holds["p2"] = asyncio.Event()
        batch = runner.create("acme", file_id, CHAT, "24h", {})
        while len(stand_in.asked) < 3:
            await asyncio.sleep(0.005)
        runner.stopping = True  # kvd stops: what is in flight now is not written, and nothing more goes out
        stand_in.holds.pop("p2").set()
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert len(stand_in.asked) == 3
        return batch.id

    batch_id = asyncio.run(first_life())
    done_file = tmp_path / "batches" / f"{batch_id}.done.jsonl"
    served = [json.loads(row)["custom_id"] for row in done_file.read_text().splitlines()]
    assert served == ["r0", "r1"]
    with open(done_file, "a") as f:
        f.write('{"line": 3, "custom_id": "r2", "resp')  # a record a crash cut short
    asked_before = len(stand_in.asked)

    again = runner_for(tmp_path, stand_in, concurrency=1)  # kvd's next start
    assert again.get("acme", batch_id).public()["request_counts"] == {"total": 5, "completed": 2, "failed": 0}

    async def second_life():
        again.start()
        return await ended(again, batch_id)

    done = asyncio.run(second_life())
    assert [p for _, p, _ in stand_in.asked[asked_before:]] == ["p2", "p3", "p4"]  # (p2's first answer: unwritten)
    assert done["status"] == "completed" and done["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert [row["custom_id"] for row in output(again, "acme", done["output_file_id"])] == [f"r{i}" for i in range(5)]
    assert again.get("acme", batch_id).done == set()  # (its answers are in its file, not held in memory)
    later = runner_for(tmp_path, stand_in)  # a start after it ended: it says what it said
    assert later.get("acme", batch_id).public() == done


def test_a_batch_s_end_is_told_again_at_the_next_start_where_it_was_not_noted_as_told(tmp_path):
    stand_in = StandIn()
    told = []
    record = tmp_path / "batches"

    def not_written_down(batch):  # (its event could not be written; kvd stopping before it was, likewise)
        told.append((batch.id, batch.status))
        return False

    runner = runner_for(tmp_path, stand_in, on_end=not_written_down)
    file_id = upload(runner, "acme", [line("r0", "p0")])

    async def go():
        return await ended(runner, runner.create("acme", file_id, CHAT, "24h", {}).id)

    done = asyncio.run(go())
    assert told == [(done["id"], "completed")]
    assert json.loads((record / f"{done['id']}.json").read_text())["told"] is False
    again = runner_for(tmp_path, stand_in, on_end=lambda batch: told.append((batch.id, batch.status)))  # next start
    assert told == [(done["id"], "completed")] * 2
    assert json.loads((record / f"{done['id']}.json").read_text())["told"] is True
    runner_for(tmp_path, stand_in, on_end=lambda batch: told.append((batch.id, batch.status)))
    assert told == [(done["id"], "completed")] * 2  # noted as told: not again
    assert again.get("acme", done["id"]).public() == done


def test_a_faulty_input_file_fails_the_batch_naming_each_line_at_fault(tmp_path):
    runner = runner_for(tmp_path, StandIn())
    rows = [json.dumps(line("a", "x")), "{not json", json.dumps(line("a", "y")),
            json.dumps({**line("c", "z"), "url": "/v1/completions"}), json.dumps(line("d", "w", stream=True)),
            json.dumps({**line("e", "v"), "method": "GET"}), json.dumps({"custom_id": "f", "method": "POST",
                                                                          "url": CHAT, "body": [1]})]
    file_id = runner.files.add("acme", "in.jsonl", "batch", "\n".join(rows).encode()).id
    batch = runner.create("acme", file_id, CHAT, "24h", {}).public()
    assert batch["status"] == "failed" and batch["failed_at"] is not None and batch["in_progress_at"] is None
    assert [(e["line"], e["code"], e["param"]) for e in batch["errors"]["data"]] == [
        (2, "invalid_json_line", None), (3, "duplicate_custom_id", "custom_id"), (4, "invalid_url", "url"),
        (5, "invalid_request", "body.stream"), (6, "invalid_request", "method"), (7, "invalid_request", "body")]
    assert batch["errors"]["data"][1]["message"] == (
        "line 3: custom_id 'a' is the custom_id of line 1 too; each request's must be its own")
    assert batch["errors"]["data"][2]["message"] == (
        "line 4: url must be the batch's endpoint '/v1/chat/completions', got '/v1/completions'")
    empty = runner.files.add("acme", "empty.jsonl", "batch", b"\n\n").id
    assert runner.create("acme", empty, CHAT, "24h", {}).errors[0]["code"] == "empty_file"


@pytest.mark.parametrize("args, message", [
    (("acme", "FILE", "/v1/embeddings", "24h"),
     "endpoint: kvd serves batches of /v1/chat/completions, /v1/completions, /v1/responses, got '/v1/embeddings'"),
    (("acme", "FILE", CHAT, "1h"), "completion_window: must be one of 24h, got '1h'"),
    (("globex", "FILE", CHAT, "24h"), "input_file_id: no file 'FILE' is kept here"),
    (("acme", "file-000000000000000000000000", CHAT, "24h"),
     "input_file_id: no file 'file-000000000000000000000000' is kept here"),
])
def test_a_batch_that_names_no_such_endpoint_window_or_file_is_refused(tmp_path, args, message):
    runner = runner_for(tmp_path, StandIn())
    file_id = upload(runner, "acme", [line("a", "x")])
    tenant, given, endpoint, window = args
    with pytest.raises(FileError) as refused:  # (BatchError is one)
        runner.create(tenant, file_id if given == "FILE" else given, endpoint, window, {})
    assert str(refused.value) == message.replace("FILE", file_id)
    assert runner.batches == {}


def test_an_expired_input_file_stays_while_its_batch_runs_and_goes_once_it_has_ended(tmp_path):
    stand_in = StandIn()
    runner = runner_for(tmp_path, stand_in, concurrency=1)
    content = "".join(json.dumps(line(f"r{i}", f"p{i}")) + "\n" for i in range(2)).encode()
    file_id = runner.files.add("acme", "in.jsonl", "batch", content, expires_in=3600).id
    runner.files.clock = lambda: runner.files.files[file_id].created_at + 3600  # past its expiry
    keep = lambda stored: runner.holds_input(stored.id) is not None  # noqa: E731 (as housekeeping's)

    async def go():
        stand_in.gate = asyncio.Event()
        batch = runner.create("acme", file_id, CHAT, "24h", {})
        assert runner.files.expire(keep) == []  # (its batch reads it)
        stand_in.gate.set()
        return await ended(runner, batch.id)

    asyncio.run(go())
    assert [(f.id, why) for f, why in runner.files.expire(keep)] == [(file_id, "expires_after")]
    assert file_id not in runner.files.files and not (tmp_path / "files" / f"{file_id}.json").exists()


def test_lines_are_read_where_they_lie_in_the_file_crlf_blank_lines_and_a_raw_line_separator_too(tmp_path):
    stand_in = StandIn()
    runner = runner_for(tmp_path, stand_in, concurrency=1)
    prompts = ["first\u2028half", "second", "third"]  # (U+2028 as it is, not escaped: still one line)
    rows = [json.dumps(line(f"r{i}", p), ensure_ascii=False) for i, p in enumerate(prompts)]
    content = (rows[0] + "\r\n\r\n" + rows[1] + "\n\n" + rows[2]).encode()
    file_id = runner.files.add("acme", "in.jsonl", "batch", content).id

    async def go():
        batch = runner.create("acme", file_id, CHAT, "24h", {})
        where = [(n.number, n.custom_id, n.offset, n.length) for n in batch.lines]
        return where, await ended(runner, batch.id)

    where, done = asyncio.run(go())
    second_at = len((rows[0] + "\r\n\r\n").encode())
    assert sorted(where) == [(1, "r0", 0, len((rows[0] + "\r\n").encode())),
                             (3, "r1", second_at, len(rows[1]) + 1),
                             (5, "r2", second_at + len(rows[1]) + 2, len(rows[2]))]
    assert sorted(prompt for _, prompt, _ in stand_in.asked) == sorted(prompts)
    assert [row["custom_id"] for row in output(runner, "acme", done["output_file_id"])] == ["r0", "r1", "r2"]


def test_prompts_alike_past_their_first_characters_are_served_one_after_another(tmp_path):
    from kvctl.daemon.server.batch_lines import KEY_CHUNKS, KEY_TEXT, prompt_key

    stand_in = StandIn()
    runner = runner_for(tmp_path, stand_in, concurrency=1)
    system = "You answer about the document below. " * 10  # (370 characters alike in every prompt)
    documents = {name: f"Document {name}: " + name * 900 for name in "PQR"}
    order = [("Q", 1), ("P", 1), ("R", 1), ("Q", 2), ("R", 2), ("P", 2), ("P", 3), ("Q", 3), ("R", 3)]
    prompts = [f"{system}{documents[name]} Question {n}?" for name, n in order]
    file_id = upload(runner, "acme", [line(f"c{i}", p) for i, p in enumerate(prompts)])

    async def go():
        return await ended(runner, runner.create("acme", file_id, CHAT, "24h", {}).id)

    asyncio.run(go())
    served = [prompt[len(system) + len("Document ")] for _, prompt, _ in stand_in.asked]
    runs = [served[i] for i in range(len(served)) if i == 0 or served[i] != served[i - 1]]
    assert sorted(runs) == ["P", "Q", "R"]  # each document's questions one after another
    assert len(served) == 9
    text, digests = prompt_key({"messages": [{"role": "user", "content": "x" * 100_000}]})
    assert len(text) == KEY_TEXT and len(digests) == 8 * KEY_CHUNKS  # (bounded, however long the prompt)
    # prompts alike in their first KEY_TEXT characters are told apart by what follows them
    assert prompt_key({"prompt": "a" * KEY_TEXT + "b"}) != prompt_key({"prompt": "a" * KEY_TEXT + "c"})


def test_a_line_that_cannot_be_read_again_is_an_error_and_the_others_are_answered(tmp_path):
    stand_in = StandIn()
    runner = runner_for(tmp_path, stand_in, concurrency=1)
    file_id = upload(runner, "acme", [line(f"r{i}", f"p{i}") for i in range(3)])

    async def go():
        stand_in.gate = asyncio.Event()
        batch = runner.create("acme", file_id, CHAT, "24h", {})
        while not stand_in.asked:
            await asyncio.sleep(0.005)
        runner.files.data_path(file_id).write_bytes(b"")  # (its input emptied under it, as no kvd path does)
        stand_in.gate.set()
        return await ended(runner, batch.id)

    done = asyncio.run(go())
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert [row["custom_id"] for row in output(runner, "acme", done["output_file_id"])] == ["r0"]
    assert [(row["custom_id"], row["error"]["code"]) for row in output(runner, "acme", done["error_file_id"])] == [
        ("r1", "input_unreadable"), ("r2", "input_unreadable")]
