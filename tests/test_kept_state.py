"""policies/kept_state.py: when kvd needs room for a response or a conversation, the least recently
used of the tenant holding the most bytes goes, so one tenant's burst does not push out every
other tenant's kept state; a tenant alone is plain LRU."""

from __future__ import annotations

import json

import pytest

from kvctl.policies.kept_state import KeptByTenant


def test_the_tenant_holding_the_most_gives_up_its_least_recently_used_first():
    kept = KeptByTenant()
    for tenant, key, size in [("globex", "g1", 50), ("acme", "a1", 40), ("acme", "a2", 40), ("initech", "i1", 80)]:
        kept.add(tenant, key)
        kept.grew(tenant, size)
    assert kept.victim() == "a1"  # acme holds 80 and initech 80: the tie goes by name; a1 is acme's oldest
    kept.used("acme", "a1")
    assert kept.victim() == "a2"
    assert kept.victim(keep="a2") == "a1"  # (the one being made room for is never chosen)
    kept.remove("acme", "a2")
    kept.grew("acme", -40)
    assert kept.victim() == "i1" and kept.victim(keep="i1") == "g1"  # initech 80, then globex 50 over acme 40
    for tenant, key, size in [("initech", "i1", 80), ("globex", "g1", 50), ("acme", "a1", 40)]:
        kept.remove(tenant, key)
        kept.grew(tenant, -size)
    assert kept.victim() is None and kept.order == {} and kept.bytes == {}  # (empty tenants are forgotten)


def test_a_tenant_s_burst_of_responses_lets_go_of_its_own_not_another_s():
    pytest.importorskip("fastapi")
    from kvctl.daemon.server.response_store import ResponseStore

    def response(response_id: str) -> dict:
        return {"id": response_id, "object": "response", "output": []}

    one = len(json.dumps(response("resp_b0"))) + len(json.dumps({"role": "user", "content": "x" * 100},
                                                                sort_keys=True))
    store = ResponseStore(4 * one)
    store.put("globex", response("resp_b0"), [{"role": "user", "content": "x" * 100}])  # the oldest of all
    for n in range(6):  # acme's burst
        store.put("acme", response(f"resp_a{n}"), [{"role": "user", "content": "y" * 100}])
    assert store.get("globex", "resp_b0") is not None
    assert [rid for rid in store.entries if rid.startswith("resp_a")] == ["resp_a3", "resp_a4", "resp_a5"]
    assert store.figures()["dropped"] == 3 and store.kept.bytes == {"globex": one, "acme": 3 * one}
    # acme's next request for one let go is told why; another tenant learns nothing of it
    assert store.gone.why("acme", "resp_a0").startswith("kvd let it go for room (responses_store_bytes; its tenant "
                                                       "held the most), 20")
    assert store.gone.why("globex", "resp_a0") is None and store.gone.why("acme", "resp_a5") is None
    store.purge(None, None)
    assert store.kept.bytes == {} and store.used == 0
    assert store.gone.why("acme", "resp_a5").startswith("an operator purged it (kvctl responses purge), 20")


def test_a_tenant_s_burst_of_conversations_lets_go_of_its_own_not_another_s():
    pytest.importorskip("fastapi")
    from kvctl.daemon.server.conversation_store import ConversationStore

    item = {"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 100}]}
    one = len("{}") + len(json.dumps(item))
    store = ConversationStore(4 * one)
    theirs = store.create("globex", [item], {}, 1)
    ours = [store.create("acme", [item], {}, 2 + n) for n in range(6)]
    assert store.get("globex", theirs.id) is theirs
    assert [c.id for c in store.entries.values() if c.tenant == "acme"] == [c.id for c in ours[3:]]
    assert store.gone.why("acme", ours[0].id).startswith("kvd let it go for room (conversations_store_bytes")
    assert store.figures()["dropped"] == 3 and store.kept.bytes == {"globex": one, "acme": 3 * one}
