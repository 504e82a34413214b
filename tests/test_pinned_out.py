"""Pins and admission: pinned blocks are never evicted, so a request the operator's pins leave no
room for could never finish. It is turned away (at its arrival, or at the head of the queue when
the pins came after it) instead of holding every request behind it for as long as the pins stand."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")

from kvctl.daemon.engine.engine import AdmissionRejected, Engine, EngineSettings, TokenEvent  # noqa: E402
from kvctl.daemon.engine.sampling import SamplingParams  # noqa: E402
from kvctl.daemon.engine.tenant_book import REJECTED  # noqa: E402
from kvctl.daemon.model.demo import ensure_demo_checkpoint  # noqa: E402
from kvctl.daemon.model.llama import load_model  # noqa: E402

from .daemon_fixtures import apps, blocks_all_back, call, sse_events, start_service, token_table  # noqa: E402

PINNED = list(range(3, 83))  # 80 tokens: five full blocks of 16


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return load_model(ensure_demo_checkpoint(tmp_path_factory.mktemp("state")))


def cached_prefix(demo, **settings) -> Engine:
    """An engine of 8 blocks of 16 whose cache holds PINNED's five blocks, idle and not pinned."""
    engine = Engine(demo, EngineSettings(num_blocks=8, block_size=16, **settings))
    engine.add_request(PINNED, SamplingParams(max_tokens=1, ignore_eos=True))
    engine.run_until_done()
    assert len(engine.cache.pool.match(engine.prefix_keys("default", PINNED)[2])) == 5
    return engine


def pin(engine: Engine) -> None:
    engine.cache.pins.budgets["default"] = 8  # (by default, a tenant may pin half the cache)
    result = engine.cache.pin(engine.namespace("default", ""), PINNED)
    assert (len(result.pin.keys), result.cached_blocks) == (5, 5)


def test_a_request_the_pins_leave_too_little_room_is_turned_away_at_arrival_and_its_prefix_s_pins_count_as_room(demo):
    engine = cached_prefix(demo)
    pin(engine)
    before = engine.cache.state_counts()
    assert before["pinned"] == 5
    with pytest.raises(AdmissionRejected) as info:  # 20 + 40 tokens: 4 blocks, 3 beside the pins
        engine.add_request(list(range(100, 120)), SamplingParams(max_tokens=40), request_id="big")
    assert str(info.value) == ("request big: needs 4 blocks but pins hold 5 of the cache's 8 outside its prefix, "
                               "leaving 3; it could never finish: unpin some (kvctl pins, kvctl unpin) or lower "
                               "max_tokens")
    assert info.value.kind == "pinned_out" and engine.stats.rejections == {"pinned_out": 1}
    assert engine.cache.state_counts() == before and not engine.has_work()  # nothing queued, nothing taken
    assert engine.stats.tenants.row("default")[REJECTED] == 1  # counted against its tenant
    # 3 blocks fit beside the pins; and a prompt that starts with the pinned prefix has its pins as room
    small = engine.add_request(list(range(100, 120)), SamplingParams(max_tokens=28, ignore_eos=True))
    extends = engine.add_request(PINNED + list(range(120, 140)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.run_until_done()
    assert [len(r.sequences[0].output_ids) for r in (small, extends)] == [28, 20]
    assert extends.metrics.cached_tokens == 80
    engine.cache.audit()
    assert engine.cache.state_counts()["pinned"] == 5


def test_the_pins_counted_against_a_request_are_those_outside_the_prefix_it_shares(demo):
    engine = cached_prefix(demo)
    pin(engine)  # five blocks; a prompt that shares the first two has the other three against it
    with pytest.raises(AdmissionRejected) as info:  # 52 + 40 tokens: 6 blocks
        engine.add_request(PINNED[:32] + list(range(100, 120)), SamplingParams(max_tokens=40), request_id="shares")
    assert str(info.value).startswith("request shares: needs 6 blocks but pins hold 3 of the cache's 8 outside its "
                                      "prefix, leaving 5;")
    fits = engine.add_request(PINNED[:32] + list(range(100, 120)), SamplingParams(max_tokens=28, ignore_eos=True))
    engine.run_until_done()
    assert len(fits.sequences[0].output_ids) == 28 and fits.metrics.cached_tokens == 32


def test_a_queued_request_that_pins_came_to_keep_out_ends_with_error_and_the_queue_moves_on(demo):
    engine = cached_prefix(demo, max_running=1)
    engine.add_request(list(range(140, 150)), SamplingParams(max_tokens=2, ignore_eos=True), request_id="first")
    # n=2, 20 + 40 tokens each: fits the 8 blocks when it comes, and queues behind "first"
    big = engine.add_request(list(range(100, 120)), SamplingParams(max_tokens=40, n=2, ignore_eos=True),
                             request_id="big")
    behind = engine.add_request(list(range(150, 170)), SamplingParams(max_tokens=4, ignore_eos=True),
                                request_id="behind")
    pin(engine)  # now "big" needs 4 blocks of the 3 the pins leave, and will never have them
    events = []
    for _ in range(200):
        if not engine.has_work():
            break
        events += engine.step()
        engine.cache.audit()
    turned_away = [e for e in events if e.request_id == "big"]
    assert turned_away == [TokenEvent("big", 0, None, "error"), TokenEvent("big", 1, None, "error")]
    assert big.finished and big.rejected == (
        "request big: needs 4 blocks but pins hold 5 of the cache's 8 and nothing runs that could give one back, "
        "leaving 3; it could never finish: unpin some (kvctl pins, kvctl unpin) or lower max_tokens")
    assert [s.finish_reason for s in big.sequences] == ["error"]  # its second sample never forked
    assert len(behind.sequences[0].output_ids) == 4 and behind.sequences[0].finish_reason == "length"
    assert engine.stats.rejections == {"pinned_out": 1}
    assert engine.cache.state_counts()["pinned"] == 5 and engine.cache.num_sequences == 0


def test_a_request_waits_while_others_run_however_the_pins_stand(demo):
    """Blocks held by running requests come back: only with nothing running is a request that does not
    fit kept out by the pins alone."""
    engine = cached_prefix(demo)
    pin(engine)
    running = engine.add_request(list(range(170, 190)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    waiting = engine.add_request(list(range(100, 120)), SamplingParams(max_tokens=28, ignore_eos=True))
    events = []
    while engine.has_work():
        events += engine.step()
    assert not [e for e in events if e.finish_reason == "error"]
    assert [len(r.sequences[0].output_ids) for r in (running, waiting)] == [20, 28]
    assert engine.stats.rejections == {}


def test_the_api_answers_503_pinned_out_at_arrival_and_when_pins_came_while_it_waited(tmp_path):
    service = start_service(tmp_path, num_blocks=8, pin_budget_blocks=8, pin_room_tokens=0)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        engine = service.engine
        pinned = call(unix, "POST", "/admin/pins", json={"tokens": PINNED}).json()
        assert (pinned["blocks"], pinned["cached_blocks"]) == (5, 5)
        body = {"prompt": list(range(100, 116)), "max_tokens": 33, "temperature": 0}  # 49 tokens: 4 blocks
        refused = call(unix, "POST", "/v1/completions", json=body)
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert (error["code"], error["type"], error["param"]) == ("pinned_out", "server_error", None)
        assert error["message"].endswith("needs 4 blocks but pins hold 5 of the cache's 8 outside its prefix, leaving "
                                         "3; it could never finish: unpin some (kvctl pins, kvctl unpin) or lower "
                                         "max_tokens")
        assert call(unix, "GET", "/admin/pins").json()["room"] == {"pinned_blocks": 5, "num_blocks": 8,
                                                                   "room_blocks": 3, "block_size": 16,
                                                                   "pin_room_tokens": 0, "pin_room_blocks": 0}
        assert call(unix, "DELETE", f"/admin/pins/{pinned['pin_id']}").status_code == 200

        answers = {}
        with service.lock:
            engine.admission_paused = True  # they wait in the queue while the pin comes back

        def ask(name, stream):
            answers[name] = call(unix, "POST", "/v1/completions", json={**body, "stream": stream})

        askers = [threading.Thread(target=ask, args=(name, name == "stream")) for name in ("plain", "stream")]
        for asker in askers:
            asker.start()
        for _ in range(600):
            with service.lock:
                if len(engine.waiting()) == 2:
                    break
            time.sleep(0.05)
        assert call(unix, "POST", "/admin/pins", json={"tokens": PINNED}).json()["cached_blocks"] == 5
        with service.lock:
            engine.admission_paused = False
            service.lock.notify_all()
        for asker in askers:
            asker.join(60)
        plain = answers["plain"]
        assert plain.status_code == 503 and plain.json()["error"]["code"] == "pinned_out"
        assert "and nothing runs that could give one back" in plain.json()["error"]["message"]
        streamed = sse_events(answers["stream"])
        assert streamed[0]["choices"][0]["finish_reason"] == "error"
        assert streamed[1]["error"]["code"] == "pinned_out" and streamed[-1] == "[DONE]"
        metrics = call(unix, "GET", "/metrics").text
        assert 'kvd_admission_rejections_total{reason="pinned_out"} 3.0' in metrics
        assert blocks_all_back(service)
    finally:
        service.shutdown(1)


def test_the_router_passes_a_pinned_out_refusal_on_and_counts_it_as_traced_by_its_replica(tmp_path):
    """A replica's 503 for pins is a turn-away it keeps a trace line of (a stopping replica's 503 keeps
    none): the router tries the next replica, and where none takes it, answers the refusal as it came."""
    from .test_router import drive, post, router_app

    replica = start_service(tmp_path, num_blocks=8, pin_budget_blocks=8, pin_room_tokens=0)
    try:
        unix, _ = apps(replica, token_table(tmp_path))
        assert call(unix, "POST", "/admin/pins", json={"tokens": PINNED}).json()["cached_blocks"] == 5
        router, app = router_app([unix], "round_robin")
        [answer] = drive(app, [lambda c: post(c, list(range(100, 116)), max_tokens=33)])
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "pinned_out"
        assert answer.headers["x-kvd-tried"] == "replica-0 (503)"
        assert list(router.untraced) == []
        warm, refused = call(unix, "GET", "/admin/trace").json()["requests"]  # the pin's warm, then this one
        assert (refused["input_length"], refused["output_length"]) == (16, 0)
    finally:
        replica.shutdown(1)


def test_a_pin_whose_warm_was_turned_away_in_the_queue_says_it_was_not_warmed(tmp_path, monkeypatch):
    """Other pins that came while the warm waited can turn it away ("error"): the pin stands unwarmed."""
    service = start_service(tmp_path, num_blocks=8, pin_budget_blocks=8, pin_room_tokens=0)
    try:
        unix, _ = apps(service, token_table(tmp_path))

        def turned_away(prompts, params, principal, sink, adapter):
            sink(TokenEvent("req-warm", 0, None, "error"))
            return []

        monkeypatch.setattr(service, "submit", turned_away)
        pinned = call(unix, "POST", "/admin/pins", json={"tokens": PINNED}).json()
        assert (pinned["warmed"], pinned["blocks"], pinned["cached_blocks"]) == (False, 5, 0)
    finally:
        service.shutdown(1)


def _pin_row(pin_id: str = "pin-00000000000000a1") -> dict:
    return {"pin_id": pin_id, "tenant": "default", "blocks": 5, "cached_blocks": 5, "owner": "ops", "note": "",
            "expires_at": None, "expires_in_seconds": None, "space": "ef" * 32, "adapter_id": "", "model": "kvd-demo",
            "stranded": None}


def test_kvctl_pins_says_how_much_room_the_pins_leave_a_request_and_at_the_router_the_least():
    from kvctl.daemon.server.fleet_admin import merge_pin_lists

    from .test_router import _kvctl_prints

    room = {"pinned_blocks": 5, "num_blocks": 8, "room_blocks": 3, "block_size": 16}
    said = " ".join(_kvctl_prints(["pins"], {"pins": [_pin_row()], "room": room}).split())
    assert said.endswith("pins hold 5 of the cache's 8 blocks: a request may take 3 beside them (48 tokens of prompt "
                         "and max_tokens past a pinned prefix it starts with); one that needs more is turned away "
                         "(pinned_out)")
    unpinned = {"pinned_blocks": 0, "num_blocks": 8, "room_blocks": 8, "block_size": 16}
    assert _kvctl_prints(["pins"], {"pins": [], "room": unpinned}).strip() == "no pins"
    roomy = {"pinned_blocks": 5, "num_blocks": 64, "room_blocks": 59, "block_size": 16}
    status, fleet = merge_pin_lists(["replica-0", "replica-1"], [(200, {"pins": [_pin_row()], "room": roomy}),
                                                                (200, {"pins": [_pin_row()], "room": room})])
    assert status == 200 and fleet["room"] == {**room, "replica": "replica-1"}
    said = " ".join(_kvctl_prints(["pins"], fleet).split())
    assert "pins hold 5 of the cache's 8 blocks on replica-1, the fleet's least: a request may take 3 beside" in said
