"""Requests' prompt cache breakpoint holds across kvd's stop and start (breakpoint_holds_file.py):
written as kvd stops, held again as it starts for what is left of their time, after the
operator's pins; lapsed ones and those past the tenant's pin budget are not."""

from __future__ import annotations

import json
import logging
import stat
import time

import pytest

from kvctl.daemon.cache import Namespace, chain_keys
from kvctl.daemon.server.breakpoint_holds_file import FILE_NAME, restore_holds, save_holds

from .conftest import FakeClock, make_manager

PROMPT = list(range(100, 124))
ACME = Namespace(block_size=4, tenant="acme")
GLOBEX = Namespace(block_size=4, tenant="globex")


def test_the_holds_are_written_at_the_stop_and_held_again_for_what_is_left_of_their_time(tmp_path):
    before = make_manager(clock=FakeClock(5_000.0))
    before.pin_keys("acme", chain_keys(ACME, PROMPT)[:1], owner="ops", note="system prompt")  # (stored elsewhere)
    assert before.hold("acme", chain_keys(ACME, PROMPT)[:3], 43_200.0) == "held"
    assert before.hold("globex", chain_keys(GLOBEX, PROMPT)[:2], 1_800.0, space="ab12", adapter_id="") == "held"
    before._clock.advance(600)
    assert save_holds(before.pins.all(), before._clock(), tmp_path) == 2
    path = tmp_path / FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    written = json.loads(path.read_text())
    assert written["version"] == 1 and [hold["tenant"] for hold in written["holds"]] == ["acme", "globex"]
    assert written["holds"][0]["keys"] == [key.hex() for key in chain_keys(ACME, PROMPT)[:3]]  # digests, no tokens
    assert set(written["holds"][0]) == {"tenant", "keys", "space", "adapter_id", "created_at", "expires_at"}

    after = make_manager(clock=FakeClock(10.0))  # another process: its clock reads otherwise
    assert restore_holds(after, after._clock(), tmp_path) == {"held": 2, "lapsed": 0, "stranded": 0, "refused": 0}
    acme, globex = sorted(after.pins.all(), key=lambda pin: pin.tenant)
    assert (acme.keys, acme.breakpoint, acme.owner) == (tuple(chain_keys(ACME, PROMPT)[:3]), True,
                                                        "prompt_cache_breakpoint")
    assert acme.expires_at - 10.0 == pytest.approx(43_200 - 600, abs=2)
    assert acme.created_at - 10.0 == pytest.approx(-600, abs=2)  # made 600 s before the stop
    assert (globex.space, globex.adapter_id) == ("ab12", "")
    assert globex.expires_at - 10.0 == pytest.approx(1_800 - 600, abs=2)
    assert not path.exists()  # read once: a later start does not hold them again
    assert restore_holds(after, after._clock(), tmp_path) == {"held": 0, "lapsed": 0, "stranded": 0, "refused": 0}


def test_a_hold_that_lapsed_while_kvd_was_down_or_no_longer_fits_the_budget_is_not_held_again(tmp_path, caplog):
    now = time.time()
    holds = [{"tenant": "acme", "keys": [key.hex() for key in chain_keys(ACME, PROMPT)[:2]], "space": None,
              "adapter_id": None, "created_at": now - 3_600, "expires_at": now - 1},
             {"tenant": "acme", "keys": [key.hex() for key in chain_keys(ACME, PROMPT)[:3]], "space": None,
              "adapter_id": None, "created_at": now - 60, "expires_at": now + 1_000},
             {"tenant": "acme", "keys": "not a list of keys", "expires_at": now + 1_000}]
    (tmp_path / FILE_NAME).write_text(json.dumps({"version": 1, "holds": holds}))
    after = make_manager(clock=FakeClock(0.0), pin_budget_blocks=2)
    with caplog.at_level(logging.WARNING, logger="kvd"):
        assert restore_holds(after, 0.0, tmp_path) == {"held": 0, "lapsed": 1, "stranded": 0, "refused": 2}
    assert after.pins.all() == []
    assert caplog.text.count("a request's breakpoint hold of tenant acme is not held again after the restart") == 2


def test_an_operator_s_pin_restored_first_is_left_as_it_is(tmp_path):
    before = make_manager(clock=FakeClock(0.0))
    keys = chain_keys(ACME, PROMPT)[:2]
    before.hold("acme", keys, 1_800.0)
    save_holds(before.pins.all(), 0.0, tmp_path)
    after = make_manager(clock=FakeClock(0.0))
    operator = after.pin_keys("acme", keys, owner="ops", note="theirs now").pin  # restore_pins ran first
    assert restore_holds(after, 0.0, tmp_path) == {"held": 1, "lapsed": 0, "stranded": 0, "refused": 0}
    assert after.pins.all() == [operator] and (operator.owner, operator.breakpoint) == ("ops", False)


def test_a_hold_no_request_can_reach_now_is_not_held_again(tmp_path):
    now = time.time()

    def hold(space, adapter_id, blocks):
        return {"tenant": "acme", "keys": [key.hex() for key in chain_keys(ACME, PROMPT)[:blocks]], "space": space,
                "adapter_id": adapter_id, "created_at": now - 60, "expires_at": now + 1_000}

    holds = [hold("ab12", "", 1), hold("cd34", "", 2),  # the space served; another (a new revision, format, ...)
             hold("ab12", "feed", 3), hold("ab12", "beef", 4),  # an adapter served; weights no longer served
             hold(None, None, 5)]  # (made where kvd did not note: held)
    (tmp_path / FILE_NAME).write_text(json.dumps({"version": 1, "holds": holds}))
    after = make_manager(clock=FakeClock(0.0))
    assert restore_holds(after, 0.0, tmp_path, ("ab12", {"", "feed"})) == {"held": 3, "lapsed": 0, "stranded": 2,
                                                                           "refused": 0}
    assert sorted(pin.num_blocks for pin in after.pins.all()) == [1, 3, 5]
    assert not (tmp_path / FILE_NAME).exists()


def test_no_hold_leaves_no_file_and_a_file_that_cannot_be_read_is_left_with_a_warning(tmp_path, caplog):
    (tmp_path / FILE_NAME).write_text("{}")
    assert save_holds(make_manager().pins.all(), 0.0, tmp_path) == 0 and not (tmp_path / FILE_NAME).exists()
    (tmp_path / FILE_NAME).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="kvd"):
        assert restore_holds(make_manager(), 0.0, tmp_path) == {"held": 0, "lapsed": 0, "stranded": 0, "refused": 0}
    assert f"{tmp_path / FILE_NAME} cannot be read" in caplog.text
    assert (tmp_path / FILE_NAME).exists()


def test_kvd_holds_a_request_s_12h_prefix_again_after_a_restart(tmp_path):
    pytest.importorskip("torch")
    from .daemon_fixtures import apps, call, start_service, token_table
    from .test_cache_breakpoints import SYSTEM, chat_body, held_tokens

    service = start_service(tmp_path, num_blocks=128)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        tokens = held_tokens(service, SYSTEM)
        call(unix, "POST", "/v1/chat/completions", json=chat_body(SYSTEM, ttl="12h"))
        [before] = call(unix, "GET", "/admin/pins").json()["pins"]
    finally:
        service.shutdown(1)
    assert (tmp_path / FILE_NAME).exists()

    service = start_service(tmp_path, num_blocks=128)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        [after] = call(unix, "GET", "/admin/pins").json()["pins"]
        assert {k: after[k] for k in ("pin_id", "tenant", "blocks", "owner", "breakpoint")} == {
            k: before[k] for k in ("pin_id", "tenant", "blocks", "owner", "breakpoint")}
        assert after["expires_at"] == pytest.approx(before["expires_at"], abs=2)
        assert not (tmp_path / FILE_NAME).exists()
        again = call(unix, "POST", "/v1/chat/completions", json=chat_body(SYSTEM, ttl="12h")).json()
        assert again["usage"]["prompt_tokens_details"]["cache_write_tokens"] == 0  # held already: extended
        assert tokens == after["blocks"] * service.config.block_size
        scraped = call(unix, "GET", "/metrics").text.splitlines()
        assert 'kvd_prompt_cache_breakpoints_total{outcome="extended"} 1.0' in scraped
    finally:
        service.shutdown(1)


def test_kvd_does_not_hold_again_what_a_new_block_size_leaves_no_request_to_reach(tmp_path, caplog):
    pytest.importorskip("torch")
    from .daemon_fixtures import apps, call, start_service, token_table
    from .test_cache_breakpoints import SYSTEM, chat_body

    service = start_service(tmp_path, num_blocks=128)
    try:
        call(apps(service, token_table(tmp_path))[0], "POST", "/v1/chat/completions", json=chat_body(SYSTEM, ttl="12h"))
    finally:
        service.shutdown(1)
    with caplog.at_level(logging.INFO, logger="kvd"):
        service = start_service(tmp_path, num_blocks=128, block_size=2 * service.config.block_size)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        assert call(unix, "GET", "/admin/pins").json()["pins"] == []  # its keys were a block size ago
        assert not (tmp_path / FILE_NAME).exists()
        assert ("requests' prompt cache breakpoint holds from before the restart: 0 held again, 0 lapsed meanwhile, "
                "1 made where no request reaches them now") in caplog.text
    finally:
        service.shutdown(1)
