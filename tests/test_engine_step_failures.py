"""An engine step that raises (a GPU out of memory on a large batch, a bug a request's shape meets)
stops every request in flight, and kvd serves on: each client is answered 500 `engine_error`
(an error event in a stream), never an answer cut short as if it were whole; each request's blocks
come back; and the operator sees it (`kvctl status`, `kvd_engine_step_failures_total`), where
before every client got a 200 with finish_reason "cancelled" and only the log said why."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from kvctl.daemon.server.app import create_app  # noqa: E402
from kvctl.daemon.server.step_failures import STEP_FAILED  # noqa: E402

from .daemon_fixtures import call, sse_events, start_service  # noqa: E402

ERROR = {"error": {"message": STEP_FAILED, "type": "server_error", "param": None, "code": "engine_error"}}


@pytest.fixture
def kvd(tmp_path):
    service = start_service(tmp_path)
    try:
        yield service, create_app(service, service.metrics, front="unix")
    finally:
        service.shutdown(deadline=2)


def fail_a_step(service, when, error: Exception | None = None) -> list:
    """The engine's next step for which `when(engine)` holds raises (`error`: by default a
    RuntimeError saying CUDA is out of memory), once; returns the list the failure is noted in."""
    engine, real, failed = service.engine, service.engine.step, []

    def step():
        if not failed and when(engine):
            failed.append(len(engine.requests))
            raise error or RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real()

    engine.step = step
    return failed


def retired(service) -> None:
    """Every request is gone from the engine (its engine thread retires a request just after its
    last event, which its client may answer first) and no block is held for one."""
    deadline = time.monotonic() + 10
    while service.engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    pool = service.engine.cache.pool
    assert not service.engine.requests
    assert pool.num_free + pool.num_evictable == service.engine.settings.num_blocks


def test_a_failed_step_answers_each_request_in_flight_500_and_kvd_serves_on(kvd, caplog):
    service, app = kvd
    failed = fail_a_step(service, lambda engine: len(engine.requests) == 2 and engine.num_running == 2)
    body = {"prompt": "Tell me a story about blocks.", "max_tokens": 16, "ignore_eos": True, "temperature": 0}

    async def both():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvd",
                                     timeout=60) as client:
            return await asyncio.gather(client.post("/v1/completions", json=body),
                                        client.post("/v1/completions", json={**body, "prompt": "Another one."}))

    with caplog.at_level(logging.ERROR, logger="kvd"):
        answers = asyncio.run(both())
    assert failed == [2]
    assert [(a.status_code, a.json()) for a in answers] == [(500, ERROR), (500, ERROR)]
    retired(service)
    assert "engine step failed; 2 in flight stopped, each answered 500 engine_error" in caplog.text
    report = service.status()["step_failures"]
    assert report == {"total": 1, "in_a_row": 1, "last_error": "RuntimeError: CUDA out of memory. Tried to allocate "
                      "2.00 GiB", "last_at": report["last_at"], "last_stopped": 2}

    again = call(app, "POST", "/v1/completions", json=body)  # kvd serves on
    assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
    assert service.status()["step_failures"]["in_a_row"] == 0
    lines = call(app, "GET", "/metrics").text.splitlines()
    assert "kvd_engine_step_failures_total 1.0" in lines


def test_a_stream_a_failed_step_stops_ends_with_an_error_event(kvd):
    service, app = kvd
    fail_a_step(service, lambda engine: any(len(s.output_ids) >= 2 for r in engine.requests.values()
                                            for s in r.sequences))
    streamed = call(app, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "ignore_eos": True, "stream": True})
    assert streamed.status_code == 200  # (the stream had begun)
    events = sse_events(streamed)
    assert events[-1] == "[DONE]" and events[-2] == ERROR
    assert events[-3]["choices"][0]["finish_reason"] == "error"
    retired(service)


def test_kvctl_status_shows_the_failed_steps_and_the_latest_error():
    from rich.console import Console

    from kvctl.status_view import render_status, step_failures_line

    from .test_cli import _status_data

    failures = {"total": 3, "in_a_row": 2, "last_error": "RuntimeError: CUDA out of memory", "last_at": 1796500000.0,
                "last_stopped": 5}
    line = step_failures_line(failures)
    assert line.startswith("3 steps failed; the latest at 20")
    assert line.endswith(": RuntimeError: CUDA out of memory (5 in flight stopped, each answered 500); the last 2 "
                         "steps all failed")
    assert "the last" not in step_failures_line({**failures, "in_a_row": 1})
    console = Console(record=True, width=300)
    render_status({**_status_data(0), "step_failures": failures}, console)
    assert f"engine failures {line}" in " ".join(console.export_text().split())
    console = Console(record=True, width=300)
    render_status({**_status_data(0), "step_failures": {**failures, "total": 0}}, console)
    assert "engine failures" not in console.export_text()
    live = {"blocks": {"device": {"total": 64, "free": 64}}, "tokens": {"prompt": 0, "hit": 0, "hit_ratio": 0.0},
            "queue": {"waiting": 0, "running": 0}}
    fleet = {"routing": "prefix", "view": "events", "replicas": [{"replica": "a"}, {"replica": "b"}],
             "replica_status": [{"replica": "a", **live, "step_failures": failures},
                                {"replica": "b", **live, "step_failures": {**failures, "total": 0}}]}
    console = Console(record=True, width=300)
    render_status(fleet, console)  # at kvd router: each replica's
    lines = console.export_text().splitlines()
    assert f"a engine failures: {line}" in lines and not any(x.startswith("b engine") for x in lines)


def test_an_engine_whose_steps_keep_failing_is_not_ready_until_a_while_after_the_latest(kvd):
    """Three failed steps in a row (none between that did not fail): /readyz answers 503 saying so,
    so a load balancer sends requests elsewhere; 10 s after the latest failure it says ready again
    (to try), and a step that does not fail ends the run."""
    from kvctl.daemon.server.step_failures import READY_AGAIN_S, StepFailures

    service, app = kvd
    body = {"prompt": "word " * 8, "max_tokens": 2}
    for _ in range(3):  # (each request's first step fails: no step between does not)
        fail_a_step(service, lambda engine: bool(engine.requests))
        assert call(app, "POST", "/v1/completions", json=body).status_code == 500
    not_ready = call(app, "GET", "/readyz")
    assert not_ready.status_code == 503 and not_ready.json() == {"ready": False, "reason": (
        "the engine's last 3 steps failed (RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB); ready "
        "again 10 s after the latest, to try")}
    assert call(app, "POST", "/v1/completions", json=body).status_code == 200  # (it serves whoever comes)
    assert call(app, "GET", "/readyz").json() == {"ready": True}

    book = StepFailures()
    for at in (100.0, 101.0):
        book.failed(RuntimeError("x"), 1, now=at)
        assert book.not_ready(at) is None  # one or two in a row: a request's bad luck, not the engine
    book.failed(RuntimeError("x"), 1, now=102.0)
    assert book.not_ready(102.0 + READY_AGAIN_S - 0.1) is not None and book.not_ready(102.0 + READY_AGAIN_S) is None
    book.stepped()
    assert book.not_ready(102.5) is None
