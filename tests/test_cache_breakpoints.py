"""OpenAI's prompt cache breakpoints (daemon/server/cache_breakpoints.py): the marks a request
makes, where each marked prefix ends in its prompt, the cache's hold on it (a pin marked as a
breakpoint's, only ever extended), and what usage says was written."""

from __future__ import annotations

import pytest

from kvctl.daemon.cache import Namespace, PinBudgetExceeded, chain_keys
from kvctl.daemon.server.cache_breakpoints import Mark, marks, prefix_lengths, written
from kvctl.daemon.server.chat_messages import MessagesError

from .conftest import make_manager, run_prompt

BP = {"mode": "explicit"}


def part(text: str, **mark) -> dict:
    return {"type": "text", "text": text, "prompt_cache_breakpoint": {**BP, **mark}}


def test_marks_are_found_in_prompt_order_with_their_ttl_the_latest_four_kept_in_explicit_mode_three_else():
    messages = [{"role": "system", "content": [part("a"), part("b", ttl="12h")]},
                {"role": "user", "content": "plain text"},
                {"role": "user", "content": [{"type": "text", "text": "no mark"}, part("c"), part("d"), part("e")]}]
    assert marks(messages, {"mode": "explicit"}) == [Mark(0, 1, "12h"), Mark(2, 1, "30m"), Mark(2, 2, "30m"),
                                                     Mark(2, 3, "30m")]
    # implicit (the default): OpenAI writes one breakpoint of its own and the latest three marked
    assert marks(messages, None) == marks(messages, {"mode": "implicit"}) == [
        Mark(2, 1, "30m"), Mark(2, 2, "30m"), Mark(2, 3, "30m")]
    assert marks(messages[:1], {"ttl": "12h", "mode": "explicit"}) == [Mark(0, 0, "12h"), Mark(0, 1, "12h")]
    assert marks([{"role": "user", "content": "Hi"}], None) == []


@pytest.mark.parametrize("messages, options, message, param", [
    ([{"role": "user", "content": [{"type": "text", "text": "x", "prompt_cache_breakpoint": {"ttl": "30m"}}]}], None,
     "messages[0].content[0].prompt_cache_breakpoint: must be {\"mode\": \"explicit\"[, \"ttl\": \"30m\" or \"12h\"]}, "
     "got {'ttl': '30m'}", "messages[0].content[0].prompt_cache_breakpoint"),
    ([{"role": "user", "content": [part("x", ttl="1h")]}], None,
     "messages[0].content[0].prompt_cache_breakpoint.ttl: must be 30m or 12h, got '1h'",
     "messages[0].content[0].prompt_cache_breakpoint.ttl"),
    ([{"role": "user", "content": [part("x", scope="global")]}], None,
     "messages[0].content[0].prompt_cache_breakpoint.scope: kvd knows mode and ttl only",
     "messages[0].content[0].prompt_cache_breakpoint.scope"),
    ([], {"mode": "sometimes"}, "prompt_cache_options.mode: must be implicit or explicit, got 'sometimes'",
     "prompt_cache_options.mode"),
    ([], {"ttl": 1800}, "prompt_cache_options.ttl: must be 30m or 12h, got 1800", "prompt_cache_options.ttl"),
    ([], "30m", "prompt_cache_options: must be an object, got str", "prompt_cache_options"),
])
def test_a_malformed_mark_or_option_is_refused_naming_its_field(messages, options, message, param):
    with pytest.raises(MessagesError) as info:
        marks(messages, options)
    assert (str(info.value), info.value.param) == (message, param)


def test_a_prefix_is_as_much_of_the_rendered_part_as_the_prompt_starts_with_and_alike_ones_are_one():
    messages = [{"role": "system", "content": [part("ab"), part("cd", ttl="12h")]},
                {"role": "user", "content": [part("ef")]}]

    def render(upto):  # a "template" whose closing of a message the prompt does not share
        text = "".join("".join(p["text"] for p in m["content"]) for m in upto)
        return [ord(c) for c in text] + [0]

    prompt = [ord(c) for c in "abcdef"] + [1, 2]
    found = marks(messages, None)
    assert prefix_lengths(messages, found, render, prompt) == [(2, 1800.0, "30m"), (4, 43200.0, "12h"),
                                                               (6, 1800.0, "30m")]
    twice = [Mark(0, 1, "30m"), Mark(0, 1, "12h"), Mark(0, 1, "30m")]  # the same prefix: its longest life
    assert prefix_lengths(messages, twice, render, prompt) == [(4, 43200.0, "12h")]
    assert prefix_lengths(messages, found, lambda upto: [], prompt) == []  # (not placed: none held)


def test_written_is_the_longest_prefix_held_and_of_it_the_tokens_held_12h():
    assert written([]) == {"cache_write_tokens": 0,
                           "cache_write_tokens_details": {"ttl_30m_tokens": 0, "ttl_12h_tokens": 0}}
    assert written([(64, "12h"), (128, "30m")]) == {
        "cache_write_tokens": 128, "cache_write_tokens_details": {"ttl_30m_tokens": 64, "ttl_12h_tokens": 64}}
    assert written([(64, "30m"), (128, "12h")])["cache_write_tokens_details"] == {"ttl_30m_tokens": 0,
                                                                                  "ttl_12h_tokens": 128}


# ---- the cache's hold ----------------------------------------------------------------------------
PROMPT = list(range(100, 124))
ACME = Namespace(block_size=4, tenant="acme")


def test_a_hold_is_a_breakpoint_pin_extended_never_shortened_and_gone_when_its_ttl_is_over(clock):
    m = make_manager(clock=clock)
    run_prompt(m, "r1", PROMPT, namespace=ACME)
    keys = chain_keys(ACME, PROMPT)[:3]
    assert m.hold("acme", keys, 1800.0) == "held"
    [pin] = m.pins.all()
    assert (pin.owner, pin.breakpoint, pin.expires_at, pin.num_blocks) == ("prompt_cache_breakpoint", True, 1800.0, 3)
    assert pin.describe()["breakpoint"] is True
    clock.advance(100)
    assert m.hold("acme", keys, 43200.0) == "extended" and pin.expires_at == 43300.0
    assert m.hold("acme", keys, 1800.0) == "extended" and pin.expires_at == 43300.0  # (not shortened)
    m.release("r1")
    assert m.state_counts()["pinned"] == 3
    clock.advance(43200)
    assert [p.pin_id for p in m.expire_pins()] == [pin.pin_id] and m.state_counts()["pinned"] == 0
    m.audit()


def test_an_operator_s_pin_is_left_as_it_is_and_an_operator_pinning_a_hold_makes_it_theirs(clock):
    m = make_manager(clock=clock)
    keys = chain_keys(ACME, PROMPT)[:2]
    operator = m.pin_keys("acme", keys, owner="ops", note="system prompt").pin
    assert m.hold("acme", keys, 1800.0) == "pinned"
    assert (operator.owner, operator.expires_at, operator.breakpoint) == ("ops", None, False)
    longer = chain_keys(ACME, PROMPT)[:4]
    assert m.hold("acme", longer, 1800.0) == "held"
    taken = m.pin_keys("acme", longer, owner="ops", note="keep it")
    assert taken.refreshed and (taken.pin.owner, taken.pin.breakpoint, taken.pin.expires_at) == ("ops", False, None)
    assert m.hold("acme", longer, 1800.0) == "pinned"


def test_a_hold_past_the_tenant_s_pin_budget_is_refused_whole(clock):
    m = make_manager(clock=clock, pin_budget_blocks=2)
    with pytest.raises(PinBudgetExceeded):
        m.hold("acme", chain_keys(ACME, PROMPT)[:3], 1800.0)
    assert m.pins.all() == [] and m.pins.used("acme") == 0
    assert m.hold("acme", chain_keys(ACME, PROMPT)[:2], 1800.0) == "held"


# ---- kvd -------------------------------------------------------------------------------------------
SYSTEM = "You are the operations assistant of a serving fleet; answer in one short line. " * 4


def chat_body(system: str, **mark) -> dict:
    return {"max_tokens": 2, "temperature": 0, "ignore_eos": True, "messages": [
        {"role": "system", "content": [{"type": "text", "text": system,
                                        "prompt_cache_breakpoint": {"mode": "explicit", **mark}}]},
        {"role": "user", "content": "Status?"}]}


def held_tokens(service, system: str) -> int:
    """The full blocks' tokens of the chat's prompt up to the end of its system message."""
    from kvctl.daemon.server.chat_messages import chat_messages

    whole = service.chat_prompt(chat_messages([{"role": "system", "content": system},
                                               {"role": "user", "content": "Status?"}]))
    upto = service.chat_prompt(chat_messages([{"role": "system", "content": system}]), False, True)
    common = next(i for i, (a, b) in enumerate(zip(upto + [-1], whole)) if a != b)
    return common // service.config.block_size * service.config.block_size


def test_kvd_holds_a_marked_prefix_for_its_ttl_extends_it_and_says_what_it_wrote(tmp_path):
    pytest.importorskip("torch")
    from kvctl.daemon.server import pin_ops

    from .daemon_fixtures import apps, call, start_service, token_table

    service = start_service(tmp_path, num_blocks=128)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        tokens = held_tokens(service, SYSTEM)
        assert tokens >= 4 * service.config.block_size
        first = call(unix, "POST", "/v1/chat/completions", json=chat_body(SYSTEM)).json()
        assert first["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 0, "cache_write_tokens": tokens,
            "cache_write_tokens_details": {"ttl_30m_tokens": tokens, "ttl_12h_tokens": 0}}
        [pin] = call(unix, "GET", "/admin/pins").json()["pins"]
        assert (pin["owner"], pin["tenant"], pin["blocks"], pin.get("breakpoint")) == (
            "prompt_cache_breakpoint", "default", tokens // service.config.block_size, True)
        assert 1790 < pin["expires_in_seconds"] <= 1800
        again = call(unix, "POST", "/v1/chat/completions", json=chat_body(SYSTEM, ttl="12h")).json()
        details = again["usage"]["prompt_tokens_details"]
        assert details["cache_write_tokens"] == 0 and details["cached_tokens"] >= tokens  # extended, and hit
        [pin] = call(unix, "GET", "/admin/pins").json()["pins"]
        assert 43190 < pin["expires_in_seconds"] <= 43200
        short = call(unix, "POST", "/v1/chat/completions", json=chat_body("Hi.")).json()
        assert short["usage"]["prompt_tokens_details"]["cache_write_tokens"] == 0
        refused = call(unix, "POST", "/v1/chat/completions", json=chat_body(SYSTEM, ttl="1h"))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == (
            "messages[0].content[0].prompt_cache_breakpoint.ttl")
        scraped = call(unix, "GET", "/metrics").text.splitlines()
        for outcome, count in (("held", 1), ("extended", 1), ("short", 1), ("over_budget", 0)):
            assert f'kvd_prompt_cache_breakpoints_total{{outcome="{outcome}"}} {count}.0' in scraped
        real = service.engine.cache._clock
        service.engine.cache._clock = lambda: real() + 43201  # (its 12 hours over)
        try:
            pin_ops.expire_pins(service)
        finally:
            service.engine.cache._clock = real
        assert call(unix, "GET", "/admin/pins").json()["pins"] == []
        assert service.store.audit_since(0, action="unpin") == []  # (a request's hold: not audited)
    finally:
        service.shutdown(1)


def test_a_response_s_marked_input_is_held_and_ignore_or_a_full_budget_holds_nothing(tmp_path):
    pytest.importorskip("torch")
    import asyncio

    from .daemon_fixtures import apps, call, start_service, token_table
    from .test_responses_api import client_for

    system = SYSTEM + "Responses."
    (tmp_path / "honour").mkdir()
    service = start_service(tmp_path / "honour", num_blocks=128)
    try:
        unix, _ = apps(service, token_table(tmp_path))

        async def respond():
            return await client_for(unix).responses.create(max_output_tokens=2, input=[
                {"role": "system", "content": [{"type": "input_text", "text": system,
                                                "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]},
                {"role": "user", "content": "Status?"}])

        made = asyncio.run(respond())
        tokens = held_tokens(service, system)
        assert made.usage.input_tokens_details.model_dump() == {
            "cached_tokens": 0, "cache_write_tokens": tokens,
            "cache_write_tokens_details": {"ttl_30m_tokens": 0, "ttl_12h_tokens": tokens}}
        [pin] = call(unix, "GET", "/admin/pins").json()["pins"]
        assert pin["blocks"] == tokens // service.config.block_size and 43190 < pin["expires_in_seconds"]
    finally:
        service.shutdown(1)
    for settings in ({"prompt_cache_breakpoints": "ignore"}, {"pin_budget_blocks": 2}):
        (tmp_path / next(iter(settings))).mkdir()
        service = start_service(tmp_path / next(iter(settings)), num_blocks=128, **settings)
        try:
            unix, _ = apps(service, token_table(tmp_path))
            answer = call(unix, "POST", "/v1/chat/completions", json=chat_body(SYSTEM))
            assert answer.status_code == 200 and call(unix, "GET", "/admin/pins").json()["pins"] == []
            details = answer.json()["usage"]["prompt_tokens_details"]
            ignored = "prompt_cache_breakpoints" in settings
            assert details.get("cache_write_tokens") == (None if ignored else 0)  # (ignore: no mark was read)
            scraped = call(unix, "GET", "/metrics").text.splitlines()
            assert f'kvd_prompt_cache_breakpoints_total{{outcome="over_budget"}} {0 if ignored else 1}.0' in scraped
        finally:
            service.shutdown(1)


def test_a_held_prefix_outlives_traffic_that_evicts_an_unmarked_one(tmp_path):
    pytest.importorskip("torch")
    from .daemon_fixtures import apps, call, start_service, token_table

    service = start_service(tmp_path, num_blocks=96)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        marked, plain = SYSTEM + "Marked.", "Plain. " + SYSTEM  # (plain shares no block with marked)
        unmarked_body = {**chat_body(plain), "messages": [{"role": "system", "content": plain},
                                                          {"role": "user", "content": "Status?"}]}
        call(unix, "POST", "/v1/chat/completions", json=chat_body(marked))
        call(unix, "POST", "/v1/chat/completions", json=unmarked_body)
        warm = call(unix, "POST", "/v1/chat/completions", json=unmarked_body).json()
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 16  # (cached, until the traffic)
        for i in range(12):  # other traffic: more than the cache holds, each prompt its own
            call(unix, "POST", "/v1/chat/completions", json={"max_tokens": 2, "ignore_eos": True, "messages": [
                {"role": "user", "content": f"{i} " + "other traffic that fills the cache. " * 12}]})
        again = call(unix, "POST", "/v1/chat/completions", json=chat_body(marked)).json()
        plain_again = call(unix, "POST", "/v1/chat/completions", json=unmarked_body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == held_tokens(service, marked)
        assert plain_again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        service.shutdown(1)


def test_an_operator_s_pin_past_the_budget_lets_go_of_the_holds_that_lapse_soonest_where_that_makes_room(clock):
    m = make_manager(num_blocks=16, clock=clock, pin_budget_blocks=4)
    soon, later = chain_keys(ACME, PROMPT)[:3], chain_keys(ACME, list(range(200, 204)))
    assert m.hold("acme", soon, 1800.0) == m.hold("acme", later, 43200.0) == "held"
    soon_id = m.pins.all()[0].pin_id
    too_long = chain_keys(ACME, list(range(400, 420)))  # 5 blocks: past the budget with every hold gone
    with pytest.raises(PinBudgetExceeded):
        m.pin_keys("acme", too_long, owner="ops")
    assert m.pins.used("acme") == 4 and len(m.pins.all()) == 2  # (nothing let go for a pin that cannot fit)
    result = m.pin_keys("acme", chain_keys(ACME, list(range(300, 312))), owner="ops", note="support desk")
    assert result.let_go == (soon_id,)  # the hold that lapses soonest, and no more than room needs
    assert sorted((p.owner, p.num_blocks) for p in m.pins.all()) == [("ops", 3), ("prompt_cache_breakpoint", 1)]
    with pytest.raises(PinBudgetExceeded):  # a request's hold lets go of nothing
        m.hold("acme", chain_keys(ACME, list(range(500, 504))), 43200.0)
    m.audit()


def test_kvctl_pin_says_which_holds_gave_way():
    from .kvctl_fakes import kvctl_answered

    answer = {"pin_id": "pin-1", "tenant": "acme", "blocks": 3, "cached_blocks": 3, "warmed": False,
              "refreshed": False, "expires_in_seconds": None, "let_go_holds": ["pin-2", "pin-3"]}
    said = kvctl_answered(["pin", "You are the support desk.", "--tenant", "acme"], answer)
    assert said.exit_code == 0 and said.output == (
        "pinned pin-1: 3 blocks for tenant acme (3 cached)\n"
        "2 of tenant acme's requests' prompt cache breakpoint holds let go for room in its pin budget\n")


def test_kvd_lets_a_hold_go_for_an_operator_s_pin_and_says_so_in_the_answer_and_the_audit(tmp_path):
    pytest.importorskip("torch")
    from .daemon_fixtures import apps, call, start_service, token_table

    probe = start_service(tmp_path / "probe", num_blocks=128)
    blocks = held_tokens(probe, SYSTEM) // probe.config.block_size
    probe.shutdown(1)
    service = start_service(tmp_path, num_blocks=128, pin_budget_blocks=blocks)  # (the hold spends it all)
    try:
        unix, _ = apps(service, token_table(tmp_path))
        call(unix, "POST", "/v1/chat/completions", json=chat_body(SYSTEM))
        [hold] = call(unix, "GET", "/admin/pins").json()["pins"]
        pinned = call(unix, "POST", "/admin/pins", json={"tokens": list(range(3, 35)), "note": "desk"}).json()
        assert pinned["let_go_holds"] == [hold["pin_id"]]
        assert [p["pin_id"] for p in call(unix, "GET", "/admin/pins").json()["pins"]] == [pinned["pin_id"]]
        [record] = service.store.audit_since(0, action="pin")
        assert record["detail"]["let_go_holds"] == [hold["pin_id"]]
    finally:
        service.shutdown(1)


def test_kvctl_pins_counts_the_holds_it_lists_and_leaves_them_out_when_asked():
    from .test_pinned_out import _pin_row
    from .test_router import _kvctl_prints

    hold = {**_pin_row("pin-00000000000000b2"), "owner": "prompt_cache_breakpoint", "breakpoint": True,
            "blocks": 3, "expires_at": 100.0, "expires_in_seconds": 1700.0}
    listed = {"pins": [_pin_row(), hold]}
    every = " ".join(_kvctl_prints(["pins"], listed).split())
    assert "pin-00000000000000b2" in every and every.endswith(
        "holds of requests' prompt cache breakpoints among them: 1 (3 blocks), each lapsing by itself; --no-holds "
        "leaves them out")
    without = " ".join(_kvctl_prints(["pins", "--no-holds"], listed).split())
    assert "pin-00000000000000b2" not in without and "pin-00000000000000a1" in without
    assert without.endswith("holds of requests' prompt cache breakpoints not listed (--no-holds): 1 (3 blocks)")
