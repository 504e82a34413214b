"""max_queue_wait: a request that waits that long without being admitted is turned away
(queue_timeout) instead of waiting on, and says so everywhere a rejection shows: the engine's
events and counts, a 503 with Retry-After (an error event in a stream), the request's log line,
the metrics and their alert; kvd router takes it to another replica."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

pytest.importorskip("torch")

from kvctl.daemon.engine.engine import Engine, EngineSettings, TokenEvent  # noqa: E402
from kvctl.daemon.engine.requests import SeqStatus  # noqa: E402
from kvctl.daemon.engine.sampling import SamplingParams  # noqa: E402
from kvctl.daemon.engine.tenant_book import REJECTED  # noqa: E402

from .conftest import FakeClock  # noqa: E402
from .test_engine import all_blocks_back, demo  # noqa: E402,F401

LONG = SamplingParams(max_tokens=40, ignore_eos=True)


def test_requests_waiting_past_the_limit_are_turned_away_and_nothing_else_is(demo):  # noqa: F811
    clock = FakeClock(100.0)
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_running=1, max_queue_wait=5.0),
                    clock=clock)
    running = engine.add_request(list(range(20)), LONG)
    engine.step()  # admitted: it runs, the rest wait behind it
    late = [engine.add_request(list(range(30, 50)), LONG, tenant="acme"),
            engine.add_request(list(range(60, 80)), LONG)]
    clock.advance(3.0)
    engine.step()
    recent = engine.add_request(list(range(90, 110)), LONG)
    clock.advance(2.5)
    events = engine.step()
    assert [e for e in events if e.finish_reason == "error"] == [
        TokenEvent(r.request_id, 0, None, "error") for r in late]
    for request in late:
        assert request.rejected_kind == "queue_timeout"
        assert request.rejected == (f"request {request.request_id}: waited 5.5 s without being admitted, "
                                    "max_queue_wait 5 s (1 running, 3 waiting); try again later or elsewhere")
        assert request.metrics.admitted is None and request.sequences[0].finish_reason == "error"
    assert engine.stats.rejections == {"queue_timeout": 2}
    assert engine.stats.tenants.row("acme")[REJECTED] == 1  # each tenant's rejections count it too
    assert running.sequences[0].status is SeqStatus.DECODE and recent.sequences[0].status is SeqStatus.WAITING
    assert [s.request.request_id for s in engine.waiting()] == [recent.request_id]
    # a limit of 0 waits for ever, and a reload's change applies at the next step
    engine.settings = dataclasses.replace(engine.settings, max_queue_wait=0.0)
    clock.advance(60.0)
    engine.step()
    assert recent.rejected is None and recent.sequences[0].status is SeqStatus.WAITING
    engine.settings = dataclasses.replace(engine.settings, max_queue_wait=5.0)
    engine.admission_paused = True  # the queue is not served (new weights on the way): it times out all the same
    assert [e.request_id for e in engine.step() if e.finish_reason == "error"] == [recent.request_id]
    engine.admission_paused = False
    engine.run_until_done()
    assert running.sequences[0].finish_reason == "length" and len(running.sequences[0].output_ids) == 40
    assert all_blocks_back(engine)


def test_a_request_admitted_once_waits_on_when_preempted(demo):  # noqa: F811
    clock = FakeClock(0.0)
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_running=1, max_queue_wait=1.0),
                    clock=clock)
    first = engine.add_request(list(range(20)), LONG)
    engine.step()
    engine._preempt(first.sequences[0])  # back in the queue, its blocks given back
    assert first.sequences[0].status is SeqStatus.WAITING and first.metrics.admitted is not None
    clock.advance(30.0)
    assert [e for e in engine.step() if e.finish_reason == "error"] == []
    assert first.rejected is None
    engine.run_until_done()
    assert first.sequences[0].finish_reason == "length"


def test_kvd_answers_a_timed_out_request_with_a_503_or_an_error_event_and_counts_it(tmp_path, caplog):
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import call, sse_events, start_service

    service = start_service(tmp_path, max_queue_wait=0.3, log_requests=True)
    try:
        app = create_app(service, service.metrics, front="unix")
        with service.lock:
            service.engine.admission_paused = True  # nothing is admitted: each request waits until its limit
        with caplog.at_level(logging.INFO, logger="kvd"):
            started = time.monotonic()
            answer = call(app, "POST", "/v1/completions", json={"prompt": "word " * 20, "max_tokens": 4})
            waited = time.monotonic() - started
            streamed = call(app, "POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True})
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        error = answer.json()["error"]
        assert (error["code"], error["type"]) == ("queue_timeout", "server_error")
        request_id = answer.headers["x-kvd-request-id"]
        assert error["message"].startswith(f"request {request_id}: waited 0.")
        assert error["message"].endswith("without being admitted, max_queue_wait 0.3 s (0 running, 1 waiting); "
                                         "try again later or elsewhere")
        assert waited >= 0.3  # not turned away before its limit
        assert streamed.status_code == 200  # the stream had begun: the error is its last event
        events = sse_events(streamed)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "queue_timeout"
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"request request_id={request_id}")]
        assert len(lines) == 1 and " finish=rejected rejected=queue_timeout " in lines[0]
        assert any("turned away after waiting max_queue_wait (0.3 s)" in r.getMessage() for r in caplog.records)
        scraped = call(app, "GET", "/metrics").text.splitlines()
        assert 'kvd_admission_rejections_total{reason="queue_timeout"} 2.0' in scraped
        status = call(app, "GET", "/admin/status").json()
        assert status["rejections"] == {"queue_timeout": 2} and status["queue"]["max_queue_wait_seconds"] == 0.3
        with service.lock:
            service.engine.admission_paused = False
        assert call(app, "POST", "/v1/completions", json={"prompt": "word", "max_tokens": 2}).status_code == 200
    finally:
        service.shutdown(deadline=2)


def test_the_setting_is_checked_and_live_on_a_reload(tmp_path):
    from kvctl.daemon.config import ConfigError, resolve

    with pytest.raises(ConfigError) as refused:
        resolve({"max_queue_wait": -1}, env={})
    assert str(refused.value) == ("max_queue_wait: invalid value -1 from --max-queue-wait: must be a number of "
                                  "seconds >= 0 (0: no limit)")
    assert resolve({}, env={"KVD_MAX_QUEUE_WAIT": "30"}).max_queue_wait == 30.0
    from kvctl.daemon.server.reload_ops import LIVE_SETTINGS

    assert "max_queue_wait" in LIVE_SETTINGS


def test_kvd_router_takes_a_timed_out_request_to_another_replica(tmp_path):
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import start_service
    from .test_router import drive, router_app

    stuck, free = (start_service(tmp_path / name, max_queue_wait=0.3) for name in ("stuck", "free"))
    try:
        with stuck.lock:
            stuck.engine.admission_paused = True
        _, front = router_app([create_app(s, s.metrics, front="unix") for s in (stuck, free)], routing="round_robin")
        [answer] = drive(front, [lambda c: c.post("/v1/completions", json={"prompt": "word " * 8, "max_tokens": 2})])
        assert answer.status_code == 200 and answer.headers["x-kvd-replica"] == "replica-1"
        assert answer.headers["x-kvd-tried"] == "replica-0 (503)"
        assert stuck.engine.stats.rejections == {"queue_timeout": 1}
    finally:
        for service in (stuck, free):
            service.shutdown(deadline=2)
