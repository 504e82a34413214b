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
        assert 'kvd_tenant_rejected_requests_total{tenant="default"} 2.0' in scraped  # whose
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


def test_tenants_with_queue_wait_limits_of_their_own_are_turned_away_by_theirs(demo):  # noqa: F811
    """max_queue_wait 10 s; vip may wait 2 s, batch 60 s, and chat without end (0). Each is turned
    away by its own limit, named in its answer; the default tenant by max_queue_wait."""
    clock = FakeClock(100.0)
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_running=1, max_queue_wait=10.0,
                                         tenant_queue_waits=(("batch", 60.0), ("chat", 0.0), ("vip", 2.0))),
                    clock=clock)
    engine.add_request(list(range(20)), SamplingParams(max_tokens=400, ignore_eos=True))
    engine.step()  # it runs; the rest wait behind it
    waiting = {tenant: engine.add_request(list(range(30 + 20 * i, 50 + 20 * i)), LONG, tenant=tenant)
               for i, tenant in enumerate(("default", "batch", "chat", "vip"))}
    assert [engine.queue_wait_limit(t) for t in ("default", "batch", "chat", "vip", "acme")] == [10, 60, 0, 2, 10]
    turned_away = []
    for advance in (2.5, 8.0, 50.0, 500.0):
        clock.advance(advance)
        engine.step()
        turned_away.append(sorted(t for t, r in waiting.items() if r.rejected and t not in sum(turned_away, [])))
    assert turned_away == [["vip"], ["default"], ["batch"], []]  # at 2.5 s, 10.5 s, 60.5 s; chat waits on
    assert waiting["vip"].rejected == (f"request {waiting['vip'].request_id}: waited 2.5 s without being admitted, "
                                       "tenant_queue_waits[vip] 2 s (1 running, 4 waiting); try again later or "
                                       "elsewhere")
    assert "max_queue_wait 10 s (1 running, 3 waiting)" in waiting["default"].rejected
    assert "tenant_queue_waits[batch] 60 s (1 running, 2 waiting)" in waiting["batch"].rejected
    assert waiting["chat"].rejected is None and waiting["chat"].sequences[0].status is SeqStatus.WAITING
    # the queue figures a route-facts answer gives: each tenant's limit, and the tenants' own for a router's view
    figures = engine.queue_figures(tenant="vip")
    assert figures["max_queue_wait_seconds"] == 2.0
    assert engine.queue_figures(tenant="chat")["max_queue_wait_seconds"] is None
    assert engine.queue_figures()["max_queue_wait_seconds"] == 10.0
    assert figures["tenant_queue_waits"] == {"batch": 60.0, "chat": 0.0, "vip": 2.0}
    # a reload's new limits apply at once: chat's own 5 s turns its request away at the next step
    engine.settings = dataclasses.replace(engine.settings, tenant_queue_waits=(("chat", 5.0),))
    assert [engine.queue_wait_limit(t) for t in ("batch", "chat", "vip")] == [10, 5, 10]
    engine.step()
    assert "tenant_queue_waits[chat] 5 s" in waiting["chat"].rejected
    for request in list(engine.requests.values()):
        engine.cancel(request.request_id)
    assert all_blocks_back(engine)


@pytest.mark.parametrize("tenant, admitted", [("vip", ["C", "B"]), ("chat", ["B", "C"])])
def test_under_lpm_a_tenant_without_a_queue_wait_limit_goes_first_after_lpm_s_patience(demo, tenant,  # noqa: F811
                                                                                       admitted):
    """B (a prompt nobody shares, of `tenant`) waits 30 s, then C (opening with a cached prompt)
    comes. A tenant with a limit of its own waits by lpm's order until the limit (none is 30 s
    here), as under max_queue_wait; one whose limit is 0 (none) goes first after lpm's 30 s of
    patience, as without max_queue_wait."""
    clock = FakeClock(100.0)
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, max_running=1, queue_order="lpm",
                                         max_queue_wait=0.0, tenant_queue_waits=(("chat", 0.0), ("vip", 40.0))),
                    clock=clock)
    shared = list(range(1, 33))
    once = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.add_request(shared + [40], once)
    engine.run_until_done()
    engine.add_request([50] * 5, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # it holds the slot
    waiting = {"B": engine.add_request(list(range(100, 140)), once, tenant=tenant)}
    clock.advance(30.0)
    waiting["C"] = engine.add_request(shared + [41, 42], once)
    seen = []
    while engine.has_work():
        engine.step()
        clock.advance(0.01)
        seen += [name for name, r in waiting.items() if r.metrics.admitted is not None and name not in seen]
    assert seen == admitted and not any(r.rejected for r in waiting.values())


def test_kvd_turns_a_tenant_s_request_away_by_its_own_limit_and_counts_it_against_it(tmp_path):
    """No max_queue_wait; batch's own 0.3 s: a request of batch's is answered 503 naming its
    tenant's limit, one of acme's waits on; the tenant's rejections are in the metrics."""
    import threading

    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import call, start_service

    service = start_service(tmp_path, tenant_queue_waits="batch=0.3")
    try:
        app = create_app(service, service.metrics, front="unix")
        with service.lock:
            service.engine.admission_paused = True  # nothing is admitted: each request waits
        answers = {}

        def ask(tenant):
            answers[tenant] = call(app, "POST", "/v1/completions", headers={"X-KVD-Tenant": tenant},
                                   json={"prompt": "word " * 20, "max_tokens": 2})

        acme = threading.Thread(target=ask, args=("acme",))
        acme.start()
        ask("batch")
        assert answers["batch"].status_code == 503
        message = answers["batch"].json()["error"]["message"]
        assert message.endswith("without being admitted, tenant_queue_waits[batch] 0.3 s (0 running, 2 waiting); "
                                "try again later or elsewhere")
        assert acme.is_alive()  # acme's has no limit: it waits on
        scraped = call(app, "GET", "/metrics").text.splitlines()
        assert 'kvd_tenant_rejected_requests_total{tenant="batch"} 1.0' in scraped
        with service.lock:
            service.engine.admission_paused = False
        acme.join(30)
        assert answers["acme"].status_code == 200
    finally:
        service.shutdown(deadline=2)


def test_tenant_queue_waits_are_checked_and_live_on_a_reload():
    from kvctl.daemon.config import ConfigError, resolve
    from kvctl.daemon.server.reload_ops import LIVE_SETTINGS

    assert resolve({"tenant_queue_waits": "batch=600,chat=0"}, env={}).tenant_queue_waits == (
        ("batch", 600.0), ("chat", 0.0))
    assert resolve({"tenant_queue_waits": {"vip": 2.5}}, env={}).tenant_queue_waits == (("vip", 2.5),)
    assert resolve({}, env={"KVD_TENANT_QUEUE_WAITS": "batch=60"}).tenant_queue_waits == (("batch", 60.0),)
    for value, why in (("batch=-1", "queue wait of 'batch' must be a number of seconds >= 0 (0: no limit), got '-1'"),
                       ("batch=soon", "queue wait of 'batch' must be a number of seconds >= 0 (0: no limit), got "
                                      "'soon'"),
                       ("batch=inf", "queue wait of 'batch' must be a number of seconds >= 0 (0: no limit), got 'inf'"),
                       ("batch", "expected TENANT=SECONDS, got 'batch'")):
        with pytest.raises(ConfigError) as refused:
            resolve({"tenant_queue_waits": value}, env={})
        assert str(refused.value) == (f"tenant_queue_waits: invalid value {value!r} from --tenant-queue-waits: {why}")
    assert "tenant_queue_waits" in LIVE_SETTINGS


def test_any_queue_wait_says_whether_a_request_can_time_out_waiting():
    from kvctl.policies.tenant_map import any_queue_wait

    assert [any_queue_wait(wait, own) for wait, own in (
        (0.0, ()), (30.0, ()), (0.0, (("batch", 0.0),)), (0.0, (("batch", 0.0), ("chat", 10.0))))] == [
        False, True, False, True]
