"""kvd router and chat: `/v1/chat/completions` is routed by the conversation's prefix, in the events
view with no question on the request's path (the router renders the chat with the replica's own
template, fetched once and checked by digest), in the ask view by the replica's own rendering."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from kvctl.daemon.server.chat_messages import affinity_text, chat_messages  # noqa: E402
from kvctl.daemon.server.replica_feed import FeedError, served_template  # noqa: E402

from .daemon_fixtures import call, sse_events  # noqa: E402
from .test_router import drive, home_of, replicas, router_app, routed_cached, until_followed  # noqa: E402,F401


def system_homed(text: str, name: str, tag: str = "") -> str:
    """A system prompt from `text` whose conversations, as a new prefix, go home to `name`; it
    starts with `tag` (marked after it where need be)."""
    for k in range(64):
        candidate = f"{tag}{text}" if k == 0 else f"{tag}[{k}] {text}"
        if home_of(affinity_text(chat_messages([{"role": "system", "content": candidate}]))) == name:
            return candidate
    raise AssertionError("no marking sends it there")


SYSTEM_0 = system_homed("You are the chat front of a KV cache fleet; answer operators in one line. " * 4,
                        "replica-0")
SYSTEM_1 = system_homed("You explain eviction orders and tier moves to new operators, with care. " * 4,
                        "replica-1")


def talk(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def chat(client, messages, **extra):
    return await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3,
                                                           "temperature": 0, "ignore_eos": True, **extra})


def cached(answer) -> int:
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("view", ["events", "ask"])
def test_a_chat_goes_home_then_where_its_conversation_is_cached(replicas, view):
    # Every chat of this test opens with the same first block: BOS, "<|system|>\n" and "(ask" or "(eve".
    # Replica-1 is handed one such chat first, so it holds that block of the first conversation,
    # whose home (replica-0) holds none of it.
    first, second = (system_homed(s, name, tag=f"({view}) ") for s, name in ((SYSTEM_0, "replica-0"),
                                                                             (SYSTEM_1, "replica-1")))
    opening = call(replicas[1], "POST", "/v1/chat/completions", json={
        "messages": talk(f"({view}) another conversation altogether", "hi"), "max_tokens": 1})
    assert opening.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    service, app = router_app(replicas, "prefix", view=view)

    async def settled(client):
        if view == "events":
            await until_followed(service, (0, 1), settled=True)

    steps = [lambda c: chat(c, talk(first, "Q1?")), settled, lambda c: chat(c, talk(first, "Q2?")),
             lambda c: chat(c, talk(second, "Q1?")), settled, lambda c: chat(c, talk(second, "Q2?"))]
    answers = [a for a in drive(app, steps, service=service if view == "events" else None) if a is not None]
    assert [a.status_code for a in answers] == [200] * 4
    assert [a.headers["x-kvd-replica"] for a in answers] == ["replica-0", "replica-0", "replica-1", "replica-1"]
    # the block replica-1 holds is the opening every chat of the test shares: it does not keep a new one from home
    assert answers[0].headers["x-kvd-route"] == ("its home (the first by its hash within the load bound), which "
                                                 "caches 0 of its tokens: no replica caches 128 more")
    assert (cached(answers[0]), cached(answers[2])) == (0, 16)  # replica-1 held the opening of the second
    # the router counted exactly what the replica then found: it rendered the chat as the replica does
    assert [routed_cached(answers[i]) for i in (1, 3)] == [cached(answers[1]), cached(answers[3])]
    assert cached(answers[1]) >= 256 and cached(answers[3]) >= 256
    questions = [r.client._transport.prompt_questions for r in service.replicas]
    assert questions == ([0, 0] if view == "events" else [4, 4])


def test_a_chat_stream_and_a_bad_chat_come_through_as_the_replica_answered(replicas):
    service, app = router_app(replicas, "prefix", view="events")
    streamed, bad = drive(app, [lambda c: chat(c, talk(SYSTEM_0, "Stream?"), stream=True),
                                lambda c: chat(c, [{"role": "robot", "content": "hi"}])], service=service)
    events = sse_events(streamed)
    assert streamed.headers["content-type"].startswith("text/event-stream") and events[-1] == "[DONE]"
    assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}
    assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 3
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].role"
    assert bad.headers["x-kvd-route"]  # routed by load: the router could not read it, the replica says why


def test_a_replica_serves_its_chat_template_with_the_digest_its_snapshot_names(replicas):
    served = call(replicas[0], "GET", "/admin/tokenizer").json()
    snapshot = call(replicas[0], "GET", "/admin/events/snapshot").json()
    facts = call(replicas[0], "POST", "/admin/route-facts", json={"tokens": []}).json()
    assert served["chat_template_digest"] == snapshot["chat_template"] == facts["chat_template"]
    from kvctl.daemon.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_texts(served["tokenizer_json"], served["tokenizer_config_json"])
    template = served_template(served, snapshot["chat_template"], tokenizer)
    assert template.render([{"role": "user", "content": "hi"}]) == "<|begin|><|user|>\nhi<|end|>\n<|assistant|>\n"
    with pytest.raises(FeedError, match=r"^chat_template: the template served has digest [0-9a-f]{12}, the "
                                        r"replica named 000000000000$"):
        served_template(served, "0" * 64, tokenizer)
    with pytest.raises(FeedError, match=r"^chat_template: the replica names template 000000000000 but serves none$"):
        served_template({**served, "chat_template": None}, "0" * 64, tokenizer)


def test_the_router_says_where_it_would_send_a_chat(replicas):
    service, app = router_app(replicas, "prefix", view="ask")

    async def ask(client):
        await chat(client, talk(SYSTEM_1, "Warm it."))
        return await client.post("/router/route", json={"messages": talk(SYSTEM_1, "And now?")})

    [answer] = drive(app, [ask])
    body = answer.json()
    assert answer.status_code == 200, body
    assert body["routes"]["prefix"]["replica"] == "replica-1"
    held = {row["replica"]: row["cached_tokens"] for row in body["replicas"]}
    assert held["replica-1"] >= 256 and held["replica-0"] == 0


def test_affinity_is_the_conversation_s_opening_whatever_the_template():
    a = chat_messages(talk("S" * 300, "one"))
    b = chat_messages(talk("S" * 300, "two"))
    assert affinity_text(a)[:256] == affinity_text(b)[:256] == "<system>" + "S" * 248


def test_kvctl_route_takes_a_chat_and_finds_its_home_as_the_router_does(replicas, tmp_path, capsys, monkeypatch):
    import json

    import kvctl.route_cmd as route_cmd

    from .test_cli import cli

    class InProcess:  # kvctl's client, answered by a replica's app in this process
        def __init__(self, app) -> None:
            self.app = app

        def post(self, path, body):
            return call(self.app, "POST", path, json=body).json()

    names = ["/run/a.sock", "/run/b.sock"]
    monkeypatch.setattr(route_cmd, "replica_client", lambda ctx, spec: InProcess(replicas[names.index(spec)]))
    messages = talk("A conversation kvctl route has not seen: " + "m" * 300, "where?")
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"model": "kvd-demo-llama-v1", "messages": messages}))
    status, out, _ = cli(capsys, "route", "--messages", str(path), "--replica", names[0], "--replica", names[1],
                         "--routing", "prefix", "--json")
    assert status == 0
    doc = json.loads(out)
    home = home_of(affinity_text(chat_messages(messages)), names=tuple(names))
    assert doc["routes"]["prefix"]["replica"] == home
    # each replica rendered the chat itself: the tokens of the conversation with the template's
    rendered = call(replicas[0], "POST", "/admin/explain", json={"messages": messages}).json()["prompt_tokens"]
    assert [r["prompt_tokens"] for r in doc["replicas"]] == [rendered] * 2 and rendered > 300
    # under a prompt_cache_key, its home is the key's (the one away from the conversation's own)
    from kvctl.policies.routing import home_order, key_affinity

    away = names[1 - names.index(home)]
    key = next(f"k{i}" for i in range(64) if names[home_order(key_affinity(f"k{i}"), names)[0]] == away)
    status, out, _ = cli(capsys, "route", "--messages", str(path), "--replica", names[0], "--replica", names[1],
                         "--routing", "prefix", "--prompt-cache-key", key, "--json")
    assert status == 0 and json.loads(out)["routes"]["prefix"]["replica"] == away
    assert doc["routes"]["prefix"]["reason"] == "no replica caches its prefix: its home (the first by its hash " \
                                                 "within the load bound)"


@pytest.mark.parametrize("view, stream", [("events", False), ("events", True), ("ask", False)])
def test_a_chat_s_next_turn_through_the_router_hits_the_reply_the_replica_keeps_the_ids_of(replicas, view, stream):
    """The replica that answered keeps the reply's ids (reply_ids.py) and prompts the next turn with
    them: it caches the first prompt and the reply (less its last token). In the ask view the router
    counts that, as the replica renders the chat; in the events view it keeps the ids of the replies
    it relays (router_replies.py), whole or streamed, and renders the chat with them as the replica
    does, so it counts the same. Either way the turn goes where its conversation is."""
    system = f"[{view} {stream}] A conversation that goes on past its first reply. " * 4
    service, app = router_app(replicas, "prefix", view=view)
    sampled = {"max_tokens": 40, "temperature": 1.0, "seed": 3, "stream": stream}
    turns = []

    async def first(client):
        turns.append(await client.post("/v1/chat/completions", json={"messages": talk(system, "Q1?"), **sampled}))
        return turns[-1]

    def reply_of(answer) -> tuple[str, list[int]]:
        if not stream:
            choice = answer.json()["choices"][0]
            return choice["message"]["content"], choice["token_ids"]
        chunks = [c for c in sse_events(answer) if c != "[DONE]" and c["choices"]]
        return ("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks),
                [t for c in chunks for t in c["choices"][0]["token_ids"]])

    async def settled(client):
        if view == "events":
            await until_followed(service, (0, 1), settled=True)

    async def second(client):
        return await chat(client, talk(system, "Q1?") + [{"role": "assistant", "content": reply_of(turns[0])[0]},
                                                          {"role": "user", "content": "And then?"}])

    one, two = (a for a in drive(app, [first, settled, second], service=service if view == "events" else None)
                if a is not None)
    assert one.headers["x-kvd-replica"] == two.headers["x-kvd-replica"]  # where the conversation is
    home = replicas[int(one.headers["x-kvd-replica"][-1])]
    first_prompt = call(home, "POST", "/tokenize", json={"messages": talk(system, "Q1?")}).json()["count"]
    text, made = reply_of(one)
    assert cached(two) == (first_prompt + len(made) - 1) // 16 * 16
    assert routed_cached(two) == cached(two)  # the router counted the reply as the replica cached it
    if view == "events":  # it keeps the reply under the tenant the replica served it under
        assert service.reply_ids.figures()["replies"] == 2  # (and the second turn's)
        assert service.reply_ids.ids_for("default", next(iter(service.tokenizers.by_digest)), text) is not None
        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        from kvctl.daemon.server.router_metrics import RouterMetrics

        samples = {s.name: s.value for family in text_string_to_metric_families(
            generate_latest(RouterMetrics(service).registry).decode()) for s in family.samples}
        assert (samples["kvd_router_reply_ids_kept"], samples["kvd_router_reply_ids_kept_bytes"],
                samples["kvd_router_reply_ids_dropped_total"]) == (2, service.reply_ids.figures()["bytes"], 0)


# ---- what the router reads of the answers it relays (router_replies.py) --------------------------
class Bytes:
    """A tokenizer of one byte a token, 256 its stop token."""

    digest = "bytes-1"
    hidden_specials = frozenset({256})

    @staticmethod
    def decode(ids):
        return bytes(t for t in ids if t < 256).decode("utf-8", "replace")


def ids_of(text: str) -> list[int]:
    return list(text.encode())


def sse(*chunks) -> bytes:
    return b"".join(b"data: " + json.dumps({"object": "chat.completion.chunk", "choices": [c]}).encode() + b"\n\n"
                    for c in chunks)


def test_the_router_keeps_each_relayed_reply_the_replica_keeps_and_no_other():
    from kvctl.daemon.server.reply_ids import ReplyIds
    from kvctl.daemon.server.router_replies import ReplyWatch, keeper

    memory = ReplyIds(2**20)
    watch = ReplyWatch(keeper(memory, Bytes, "acme"))
    # streamed, two choices at once, each in pieces; the stop token's chunk has no text
    watch.events(sse({"index": 0, "delta": {"role": "assistant", "content": "hel"}, "token_ids": ids_of("hel"),
                      "finish_reason": None},
                     {"index": 1, "delta": {"role": "assistant", "content": "cut "}, "token_ids": ids_of("cut "),
                      "finish_reason": None}))
    watch.events(b"data: {not json\n\n" + sse(
        {"index": 0, "delta": {"content": "lo"}, "token_ids": ids_of("lo"), "finish_reason": None},
        {"index": 1, "delta": {"content": "here"}, "token_ids": ids_of("here"), "finish_reason": "length"}))
    watch.events(sse({"index": 0, "delta": {"content": ""}, "token_ids": [256], "finish_reason": "stop"})
                 + b"data: [DONE]\n\n")
    assert memory.ids_for("acme", "bytes-1", "hello") == ids_of("hello")  # the stop token left off
    assert memory.ids_for("acme", "bytes-1", "cut here") == ids_of("cut here")
    assert memory.ids_for("globex", "bytes-1", "hello") is None
    # whole: a stop string cut the text (its ids say more), a reply that called a tool, a kept one
    ReplyWatch(keeper(memory, Bytes, "acme")).answer(json.dumps({"choices": [
        {"index": 0, "message": {"content": "stopped"}, "token_ids": ids_of("stopped!!"), "finish_reason": "stop"},
        {"index": 1, "message": {"content": "", "tool_calls": [{}]}, "token_ids": ids_of("<call>"),
         "finish_reason": "tool_calls"},
        {"index": 2, "message": {"content": "whole"}, "token_ids": ids_of("whole") + [256], "finish_reason": "stop"},
    ]}).encode())
    assert memory.ids_for("acme", "bytes-1", "stopped") is None and memory.ids_for("acme", "bytes-1", "") is None
    assert memory.ids_for("acme", "bytes-1", "whole") == ids_of("whole")
    ReplyWatch(keeper(memory, Bytes, "acme")).answer(b"<html>a proxy's page</html>")  # passed over
    assert memory.figures()["replies"] == 3


def test_the_fleet_status_says_what_the_router_keeps_of_the_replies():
    from rich.console import Console

    from kvctl.fleet_status import render_fleet_status

    live = {"blocks": {"device": {"total": 64, "free": 64}}, "tokens": {"prompt": 0, "hit": 0, "hit_ratio": 0.0},
            "queue": {"waiting": 0, "running": 0}}
    data = {"routing": "prefix", "view": "events", "replica_status": [{"replica": "a", **live}],
            "replicas": [{"replica": "a", "sent": 9, "open": 0}],
            "reply_ids": {"budget_bytes": 2**20, "bytes": 2048, "replies": 12, "remembered": 14, "dropped": 2,
                          "spliced": 0, "template_changed": 0}}
    console = Console(record=True, width=200)
    render_fleet_status(data, console)
    assert ("kvd router's reply ids: 12 chat replies kept in 2.0 KiB of 1.0 MiB, to weigh a next turn as the "
            "replica prompts it; 2 let go for room") in " ".join(console.export_text().split())


def test_the_router_splices_replies_only_in_the_events_view_of_a_fleet_without_transfers(replicas):
    from kvctl.daemon.server.reply_ids import ReplyIds

    events, _ = router_app(replicas, "prefix", view="events")
    asked, _ = router_app(replicas, "prefix", view="ask")
    assert events.splices_replies and "reply_ids" in events.status()
    assert not asked.splices_replies and "reply_ids" not in asked.status()
    events.reply_ids = ReplyIds(0)  # reply_ids_bytes 0: replies are read as text
    assert not events.splices_replies and "reply_ids" not in events.status()
    events.reply_ids = ReplyIds(2**20)
    events.replicas[0].role = "prefill"  # disaggregated: both sides of a transfer tokenize the text
    assert events.disaggregated and not events.splices_replies
    assert events.reply_watch(events.replicas[1], "acme") is None
