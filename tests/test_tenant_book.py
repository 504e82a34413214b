"""kvd keeps per-tenant counters for the tenants active most recently, sums the rest as retired,
and never retires a tenant with a metric series of its own: memory stays bounded however many
tenants a gateway sends, and the totals stay exact."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from kvctl.daemon.engine.tenant_book import EVICTED, HIT, PROMPT, REJECTED, TenantBook


def test_the_least_recently_active_tenant_is_retired_and_its_counters_summed():
    book = TenantBook(2)
    book.row("a")[PROMPT] += 10
    book.row("b")[PROMPT] += 20
    book.row("a")[HIT] += 3  # a is now the most recent
    book.row("c")[REJECTED] += 1  # b goes
    assert book.items() == [("a", [10, 3, 0, 0, 0, 0, 0]), ("c", [0, 0, 0, 1, 0, 0, 0])]
    assert (book.retired, book.retired_tenants) == ([20, 0, 0, 0, 0, 0, 0], 1)
    book.row("b")[PROMPT] += 5  # b comes back with a row of its own; a goes
    assert book.items() == [("c", [0, 0, 0, 1, 0, 0, 0]), ("b", [5, 0, 0, 0, 0, 0, 0])]
    assert (book.retired, book.retired_tenants) == ([30, 3, 0, 0, 0, 0, 0], 2)
    assert book.totals() == [35, 3, 0, 1, 0, 0, 0]


def test_evictions_count_for_their_tenant_without_making_it_active():
    """Losing blocks to another tenant's requests is not activity: the tenant keeps its place in
    line to be retired; one not tracked any more adds to the retired sums."""
    book = TenantBook(2)
    book.row("a")[PROMPT] += 1
    book.row("b")[PROMPT] += 1
    book.add_quietly("a", EVICTED, 4)
    book.add_quietly("gone", EVICTED, 2)
    assert book.items() == [("a", [1, 0, 0, 0, 4, 0, 0]), ("b", [1, 0, 0, 0, 0, 0, 0])]
    assert (book.retired, book.retired_tenants) == ([0, 0, 0, 0, 2, 0, 0], 0)
    book.row("c")  # a is still the least recently active: it goes, with its evictions
    assert book.retired == [1, 0, 0, 0, 6, 0, 0] and book.totals() == [2, 0, 0, 0, 6, 0, 0]


def test_a_tenant_with_its_own_metric_series_is_never_retired():
    book = TenantBook(2, keep=lambda tenant: tenant == "acme")
    for tenant in ("acme", "b", "c", "d"):
        book.row(tenant)[PROMPT] += 1
    # c came: acme was the oldest, passed over (now after c), b went; d came: c went
    assert [t for t, _ in book.items()] == ["acme", "d"]
    assert (book.retired, book.retired_tenants) == ([2, 0, 0, 0, 0, 0, 0], 2)
    every = TenantBook(1, keep=lambda tenant: True)  # nobody can go: the book grows past its limit
    every.row("x")
    row = every.row("y")
    row[PROMPT] += 4
    assert every.items() == [("x", [0, 0, 0, 0, 0, 0, 0]), ("y", [4, 0, 0, 0, 0, 0, 0])] and every.retired_tenants == 0


def test_the_tenant_being_counted_is_never_the_one_retired():
    book = TenantBook(1, keep=lambda tenant: tenant == "old")
    book.row("old")
    row = book.row("new")  # over the limit, and the only one that could go is the new one
    row[PROMPT] += 7
    assert book.items() == [("old", [0, 0, 0, 0, 0, 0, 0]), ("new", [7, 0, 0, 0, 0, 0, 0])]


def test_a_smaller_limit_retires_at_once_and_a_bad_one_is_refused_by_name():
    book = TenantBook(3)
    for i, tenant in enumerate("abc"):
        book.row(tenant)[PROMPT] += i + 1
    book.resize(1)
    assert book.items() == [("c", [3, 0, 0, 0, 0, 0, 0])] and book.retired == [3, 0, 0, 0, 0, 0, 0]
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"max_tracked_tenants: must be >= 1, got {bad}"):
            TenantBook(bad)
        with pytest.raises(ValueError, match=f"max_tracked_tenants: must be >= 1, got {bad}"):
            book.resize(bad)


def test_kvd_lists_the_latest_tenants_sums_the_others_and_its_metrics_only_grow(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    from kvctl.daemon.server.app import create_app

    from .daemon_fixtures import call, start_service

    service = start_service(tmp_path, max_tenant_metric_series=1, max_tracked_tenants=2)
    try:
        app = create_app(service, service.metrics, front="unix")
        prompts = {"acme": 5, "globex": 6, "initech": 7, "hooli": 8}

        def ask(tenant):
            response = call(app, "POST", "/v1/completions", headers={"X-KVD-Tenant": tenant},
                            json={"prompt": list(range(1, prompts[tenant] + 1)), "max_tokens": 1})
            assert response.status_code == 200, response.text

        def prompt_series():
            text = call(app, "GET", "/metrics").text
            return {t: float(v) for t, v in
                    re.findall(r'^kvd_tenant_prompt_tokens_total\{tenant="([^"]+)"\} (\S+)$', text, re.MULTILINE)}

        ask("acme")  # the first tenant seen: its own metric series, so never retired
        ask("globex")
        assert prompt_series() == {"acme": 5.0, "*": 6.0}
        ask("initech")  # three tenants: globex, the least recent without a series of its own, is retired
        ask("acme")
        ask("hooli")  # initech goes
        answer = call(app, "GET", "/admin/tenants").json()
        assert [(row["tenant"], row["prompt_tokens"]) for row in answer["tenants"]] == [("acme", 10), ("hooli", 8)]
        assert answer["retired"] == {"tenants": 2, "prompt_tokens": 13, "hit_tokens": 0, "recomputed_tokens": 0,
                                     "rejected": 0, "evicted_blocks": 0, "retained_blocks": 0, "explicit_requests": 0,
                                     "tracked": 2, "limit": 2}
        assert service.status()["tokens"]["prompt"] == 10 + 8 + 13
        assert prompt_series() == {"acme": 10.0, "*": 21.0}  # "*" holds hooli and the retired: it only grew
        assert set(service.metrics.tenant_summary()) == {"acme", "hooli"}  # TTFT windows: the latest two
        assert list(service.metrics.tenant_summary("hooli")) == ["hooli"] and service.metrics.tenant_summary("x") == {}
        live = service.config
        service.reload(replace(live, max_tracked_tenants=1))  # acme keeps its series: hooli goes
        answer = call(app, "GET", "/admin/tenants").json()
        assert [row["tenant"] for row in answer["tenants"]] == ["acme"]
        assert answer["retired"]["tenants"] == 3 and answer["retired"]["prompt_tokens"] == 21
        assert prompt_series() == {"acme": 10.0, "*": 21.0}
    finally:
        service.shutdown(1)


def test_kvctl_tenants_shows_the_busiest_and_what_was_retired():
    from rich.console import Console

    from kvctl.requests_cmd import render_tenants

    def row(tenant, prompt, hit):
        return {"tenant": tenant, "prompt_tokens": prompt, "hit_tokens": hit, "hit_ratio": hit / prompt,
                "recomputed_tokens": 0, "running": 0, "waiting": 0, "rejected": 0, "cached_blocks": 0,
                "pinned_blocks": 0, "pin_budget_blocks": 0, "ttft_p50_s": None, "ttft_p95_s": None}

    answer = {"tenants": [row("acme", 100, 50), row("globex", 900, 0), row("initech", 300, 30)], "blocks": 64,
              "retired": {"tenants": 1234, "prompt_tokens": 40_000, "hit_tokens": 10_000, "recomputed_tokens": 12,
                          "rejected": 3, "tracked": 3, "limit": 3}}
    console = Console(width=100, record=True)
    console.print(render_tenants(answer, top=2))
    text = console.export_text()
    assert [line.split()[0] for line in text.splitlines() if re.match(r"^\s*(acme|globex|initech)\b", line)] \
        == ["globex", "initech"]
    assert "and 1 more tenant (--top 0 lists every one)" in text
    assert ("retired: 1,234 tenants not active among the latest 3 (max_tracked_tenants), summed: 40,000 prompt "
            "tokens, 25.0% hit, 12 recomputed, 3 rejected") in " ".join(text.split())


def test_kvd_router_sums_each_replica_s_retired_tenants():
    from kvctl.daemon.server.fleet_admin import merge_tenant_lists

    def retired(tenants, prompt, limit):
        return {"tenants": tenants, "prompt_tokens": prompt, "hit_tokens": prompt // 2, "recomputed_tokens": 1,
                "rejected": 0, "evicted_blocks": 2 * tenants, "retained_blocks": tenants, "explicit_requests": 0,
                "tracked": limit, "limit": limit}

    status, merged = merge_tenant_lists(["r0", "r1", "r2"], [
        (200, {"tenants": [], "blocks": 8, "retired": retired(3, 100, 10)}),
        (200, {"tenants": [], "blocks": 8, "retired": retired(5, 40, 4)}),
        (200, {"tenants": [], "blocks": 8}),  # a kvd from before max_tracked_tenants
    ])
    assert status == 200
    assert merged["retired"] == {"tenants": 8, "prompt_tokens": 140, "hit_tokens": 70, "recomputed_tokens": 2,
                                 "rejected": 0, "evicted_blocks": 16, "retained_blocks": 8, "explicit_requests": 0,
                                 "tracked": 14, "limit": 4}
    _, none_retired = merge_tenant_lists(["r0"], [(200, {"tenants": [], "blocks": 8})])
    assert "retired" not in none_retired


def test_max_tracked_tenants_below_one_is_refused_naming_the_setting():
    from kvctl.daemon.config import ConfigError, resolve

    with pytest.raises(ConfigError) as raised:
        resolve({}, env={"KVD_MAX_TRACKED_TENANTS": "0"})
    assert str(raised.value) == "max_tracked_tenants: invalid value '0' from KVD_MAX_TRACKED_TENANTS: must be >= 1"
    assert resolve({}, env={}).max_tracked_tenants == 10_000


def test_kvctl_tenants_keeps_a_fleet_s_figures_whole_at_80_columns():
    """A fleet's figures (billions of prompt tokens, a 262k-block cache, shares and a host tier) fit
    80 columns: counts of 100,000 or more are rounded to three figures, and where the pairs would
    still not fit, each goes on two lines. A figure is never cut; the tenant name wraps."""
    from rich.console import Console

    from kvctl.requests_cmd import render_tenants

    def row(tenant, prompt, hit):
        return {"tenant": tenant, "prompt_tokens": prompt, "hit_tokens": hit, "hit_ratio": hit / prompt,
                "recomputed_tokens": 1_234_567, "running": 12, "waiting": 340, "rejected": 12_345,
                "cached_blocks": 123_456, "pinned_blocks": 2048, "pin_budget_blocks": 65536, "ttft_p50_s": 0.123,
                "ttft_p95_s": 1.234, "idle_blocks": 45_000, "share_blocks": 60_000, "host_blocks": 1_000_000,
                "host_share_blocks": 2_000_000}

    answer = {"tenants": [row("acme-production", 12_345_678_901, 5_000_000_000), row("globex", 900_000, 0)],
              "blocks": 262144, "shares": {"acme": 0.25}}
    shown = {}
    for width in (80, 120):
        console = Console(width=width, record=True)
        console.print(render_tenants(answer))
        shown[width] = [line.rstrip() for line in console.export_text().splitlines()]
    assert shown[80][:6] == [
        "                                  run                  idle                 TTFT",
        "tenant      prompt   hit recomp /wait    rej cached  /share   host    pins    ms",
        "acme-produc  12.3B 40.5%  1.23M    12 12,345   123k  45,000  1.00M   2,048   123",
        "tion                             /340               /60,000 /2.00M /65,536 /1234",
        "globex        900k  0.0%  1.23M    12 12,345   123k  45,000  1.00M   2,048   123",
        "                                 /340               /60,000 /2.00M /65,536 /1234"]
    assert shown[120][:3] == [
        "tenant          prompt   hit recomp run/wait    rej cached    idle/share        host         pins  TTFT ms",
        "acme-production  12.3B 40.5%  1.23M   12/340 12,345   123k 45,000/60,000 1.00M/2.00M 2,048/65,536 123/1234",
        "globex            900k  0.0%  1.23M   12/340 12,345   123k 45,000/60,000 1.00M/2.00M 2,048/65,536 123/1234"]
    assert "figures of 100,000 or more are rounded (123k, 1.23M; --json has them whole)" in " ".join(shown[80])
    small = {**answer, "tenants": [{**row("acme", 1000, 10), "recomputed_tokens": 0, "cached_blocks": 12,
                                    "host_blocks": 3, "host_share_blocks": 8, "pin_budget_blocks": 32}]}
    console = Console(width=80, record=True)
    console.print(render_tenants(small))
    assert "rounded" not in console.export_text()


def test_counts_round_to_three_figures_from_100_000():
    from kvctl.tables import count

    assert [count(n) for n in (0, 99_999, 100_000, 999_499, 999_500, 1_234_567, 9_995_000, 99_950_000,
                               12_345_678_901, 10**15)] == [
        "0", "99,999", "100k", "999k", "1.00M", "1.23M", "10.0M", "100M", "12.3B", "1000T"]


def test_one_tenant_s_counters_are_copied_alone_and_leave_its_place_as_it_was():
    book = TenantBook(limit=3)
    book.row("acme")[PROMPT] += 10
    book.row("globex")[HIT] += 4
    copied = book.items("acme")
    assert copied == [("acme", [10, 0, 0, 0, 0, 0, 0])] and book.items("initech") == []
    copied[0][1][PROMPT] = 99  # a copy: the book's own counters are not touched
    # acme still the least recent
    assert book.items() == [("acme", [10, 0, 0, 0, 0, 0, 0]), ("globex", [0, 4, 0, 0, 0, 0, 0])]
    named = book.names()  # the tenants with a row, a copy (what a one-tenant answer counts as listed)
    named.add("initech")
    assert book.names() == {"acme", "globex"}
