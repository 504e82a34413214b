"""Batches on a running `kvd serve`: what a batch had left when kvd stopped is served once kvd
starts again (and what it had served is not served again), and `kvctl bench batch` gives the
same replies as a batch and as a client sending the same requests."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")

from .test_kvd_e2e import Kvd  # noqa: E402

CHAT = "/v1/chat/completions"


def test_a_batch_kvd_stopped_in_the_middle_of_is_finished_after_it_starts_again(tmp_path):
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": {
        "messages": [{"role": "user", "content": f"Tell me about block {i}."}], "max_tokens": 300,
        "ignore_eos": True, "temperature": 0}} for i in range(8)]
    kvd = Kvd(tmp_path)
    try:
        uploaded = kvd.http.post("/v1/files", files={"file": ("in.jsonl", "".join(
            json.dumps(r) + "\n" for r in rows).encode())}, data={"purpose": "batch"}).json()
        batch = kvd.http.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": CHAT,
                                                   "completion_window": "24h"}).json()
        deadline = time.monotonic() + 60
        while kvd.http.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        assert kvd.stop() == 0
    served_before = len((tmp_path / "state" / "batches" / f"{batch['id']}.done.jsonl").read_text().splitlines())
    assert 1 <= served_before < 8

    kvd = Kvd(tmp_path)  # the same state folder
    try:
        deadline = time.monotonic() + 120
        while (now := kvd.http.get(f"/v1/batches/{batch['id']}").json())["status"] != "completed":
            assert time.monotonic() < deadline, now
            time.sleep(0.1)
        output = kvd.http.get(f"/v1/files/{now['output_file_id']}/content").text.splitlines()
        assert [json.loads(line)["custom_id"] for line in output] == [f"r{i}" for i in range(8)]
        assert now["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
        served = kvd.kvctl("batches", "--json")
        assert json.loads(served.stdout)["served"] == {"completed": 8 - served_before, "failed": 0}
    finally:
        assert kvd.stop() == 0


def test_bench_batch_gives_the_same_replies_as_a_batch_and_as_a_client(tmp_path):
    kvd = Kvd(tmp_path)
    try:
        ran = kvd.kvctl("bench", "batch", "--documents", "3", "--questions", "2", "--document-tokens", "64",
                        "--max-tokens", "3", "--repeats", "1", "--json")
        assert ran.returncode == 0, ran.stderr
        document = json.loads(ran.stdout)
        assert document["settings"]["requests"] == 6 and document["same_replies"] == 6
        assert document["baseline"]["prompt_tokens"] == document["batch"]["prompt_tokens"]
        assert kvd.http.get("/v1/files").json()["data"] == []  # (it left nothing behind)
    finally:
        assert kvd.stop() == 0


def test_bench_batch_prints_the_figures_side_by_side():
    from rich.console import Console

    from kvctl.bench_batch import render

    console = Console(record=True, width=200)
    render({"settings": {"documents": 12, "questions": 6, "document_tokens": 600, "max_tokens": 8, "seed": 0,
                         "concurrency": 8, "requests": 72},
            "baseline": {"seconds": 8.0, "prompt_tokens": 30_000, "cached_tokens": 10_000},
            "batch": {"seconds": 4.0, "prompt_tokens": 30_000, "cached_tokens": 25_000, "id": "batch_x"},
            "same_replies": 72}, console)
    rows = [" ".join(line.replace("│", " ").split()) for line in console.export_text().splitlines()]
    assert "wall time 8.00 s 4.00 s 0.50x" in rows
    assert "requests a second 9.0 18.0 2.00x" in rows
    assert "served from the prefix cache 10,000 25,000 2.50x" in rows
    assert "computed 20,000 5,000 0.25x" in rows
    assert rows[-1] == "replies the same: 72 of 72"


def test_the_bench_s_file_is_shuffled_documents_and_questions_each_once():
    from kvctl.bench_batch import workload

    rows = workload(3, 2, 20, 4, seed=1)
    assert sorted(r["custom_id"] for r in rows) == ["d0-q0", "d0-q1", "d1-q0", "d1-q1", "d2-q0", "d2-q1"]
    assert [r["custom_id"] for r in rows] != sorted(r["custom_id"] for r in rows)  # (not the prompts' order)
    assert workload(3, 2, 20, 4, seed=1) == rows
    assert {r["body"]["messages"][0]["content"] for r in rows if r["custom_id"].startswith("d1")} == {
        next(r["body"]["messages"][0]["content"] for r in rows if r["custom_id"] == "d1-q0")}
