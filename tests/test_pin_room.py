"""Pins leave room for a request: a new pin that would leave fewer blocks beside the pins than
`pin_room_tokens` keeps is refused whole (409, audited, nothing pinned or warmed); pins that
stand (restored at a start, or made before a reload raised the room) stay, with a warning."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from kvctl.daemon.cache import InvalidRequest, Namespace, PinLeavesNoRoom
from kvctl.daemon.server.calls import ServiceError

from .conftest import make_manager, run_prompt
from .daemon_fixtures import call, failed_start, start_service

ACME, GLOBEX = Namespace(block_size=4, tenant="acme"), Namespace(block_size=4, tenant="globex")


def test_a_pin_that_would_leave_less_room_than_kept_is_refused_and_nothing_is_pinned():
    m = make_manager(num_blocks=10, block_size=4, pin_budget_blocks=10)
    m.set_pin_room(16)  # 4 blocks of 4 tokens
    assert (m.pin_room_tokens, m.pin_room_blocks) == (16, 4)
    m.pin(ACME, list(range(0, 16)))  # 4 blocks: 6 left
    before = (m.pins.all(), m.pool.num_pin_keys, m.pins.used("globex"))
    with pytest.raises(PinLeavesNoRoom) as info:
        m.pin(GLOBEX, list(range(100, 112)))  # 3 more: 7 pinned, 3 left
    assert str(info.value) == ("this pin adds 3 blocks, so pins would hold 7 of the cache's 10, leaving 3, and pins "
                               "must leave 4 for requests")
    assert (m.pins.all(), m.pool.num_pin_keys, m.pins.used("globex")) == before  # nothing half-added
    m.pin(GLOBEX, list(range(100, 108)))  # 2 more: 6 pinned, 4 left, as kept
    assert m.pool.num_pin_keys == 6
    # keys another pin holds already cost no room: globex pins acme's prefix, under its own budget
    m.pin_keys("globex", m.keys_to_pin(ACME, list(range(0, 16))))
    assert (m.pool.num_pin_keys, m.pins.used("globex")) == (6, 6)
    with pytest.raises(PinLeavesNoRoom):
        m.pin(ACME, list(range(200, 204)))
    # a pin made again (its TTL or note refreshed) adds nothing, even past the room kept now
    m.set_pin_room(40)
    assert m.pin(ACME, list(range(0, 16)), note="still").refreshed
    # a pin restored as it stood is not refused (the daemon warns instead)
    restored = m.pin_keys("acme", m.keys_to_pin(ACME, list(range(200, 204))), leave_room=False)
    assert not restored.refreshed and m.pool.num_pin_keys == 7
    m.set_pin_room(0)  # none kept
    m.pin(ACME, list(range(300, 312)))
    assert m.pool.num_pin_keys == 10
    m.audit()


def test_a_pin_s_pending_keys_count_against_the_room_as_its_cached_blocks_do():
    m = make_manager(num_blocks=10, block_size=4, pin_budget_blocks=10)
    m.set_pin_room(20)  # 5 blocks
    run_prompt(m, "r1", list(range(0, 8)), namespace=ACME)
    m.release("r1")
    result = m.pin(ACME, list(range(0, 20)))  # 2 blocks cached, 3 to come: 5 pinned keys
    assert (result.cached_blocks, result.pending_blocks, m.pool.num_pin_keys) == (2, 3, 5)
    with pytest.raises(PinLeavesNoRoom) as info:
        m.pin(GLOBEX, list(range(100, 104)))
    assert str(info.value).startswith("this pin adds 1 blocks, so pins would hold 6 of the cache's 10, leaving 4,")


def test_the_room_kept_is_checked_and_counts_a_window_s_blocks():
    m = make_manager(num_blocks=10, block_size=4)
    for bad in (-1, 41, 2.5, True):
        with pytest.raises(InvalidRequest) as info:
            m.set_pin_room(bad)
        assert str(info.value) == ("pin_room_tokens: must be a whole number of tokens from 0 to what the cache "
                                   f"holds (10 blocks of 4: 40), got {bad!r}")
    assert m.pin_room_tokens == 0
    # a sequence that slides a window of 8 tokens, 4 at a step, holds 4 blocks at most, however long
    sliding = make_manager(num_blocks=10, block_size=4, window=8, step_tokens=4)
    sliding.set_pin_room(40)
    assert (sliding.pin_room_blocks, sliding.peak_blocks(40)) == (sliding.window_blocks, sliding.window_blocks)
    assert sliding.window_blocks < 10


PINNED = list(range(3, 83))  # 80 tokens: 5 blocks of 16


def test_kvd_refuses_a_pin_that_leaves_too_little_room_with_a_409_naming_the_setting(tmp_path):
    # 8 blocks of 16 tokens; by default pins leave half the cache (the context served is longer): 64 tokens
    service = start_service(tmp_path, num_blocks=8, pin_budget_blocks=8)
    try:
        from kvctl.daemon.server.app import create_app
        unix = create_app(service, service.metrics, front="unix")
        refused = call(unix, "POST", "/admin/pins", json={"tokens": PINNED, "note": "five blocks"})
        assert refused.status_code == 409
        error = refused.json()["error"]
        assert error["param"] == "pin_room_tokens"
        assert error["message"] == (
            "pin: this pin adds 5 blocks, so pins would hold 5 of the cache's 8, leaving 3, and pins must leave 4 "
            "for requests (pin_room_tokens: 64 tokens, in blocks of 16), so that a request that starts with no "
            "pinned prefix can always finish: unpin some (kvctl pins, kvctl unpin), pin a shorter prefix, or lower "
            "pin_room_tokens")
        # refused before anything was computed or pinned, and audited
        assert call(unix, "GET", "/admin/pins").json()["pins"] == []
        assert service.engine.cache.pool.num_pin_keys == 0 and service.engine.cache.state_counts()["cached"] == 0
        [record] = service.store.audit_since(action="pin")
        assert (record["result"], record["target"]) == ("refused", "-")
        # four blocks leave the four kept: taken, warmed, and a request needing those four runs
        taken = call(unix, "POST", "/admin/pins", json={"tokens": PINNED[:64]})
        assert taken.status_code == 200 and (taken.json()["blocks"], taken.json()["cached_blocks"]) == (4, 4)
        room = call(unix, "GET", "/admin/pins").json()["room"]
        assert room == {"pinned_blocks": 4, "num_blocks": 8, "room_blocks": 4, "block_size": 16,
                        "pin_room_tokens": 64, "pin_room_blocks": 4}
        done = call(unix, "POST", "/v1/completions", json={"prompt": list(range(100, 132)), "max_tokens": 32,
                                                           "temperature": 0, "ignore_eos": True})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 32
    finally:
        service.shutdown(deadline=2)


def test_the_room_defaults_to_the_context_served_where_that_is_less_than_half_the_cache(tmp_path):
    service = start_service(tmp_path, num_blocks=8, pin_budget_blocks=8, max_model_len=32)
    try:
        cache = service.engine.cache
        assert (cache.pin_room_tokens, cache.pin_room_blocks) == (32, 2)
        assert cache.pins.default_budget == 8
    finally:
        service.shutdown(deadline=2)


def pinned_with_no_room_kept(tmp_path):
    """kvd on 8 blocks keeping no room beside the pins, PINNED pinned (5 blocks): (service, its
    unix app, the pin's answer)."""
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=8, pin_budget_blocks=8, pin_room_tokens=0)
    unix = create_app(service, service.metrics, front="unix")
    pinned = call(unix, "POST", "/admin/pins", json={"tokens": PINNED})
    assert pinned.status_code == 200 and pinned.json()["blocks"] == 5
    return service, unix, pinned.json()


def test_a_reload_sets_the_room_refuses_more_than_the_cache_and_keeps_the_pins_that_stand(tmp_path, caplog):
    service, unix, _ = pinned_with_no_room_kept(tmp_path)
    try:
        with pytest.raises(ServiceError) as info:
            service.reload(replace(service.config, pin_room_tokens=129, max_queue=7))
        assert (info.value.status, info.value.param) == (400, "pin_room_tokens")
        assert str(info.value) == ("reload refused, nothing changed: pin_room_tokens: 129 is more than the cache "
                                   "holds (8 blocks of 16 tokens: 128)")
        assert (service.config.max_queue, service.engine.cache.pin_room_tokens) == (256, 0)
        with caplog.at_level(logging.WARNING, logger="kvd"):
            result = service.reload(replace(service.config, pin_room_tokens=64))
        assert result["changed"] == {"pin_room_tokens": 64}
        assert ("pins hold 5 of the cache's 8 blocks, leaving 3, fewer than pin_room_tokens (64 tokens: 4 blocks) "
                "keeps: new pins are refused until some are unpinned") in caplog.messages
        assert [p["blocks"] for p in call(unix, "GET", "/admin/pins").json()["pins"]] == [5]  # it stays
        refused = call(unix, "POST", "/admin/pins", json={"tokens": list(range(200, 216))})
        assert refused.status_code == 409 and refused.json()["error"]["param"] == "pin_room_tokens"
        # back to the default: half the cache's blocks per tenant and room for half the cache
        service.reload(replace(service.config, pin_room_tokens=None, pin_budget_blocks=None))
        assert (service.engine.cache.pins.default_budget, service.engine.cache.pin_room_tokens) == (4, 64)
    finally:
        service.shutdown(deadline=2)


def test_pins_restored_at_a_start_stand_past_the_room_and_kvd_warns(tmp_path, caplog):
    service, _, pinned = pinned_with_no_room_kept(tmp_path)
    service.shutdown(deadline=2)
    with caplog.at_level(logging.WARNING, logger="kvd"):
        again = start_service(tmp_path, num_blocks=8, pin_budget_blocks=8, pin_room_tokens=96)
    try:
        assert [p.pin_id for p in again.engine.cache.pins.all()] == [pinned["pin_id"]]
        assert ("pins hold 5 of the cache's 8 blocks, leaving 3, fewer than pin_room_tokens (96 tokens: 6 blocks) "
                "keeps: new pins are refused until some are unpinned") in caplog.messages
    finally:
        again.shutdown(deadline=2)


def test_a_start_with_more_room_than_the_cache_holds_fails_naming_the_setting(tmp_path):
    error = failed_start(tmp_path, num_blocks=8, pin_room_tokens=200)
    assert "pin_room_tokens: 200 is more than the cache holds (8 blocks of 16 tokens: 128)" in error


def test_kvctl_pins_says_what_room_a_new_pin_must_leave():
    from .test_pinned_out import _pin_row
    from .test_router import _kvctl_prints

    room = {"pinned_blocks": 4, "num_blocks": 8, "room_blocks": 4, "block_size": 16, "pin_room_tokens": 64,
            "pin_room_blocks": 4}
    said = " ".join(_kvctl_prints(["pins"], {"pins": [_pin_row()], "room": room}).split())
    assert said.endswith("pins hold 4 of the cache's 8 blocks: a request may take 4 beside them (64 tokens of prompt "
                         "and max_tokens past a pinned prefix it starts with); one that needs more is turned away "
                         "(pinned_out); a new pin that would leave fewer than 4 is refused (pin_room_tokens: 64)")
