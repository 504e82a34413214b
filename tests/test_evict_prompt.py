"""`kvctl evict TEXT|--tokens|--messages`: forget a conversation, named by one of its requests. Its
own blocks go from every tier with every block that extends it (the reply, later turns); the
blocks it shares with other cached prefixes (a system prompt) stay, and the answer counts them."""

from __future__ import annotations

from .daemon_fixtures import call
from .evict_cases import ASK_A, ASK_B, BLOCK, ask, serving


def rows(app) -> dict[str, dict]:
    return {row["prefix_id"]: row for row in call(app, "GET", "/admin/prefixes").json()["prefixes"]}


def test_evicting_a_conversation_takes_its_own_blocks_and_reply_and_leaves_the_system_prompt_to_the_others(tmp_path):
    with serving(tmp_path) as (service, unix):
        ask(unix, ASK_A)
        ask(unix, ASK_B)
        before = rows(unix)
        shared = next(r for r in before.values() if r["children"] == 2)
        own = [r for r in before.values() if r["parent_id"] == shared["prefix_id"]]
        assert (shared["blocks"], len(own)) == (3, 2)
        gone = call(unix, "POST", "/admin/evict", json={"tokens": ASK_A}).json()
        # A's own row: its prompt's two blocks after the system prompt, and the block its reply filled
        assert gone == {"evicted_blocks": 3, "skipped": {}, "result": "ok",
                        "target": f"prompt of {len(ASK_A)} tokens (tenant default)", "lower_tier_blocks_dropped": 0,
                        "prompt_blocks": 5, "shared_blocks_kept": 3}
        after = rows(unix)
        # B's row is all that extends the system prompt now: the two are one run
        assert [(r["prefix_id"], r["blocks"], r["children"]) for r in after.values()] == [(shared["prefix_id"], 6, 0)]
        explain_a = call(unix, "POST", "/admin/explain", json={"tokens": ASK_A}).json()
        explain_b = call(unix, "POST", "/admin/explain", json={"tokens": ASK_B}).json()
        assert (explain_a["hit_blocks"], explain_b["hit_blocks"]) == (3, 5)
        # the same again: nothing of it is left that is its own
        again = call(unix, "POST", "/admin/evict", json={"tokens": ASK_A}).json()
        assert (again["evicted_blocks"], again["result"], again["shared_blocks_kept"]) == (0, "ok", 3)
        # audited, newest first, with what the answer said: never the prompt's text or ids
        entries = call(unix, "GET", "/admin/audit", params={"action": "evict"}).json()["entries"]
        assert [(e["target"], e["detail"]) for e in entries] == [(gone["target"], again), (gone["target"], gone)]


def test_a_prompt_is_looked_for_in_its_tenant_s_namespace_and_named_alone(tmp_path):
    with serving(tmp_path) as (service, unix):
        ask(unix, ASK_A, tenant="acme")
        cached = call(unix, "GET", "/admin/status").json()["blocks"]["device"]["cached"]
        elsewhere = call(unix, "POST", "/admin/evict", json={"tokens": ASK_A}).json()  # the caller's: default
        assert (elsewhere["evicted_blocks"], elsewhere["prompt_blocks"], elsewhere["shared_blocks_kept"]) == (0, 5, 0)
        both = call(unix, "POST", "/admin/evict", json={"tokens": ASK_A, "prefix": "abcd"})
        assert both.status_code == 400 and both.json()["error"]["message"] == (
            "evict: give exactly one of prefix, a prompt (text, tokens or messages), tenant, model_revision, "
            "all_unpinned")
        two = call(unix, "POST", "/admin/evict", json={"tokens": ASK_A, "text": "and text"})
        assert (two.status_code, two.json()["error"]["message"]) == (
            400, "give exactly one of text, tokens and messages")
        outside = call(unix, "POST", "/admin/evict", json={"tokens": [5, 10**6]})
        assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
        assert call(unix, "GET", "/admin/status").json()["blocks"]["device"]["cached"] == cached  # nothing went
        theirs = call(unix, "POST", "/admin/evict", json={"tokens": ASK_A, "tenant": "acme"}).json()
        assert (theirs["evicted_blocks"], theirs["target"]) == (cached, f"prompt of {len(ASK_A)} tokens (tenant acme)")
        assert call(unix, "GET", "/admin/status").json()["blocks"]["device"]["cached"] == 0


def test_a_prompt_given_as_text_is_tokenized_as_its_completion_was_and_leaves_no_tier_a_copy(tmp_path):
    with serving(tmp_path, disk_cache_bytes="16MiB", tiering="always",
                 write_policy="write_through") as (service, unix):
        text = "Forget this conversation, block by block, in every tier that holds a copy of it. " * 2
        ask(unix, text)
        assert service.tiers.flush(timeout=10)
        on_disk = call(unix, "GET", "/admin/tiers").json()["tiers"]["disk"]["blocks"]
        cached = call(unix, "GET", "/admin/status").json()["blocks"]["device"]["cached"]
        assert on_disk == cached > 0
        gone = call(unix, "POST", "/admin/evict", json={"text": text}).json()
        assert (gone["evicted_blocks"], gone["lower_tier_blocks_dropped"], gone["result"]) == (cached, on_disk, "ok")
        assert call(unix, "GET", "/admin/tiers").json()["tiers"]["disk"]["blocks"] == 0
        assert call(unix, "GET", "/admin/prefixes").json()["prefixes"] == []


def test_a_chat_named_by_its_first_request_goes_with_its_later_turns(tmp_path):
    """The messages are rendered as /v1/chat/completions rendered the request, so its blocks are
    the ones found; the second turn extends the first, and goes with it."""
    with serving(tmp_path, num_blocks=256) as (service, unix):
        system = {"role": "system", "content": "You answer questions about KV caches, in one short line. " * 3}
        first = [system, {"role": "user", "content": "Which tier survives a restart of kvd?"}]
        other = [system, {"role": "user", "content": "What does a pin cost?"}]
        for messages in (first, other):
            assert call(unix, "POST", "/v1/chat/completions", json={
                "messages": messages, "max_tokens": 20, "temperature": 0, "ignore_eos": True}).status_code == 200
        reply = call(unix, "POST", "/v1/chat/completions", json={
            "messages": first, "max_tokens": 20, "temperature": 0, "ignore_eos": True}).json()["choices"][0]
        second = [*first, reply["message"], {"role": "user", "content": "And which one is fastest?"}]
        turn_two = call(unix, "POST", "/v1/chat/completions", json={
            "messages": second, "max_tokens": 20, "temperature": 0, "ignore_eos": True}).json()
        assert turn_two["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # it extends the first turn

        def hit(messages) -> int:
            return call(unix, "POST", "/admin/explain", json={"messages": messages}).json()["hit_blocks"]

        def ids(messages) -> list[int]:
            return call(unix, "POST", "/tokenize", json={"messages": messages}).json()["tokens"]

        a, b = ids(first), ids(other)
        shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) // BLOCK  # the system prompt's blocks
        other_hits, cached = hit(other), call(unix, "GET", "/admin/status").json()["blocks"]["device"]["cached"]
        gone = call(unix, "POST", "/admin/evict", json={"messages": first}).json()
        assert gone["result"] == "ok" and gone["shared_blocks_kept"] == shared > 0
        left = call(unix, "GET", "/admin/status").json()["blocks"]["device"]["cached"]
        assert gone["evicted_blocks"] == cached - left > 0
        assert (hit(first), hit(second), hit(other)) == (shared, shared, other_hits)  # the other chat keeps all
