"""`report_cached_tokens`: who sees `usage.prompt_tokens_details.cached_tokens`. A count of cached
tokens lets a caller probe the cache for a guessed prompt, block by block; with `admin`, callers
without the admin role get usage without it (as vLLM answers by default), directly or through
kvd router, whole or streamed, completions and chats."""

from __future__ import annotations

from dataclasses import replace

import httpx

from kvctl.daemon.server.auth import TokenEntry, TokenTable
from kvctl.daemon.server.router import create_router_app
from kvctl.daemon.server.router_service import Replica, RouterService, replica_client
from kvctl.daemon.server.usage_report import shows_cached_tokens
from kvctl.policies.routing import make_router

from .daemon_fixtures import ADMIN_TOKEN, USER_TOKEN, apps, call, sse_events, start_service, token_table

SYSTEM = "A system prompt that every request here starts with, long enough for a few blocks. " * 2
USER = {"Authorization": f"Bearer {USER_TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def usage(app, headers=None, **body) -> dict:
    answer = call(app, "POST", "/v1/completions", headers=headers or {},
                  json={"prompt": SYSTEM, "max_tokens": 2, "temperature": 0, **body})
    assert answer.status_code == 200, answer.text
    if body.get("stream"):
        return [e for e in sse_events(answer) if isinstance(e, dict) and e.get("usage")][0]["usage"]
    return answer.json()["usage"]


def test_who_sees_cached_tokens_under_each_setting():
    assert [shows_cached_tokens("all", role) for role in ("admin", "user")] == [True, True]
    assert [shows_cached_tokens("admin", role) for role in ("admin", "user")] == [True, False]
    assert [shows_cached_tokens("none", role) for role in ("admin", "user")] == [False, False]
    # kvd router's word for its caller only takes away: a user behind it, never an admin from a user
    assert (shows_cached_tokens("admin", "admin", "user"), shows_cached_tokens("admin", "user", "admin")) == (
        False, False)
    assert shows_cached_tokens("all", "admin", "user")


def test_with_admin_only_a_user_gets_usage_without_cached_tokens_and_a_reload_changes_it(tmp_path):
    service = start_service(tmp_path, report_cached_tokens="admin")
    try:
        unix, tcp = apps(service, token_table(tmp_path))
        usage(tcp, ADMIN)  # the prompt is cached for the admin token's tenant from here on
        admin = usage(tcp, ADMIN)
        assert admin["prompt_tokens_details"]["cached_tokens"] > 0
        for seen in (usage(tcp, USER), usage(tcp, USER, stream=True, stream_options={"include_usage": True}),
                     usage(unix, {"X-KVD-Caller-Role": "user"})):  # the last: a user behind kvd router
            assert seen == {"prompt_tokens": admin["prompt_tokens"], "completion_tokens": 2,
                            "total_tokens": admin["prompt_tokens"] + 2}
        chat = call(tcp, "POST", "/v1/chat/completions", headers=USER, json={
            "messages": [{"role": "user", "content": SYSTEM}], "max_tokens": 2, "ignore_eos": True}).json()["usage"]
        assert "prompt_tokens_details" not in chat and chat["completion_tokens"] == 2
        # live: a reload to `all` shows it to the user; `none` to nobody
        service.reload(replace(service.config, report_cached_tokens="all"), actor="test")
        assert usage(tcp, USER)["prompt_tokens_details"]["cached_tokens"] > 0
        service.reload(replace(service.config, report_cached_tokens="none"), actor="test")
        assert "prompt_tokens_details" not in usage(unix)
        assert "prompt_tokens_details" not in usage(tcp, ADMIN, stream=True, stream_options={"include_usage": True})
    finally:
        service.shutdown(1)


def test_a_user_behind_kvd_router_gets_what_the_replica_would_tell_the_user_itself(tmp_path):
    service = start_service(tmp_path, report_cached_tokens="admin")
    try:
        replica = apps(service, token_table(tmp_path))[0]  # the router reaches it on its socket, as an admin
        router = RouterService([Replica("replica-0", replica_client("/run/replica-0.sock",
                                                                    transport=httpx.ASGITransport(app=replica)))],
                               make_router("prefix"), view="ask")
        tokens = TokenTable([TokenEntry(b"u" * 24, "acme", "user", "token:1"),
                             TokenEntry(b"a" * 24, "acme", "admin", "token:2")])
        front = create_router_app(router, front="tcp", tokens=tokens)
        as_user, as_admin = ({"Authorization": "Bearer " + c * 24} for c in "ua")
        usage(front, as_user)
        assert "prompt_tokens_details" not in usage(front, as_user)
        assert usage(front, as_admin)["prompt_tokens_details"]["cached_tokens"] > 0
        # the router's reason names what the replica caches of the prompt: an admin's answer carries it,
        # a user's does not, since the replica would not tell the user
        answers = [call(front, "POST", "/v1/completions", headers=who, json={"prompt": SYSTEM, "max_tokens": 1})
                   for who in (as_admin, as_user)]
        assert answers[0].headers["x-kvd-route"].startswith("caches ")
        assert "x-kvd-route" not in answers[1].headers and answers[1].headers["x-kvd-replica"] == "replica-0"
        # a replica that reports to everyone: the user sees the reason too
        service.reload(replace(service.config, report_cached_tokens="all"), actor="test")
        told = call(front, "POST", "/v1/completions", headers=as_user, json={"prompt": SYSTEM, "max_tokens": 1})
        assert told.headers["x-kvd-route"].startswith("caches ")
    finally:
        service.shutdown(1)
