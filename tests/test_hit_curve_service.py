"""The hit curve as kvd reports it: /admin/status's hit_curve and the kvd_hit_curve_* families."""

from __future__ import annotations

import json
import re

import pytest

from kvctl.daemon.server.app import create_app

from .daemon_fixtures import call, start_service


def complete(app, ids, tenant: str | None = None) -> None:
    answer = call(app, "POST", "/v1/completions", headers={"X-KVD-Tenant": tenant} if tenant else {},
                  json={"prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert answer.status_code == 200, answer.text


def without_spans(figures: dict) -> dict:
    """Hit-curve figures less the seconds each recent window covers (which grow between two asks)."""
    return {**figures, "recent": [{k: v for k, v in w.items() if k != "seconds"} for w in figures.get("recent", [])]}


def a_b_c_a(app, tenants=(None,) * 4) -> None:
    """Prompts a, b, c (4 full blocks each, 71 tokens) and a again: its root was last used 8 blocks
    before (b's and c's), so a cache of 8 blocks serves it nothing and one of 16 its 4 blocks."""
    prompts = {name: [first] + [7] * 70 for name, first in (("a", 11), ("b", 12), ("c", 13))}
    for name, tenant in zip("abca", tenants):
        complete(app, prompts[name], tenant)


def test_status_and_metrics_say_what_a_cache_of_each_size_would_have_served(tmp_path):
    service = start_service(tmp_path, num_blocks=64)
    try:
        app = create_app(service, service.metrics, front="unix")
        a_b_c_a(app)
        body = call(app, "GET", "/admin/status").json()
        curve = body["hit_curve"]
        assert (curve["prompts"], curve["prompt_tokens"], curve["looked_tokens"]) == (4, 4 * 71, 4 * 64)
        assert curve["prompt_tokens"] == body["tokens"]["prompt"]
        assert (curve["device_blocks"], curve["exact_blocks"], curve["sample_rate"]) == (64, 32_768, 1.0)
        # the demo's float32 cache: a byte a value holds 4 times the blocks in the same memory
        assert body["model"]["dtype"] == "torch.float32" and curve["formats"] == {"fp8_e4m3": 256, "int8": 256}
        sizes = {row["times"]: (row["blocks"], row["hit_tokens"]) for row in curve["sizes"]}
        # a's root was last used 8 blocks before its second turn (b's and c's four each): not held by 8
        assert sizes["0.125"] == (8, 0)
        assert sizes["0.25"] == (16, 64)
        assert sizes["1"] == (64, body["tokens"]["hit"]) == (64, 64)  # the device's own size: what it served
        assert sizes["inf"] == (None, 64)
        assert list(sizes) == ["0.125", "0.25", "0.5", "1", "2", "4", "8", "16", "32", "64", "inf"]
        metrics = call(app, "GET", "/metrics").text
        for line in ('kvd_hit_curve_hit_tokens_total{times="0.125"} 0.0',
                     'kvd_hit_curve_hit_tokens_total{times="0.25"} 64.0',
                     'kvd_hit_curve_hit_tokens_total{times="inf"} 64.0',
                     'kvd_hit_curve_blocks{times="2"} 128.0', "kvd_hit_curve_prompt_tokens_total 284.0",
                     "kvd_hit_curve_exact_blocks 32768.0", "kvd_hit_curve_sample_rate 1.0"):
            assert re.search(f"^{re.escape(line)}$", metrics, re.MULTILINE), line
        assert 'kvd_hit_curve_blocks{times="inf"}' not in metrics
    finally:
        service.shutdown(deadline=2)


def test_kvctl_hit_curve_draws_each_size_and_marks_the_device_s_own(tmp_path, capsys):
    from .test_cli import cli
    from .test_health_checks import served_on

    service = start_service(tmp_path, num_blocks=64)
    try:
        app = create_app(service, service.metrics, front="unix")
        a_b_c_a(app)
        with served_on(app, str(tmp_path / "served.sock")) as path:
            status, out, err = cli(capsys, "--socket", path, "hit-curve")
            assert status == 0, err
            rows = [" ".join(line.split()) for line in out.splitlines()]
            assert rows[0].startswith("4 prompts, 284 tokens since kvd started (of them 256 in full blocks")
            assert "0.125x 8 128.0 KiB 0 0.0%" in rows
            assert "0.25x 16 256.0 KiB 64 22.5% █████" in rows
            assert "1x (device) 64 1.0 MiB 64 22.5% █████" in rows
            assert "4x (fp8_e4m3, int8) 256 4.0 MiB 64 22.5% █████" in rows
            assert "never evicts - - 64 22.5% █████" in rows
            text = " ".join(rows)
            assert "0.25x the device's blocks would serve within 1 point of a cache that never evicts" in text
            assert "kvd served 22.5% in fact (64 tokens), under lru eviction" in text
            assert ("fp8_e4m3 and int8 would hold 4x the blocks in the same memory: LRU 22.5% against 22.5% at these "
                    "(kvctl calibrate, then cache_dtype: fp8_e4m3)") in text
            assert "sample" not in text  # every block followed: nothing estimated
            status, out, _ = cli(capsys, "--socket", path, "hit-curve", "--json")
            answer = json.loads(out)
            assert status == 0 and set(answer) == {"hit_curve", "bytes_per_block", "tokens"}
            assert answer["hit_curve"]["sizes"][1] == {"times": "0.25", "blocks": 16, "hit_tokens": 64}
            assert answer["tokens"]["hit"] == 64
            status, out, _ = cli(capsys, "--socket", path, "status")
            shown = " ".join(out.split())
            assert status == 0
            assert ("prefix hits 64 of 284 prompt tokens (22.5%); LRU over these blocks 22.5%, over twice them "
                    "22.5% (kvctl hit-curve)") in shown
    finally:
        service.shutdown(deadline=2)


def curve(prompts: int, hits: list[int], rate: float = 1.0) -> dict:
    sizes = [{"times": t, "blocks": b, "hit_tokens": h}
             for (t, b), h in zip([("0.5", 50), ("1", 100), ("2", 200), ("inf", None)], hits)]
    return {"prompts": prompts, "prompt_tokens": 1_000, "looked_tokens": 900, "sizes": sizes,
            "exact_blocks": 150, "sample_rate": rate, "device_blocks": 100, "tracked_keys": 10}


def test_at_kvd_router_each_replica_s_curve_is_drawn_and_one_that_did_not_answer_says_so():
    from rich.console import Console

    from kvctl.hit_curve_cmd import curves_of, render_hit_curves

    fleet = {"replica_status": [
        {"replica": "a", "hit_curve": curve(3, [100, 500, 700, 705], rate=0.25), "bytes_per_block": 1024,
         "tokens": {"hit": 480}, "eviction_policy": "cost",
         "tiers": {"host": {"capacity_bytes": 1024 * 300}},
         "model": {"sliding_window": {"tokens": 4096}}},
        {"replica": "b", "hit_curve": curve(0, [0, 0, 0, 0]), "bytes_per_block": 1024, "tokens": {"hit": 0}},
        {"replica": "c", "error": "connection refused"},
        {"replica": "d", "bytes_per_block": 1024},
        {"replica": "e", "hit_curve": None, "bytes_per_block": 1024}]}
    console = Console(width=200, record=True)
    console.print(render_hit_curves(fleet))
    rows = [" ".join(line.split()) for line in console.export_text().splitlines()]
    a, b, c, d, e = (rows.index(f"replica {name}") for name in "abcde")
    assert "0.5x 50 50.0 KiB 100 10.0% ██" in rows[a:b]
    assert "2x 200 200.0 KiB 700 70.0% ██████████████" in rows[a:b]
    notes = " ".join(rows[a:b])
    assert "2x the device's blocks would serve within 1 point of a cache that never evicts" in notes
    assert "kvd served 48.0% in fact (480 tokens), under cost eviction" in notes
    assert "lower tiers hold up to host 300 blocks more (uncompressed)" in notes
    assert "exact up to 150 blocks; larger sizes estimated from 25.00% of the older blocks" in notes
    assert "the model slides a window of 4,096 tokens" in notes
    assert rows[b + 1] == "no prompt admitted since kvd started: nothing to draw yet"
    flat = {"replica": "e", "hit_curve": curve(2, [500, 500, 500, 505]), "bytes_per_block": 1024}
    console = Console(width=200, record=True)
    console.print(render_hit_curves({"replica_status": [flat]}))
    assert ("even 0.5x the device's blocks would serve within 1 point of a cache that never evicts: the misses "
            "are blocks used for the first time") in " ".join(console.export_text().split())
    assert rows[c + 1] == "no answer: connection refused"
    assert rows[d + 1] == "this kvd reports no hit curve (it is older than kvctl hit-curve)"
    assert rows[e + 1] == "this kvd follows no hit curve (hit_curve: false in its settings)"
    assert curves_of(fleet)["replicas"][2] == {"replica": "c", "hit_curve": None, "error": "connection refused"}


def test_hit_curve_false_follows_nothing_and_exports_no_family(tmp_path):
    service = start_service(tmp_path, num_blocks=64, hit_curve="false")
    try:
        app = create_app(service, service.metrics, front="unix")
        complete(app, [11] + [7] * 70)
        complete(app, [11] + [7] * 70)
        assert service.engine.cache.hit_curve is None
        body = call(app, "GET", "/admin/status").json()
        assert body["hit_curve"] is None and body["tokens"]["hit"] == 64  # serving is as before
        assert "kvd_hit_curve" not in call(app, "GET", "/metrics").text
    finally:
        service.shutdown(deadline=2)


def test_a_cache_format_off_the_multiples_is_a_size_of_its_own(tmp_path):
    """int8 with layer 0 kept in float32: the model's dtype holds fewer blocks in the same memory (a
    size of its own, labelled with its multiple); fp8_e4m3 holds as many as int8 (not a size)."""
    from kvctl.daemon.engine.engine import Engine, EngineSettings
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.llama import load_model

    demo = load_model(ensure_demo_checkpoint(tmp_path))
    engine = Engine(demo, EngineSettings(num_blocks=64, block_size=16, cache_dtype="int8", keep_layers=(0,)))
    whole = demo.model.cache_bytes_per_block(16)  # every layer in float32
    layers = demo.config.num_layers
    assert engine.cache.block_bytes == whole // layers + (whole // layers) // 4 * (layers - 1)
    blocks = 64 * engine.cache.block_bytes // whole
    assert engine.format_blocks == {"auto": blocks} and blocks not in (8, 16, 32, 64)
    curve = engine.cache.hit_curve
    assert (f"{blocks / 64:.3g}", blocks) in list(zip(curve.labels, curve.sizes))
    assert curve.sizes == sorted(curve.sizes)


def test_each_tenant_s_part_of_the_curve_in_admin_tenants_and_kvctl_hit_curve(tmp_path, capsys):
    from .test_cli import cli
    from .test_health_checks import served_on

    service = start_service(tmp_path, num_blocks=64, max_tracked_tenants=3, max_tenant_metric_series=1)
    try:
        app = create_app(service, service.metrics, front="unix")
        a_b_c_a(app, tenants=("acme", "globex", "globex", "acme"))
        body = call(app, "GET", "/admin/tenants").json()
        assert body["hit_curve"]["sizes"][:2] == [{"times": "0.125", "blocks": 8}, {"times": "0.25", "blocks": 16}]
        assert body["hit_curve"]["retired"]["tenants"] == 0 and body["hit_curve"]["retired"]["prompt_tokens"] == 0
        rows = {row["tenant"]: row for row in body["tenants"]}
        acme, globex = rows["acme"]["hit_curve"], rows["globex"]["hit_curve"]
        # acme's second turn: its root was last used 8 blocks before (globex's two prompts)
        assert (acme["prompts"], acme["prompt_tokens"], acme["looked_tokens"]) == (2, 142, 128)
        assert (acme["hit_tokens"]["0.125"], acme["hit_tokens"]["0.25"], acme["hit_tokens"]["inf"]) == (0, 64, 64)
        assert set(globex["hit_tokens"].values()) == {0} and globex["prompts"] == 2
        sizes = call(app, "GET", "/admin/status").json()["hit_curve"]["sizes"]
        whole = {row["times"]: row["hit_tokens"] for row in sizes}
        assert {t: acme["hit_tokens"][t] + globex["hit_tokens"][t] for t in whole} == whole
        metrics = call(app, "GET", "/metrics").text  # acme has a series of its own, globex is summed under "*"
        series = dict(re.findall(r'^kvd_tenant_hit_curve_hit_tokens_total\{(tenant="[^"]*",times="[^"]*")\} (\S+)$',
                                 metrics, re.MULTILINE))
        assert series == {'tenant="*",times="1"': "0.0", 'tenant="acme",times="1"': "64.0",
                          'tenant="*",times="2"': "0.0", 'tenant="acme",times="2"': "64.0"}
        with served_on(app, str(tmp_path / "served.sock")) as path:
            status, out, err = cli(capsys, "--socket", path, "hit-curve", "--tenants")
            assert status == 0, err
            lines = [" ".join(line.split()) for line in out.splitlines()]
            assert "tenant prompt tokens kvd served LRU 0.5x LRU 1x LRU 2x LRU 4x never evicts" in lines
            assert lines.index("acme 142 45.1% 45.1% 45.1% 45.1% 45.1% 45.1%") \
                < lines.index("globex 142 0.0% 0.0% 0.0% 0.0% 0.0% 0.0%")  # (as many tokens: by name)
            assert "twice the blocks" not in out and "under plain LRU" not in out  # no gain, no tenant served under
            status, out, err = cli(capsys, "--socket", path, "hit-curve", "--tenant", "acme")
            lines = [" ".join(line.split()) for line in out.splitlines()]
            assert status == 0, err
            text = " ".join(lines)
            assert text.startswith("2 prompts of 'acme', 142 tokens (of them 128 in full blocks a cache can serve); "
                                   "one LRU cache of each size, shared by every tenant as kvd's is, would have "
                                   "served it:")
            assert "0.125x 8 0 0.0%" in lines and "1x (device) 64 64 45.1% █████████" in lines
            assert "never evicts - 64 45.1% █████████" in lines
            assert "0.25x the device's blocks would serve within 1 point of a cache that never evicts" in text
            assert "kvd served 'acme' 45.1% in fact (64 tokens)" in text
            status, out, _ = cli(capsys, "--socket", path, "hit-curve", "--tenant", "acme", "--json")
            answer = json.loads(out)
            assert status == 0 and answer["tenant"] == "acme" and answer["hit_curve"] == acme
            assert acme["served_tokens"] == 64 and globex["served_tokens"] == 0 and len(answer["sizes"]) == 11
            status, out, _ = cli(capsys, "--socket", path, "hit-curve", "--tenants", "--json")
            answer = json.loads(out)
            assert [row["tenant"] for row in answer["tenants"]] == ["acme", "globex"]
            assert answer["tenants"][1]["hit_curve"] == globex and answer["retired"]["tenants"] == 0
            status, _, err = cli(capsys, "--socket", path, "hit-curve", "--tenant", "initech")
            assert status != 0
            assert ("tenant: kvd lists no 'initech' among its 2 tenants (those active most recently, and those "
                    "holding blocks, pins or requests: kvctl hit-curve --tenants)") in " ".join(err.split())
            status, _, err = cli(capsys, "--socket", path, "hit-curve", "--tenant", "acme", "--tenants")
            assert status != 0 and "give --tenant or --tenants, not both" in err
        # fewer tenants followed: globex, the least recently active, goes from the curve's book too
        live = service.config
        from dataclasses import replace
        service.reload(replace(live, max_tracked_tenants=1))
        body = call(app, "GET", "/admin/tenants").json()
        rows = {row["tenant"]: row for row in body["tenants"]}
        assert rows["globex"]["cached_blocks"] > 0  # listed for its blocks, with no figures of the curve's
        assert rows["globex"]["hit_curve"]["prompts"] == 0
        assert set(rows["globex"]["hit_curve"]["hit_tokens"]) == set(whole)
        assert rows["acme"]["hit_curve"] == acme
        assert body["hit_curve"]["retired"]["tenants"] == 1 and body["hit_curve"]["retired"]["prompt_tokens"] == 142
    finally:
        service.shutdown(deadline=2)


def test_without_a_curve_tenants_have_none_and_kvctl_says_why(tmp_path, capsys):
    from .test_cli import cli
    from .test_health_checks import served_on

    service = start_service(tmp_path, num_blocks=64, hit_curve="false")
    try:
        app = create_app(service, service.metrics, front="unix")
        complete(app, [11] + [7] * 70, "acme")
        body = call(app, "GET", "/admin/tenants").json()
        assert body["hit_curve"] is None and body["tenants"][0]["hit_curve"] is None
        with served_on(app, str(tmp_path / "served.sock")) as path:
            for args in (("--tenants",), ("--tenant", "acme")):
                status, _, err = cli(capsys, "--socket", path, "hit-curve", *args)
                assert status != 0
                assert ("hit curve by tenant: kvd follows none (hit_curve: false in its settings, or a kvd older "
                        "than kvctl hit-curve --tenants)") in " ".join(err.split())
    finally:
        service.shutdown(deadline=2)


def tenant(name, prompt, served, lru, prompts=3):
    """A row of /admin/tenants: `served` of `prompt` tokens in fact; `lru` the curve's hit tokens at
    0.5x, 1x, 2x, 4x and never evicting."""
    return {"tenant": name, "prompt_tokens": prompt, "hit_tokens": served,
            "hit_curve": {"prompts": prompts, "prompt_tokens": prompt, "served_tokens": served,
                          "looked_tokens": prompt, "hit_tokens": dict(zip(("0.5", "1", "2", "4", "inf"), lru))}}


SIZES = [{"times": "0.5", "blocks": 50}, {"times": "1", "blocks": 100}, {"times": "2", "blocks": 200},
         {"times": "4", "blocks": 400}, {"times": "inf", "blocks": None}]


def test_the_tenant_table_names_who_twice_the_blocks_serves_most_and_whom_kvd_served_under_lru():
    from rich.console import Console

    from kvctl.hit_curve_tenants import render_tenant_curves

    body = {"hit_curve": {"sizes": SIZES, "retired": {"tenants": 7, "prompts": 9, "prompt_tokens": 2_000,
                                                      "looked_tokens": 1_900, "hit_tokens": {"1": 500}}},
            "tenants": [tenant("acme", 1_000, 300, [100, 400, 900, 950, 960]),  # +500 at 2x; 10 points under LRU
                        tenant("globex", 4_000, 2_000, [1_000, 2_000, 2_200, 2_300, 2_400]),  # +200 at 2x
                        tenant("hooli", 500, 50, [0, 100, 100, 100, 100]),  # 10 points under LRU
                        tenant("initech", 800, 0, [0] * 5),
                        tenant("pinned-only", 0, 0, [0] * 5, prompts=0)]}  # listed for its pins: no row drawn
    console = Console(width=100, record=True)
    console.print(render_tenant_curves(body, top=3))
    lines = [" ".join(line.split()) for line in console.export_text().splitlines()]
    assert "tenant prompt tokens kvd served LRU 0.5x LRU 1x LRU 2x LRU 4x never evicts" in lines
    rows = [line for line in lines if line.split(" ")[0] in ("acme", "globex", "hooli", "initech", "pinned-only")]
    assert rows == ["globex 4,000 50.0% 25.0% 50.0% 55.0% 57.5% 60.0%",
                    "acme 1,000 30.0% 10.0% 40.0% 90.0% 95.0% 96.0%",
                    "initech 800 0.0% 0.0% 0.0% 0.0% 0.0% 0.0%"]
    text = " ".join(lines)
    assert "and 1 more tenant (--top 0 lists every one)" in text
    assert ("7 tenants retired from the curve's book (max_tracked_tenants): 2,000 prompt tokens, LRU 1x 25.0%"
            in text)
    assert "twice the blocks would serve 'acme' the most more: 40.0% -> 90.0% (500 tokens more)" in text
    assert ("kvd served under plain LRU over its blocks: 'acme' (-10.0 points), 'hooli' (-10.0 points): other "
            "tenants' shares or priorities, pins, evictions by hand, or the blocks running requests hold") in text
    console = Console(width=100, record=True)
    console.print(render_tenant_curves(body, top=0))
    assert "hooli 500 10.0% 0.0% 20.0% 20.0% 20.0% 20.0%" in [" ".join(line.split())
                                                              for line in console.export_text().splitlines()]
    console = Console(width=100, record=True)
    console.print(render_tenant_curves({"hit_curve": {"sizes": SIZES, "retired": body["hit_curve"]["retired"]},
                                        "tenants": [tenant("pinned-only", 0, 0, [0] * 5, prompts=0)]}, top=3))
    assert console.export_text().strip() == "no tenant's prompt counted by the hit curve yet"


def test_kvd_router_sums_each_tenant_s_curve_over_the_sizes_every_replica_has():
    from rich.console import Console

    from kvctl.daemon.server.fleet_admin import merge_tenant_lists
    from kvctl.hit_curve_tenants import render_tenant_curve, render_tenant_curves

    def replica(rows, sizes, retired_tenants):
        return 200, {"tenants": rows, "blocks": 100, "hit_curve": {
            "sizes": sizes, "retired": {"tenants": retired_tenants, "prompts": 1, "prompt_tokens": 10,
                                        "served_tokens": 2, "looked_tokens": 8,
                                        "hit_tokens": {s["times"]: 4 for s in sizes}}}}

    with_format = SIZES[:3] + [{"times": "3.9", "blocks": 390}] + SIZES[3:]  # int8 with a layer kept: one replica
    status, body = merge_tenant_lists(["r0", "r1", "r2", "r3"], [
        replica([tenant("acme", 1_000, 300, [100, 400, 900, 950, 960])], SIZES, 2),
        replica([{**tenant("acme", 500, 100, [0, 100, 200, 200, 250]),
                  "hit_curve": {**tenant("acme", 500, 100, [0, 100, 200, 200, 250])["hit_curve"],
                                "hit_tokens": {"0.5": 0, "1": 100, "2": 200, "3.9": 200, "4": 200, "inf": 250}}}],
                with_format, 1),
        (200, {"tenants": [{"tenant": "acme", "prompt_tokens": 7, "hit_tokens": 7},  # an older kvd
                           {"tenant": "initech", "prompt_tokens": 9, "hit_tokens": 0}], "blocks": 100}),
        (None, {"error": "connection refused"})])
    assert status == 200
    assert body["hit_curve"]["sizes"] == [{"times": "0.5", "blocks": 100}, {"times": "1", "blocks": 200},
                                          {"times": "2", "blocks": 400}, {"times": "4", "blocks": 800},
                                          {"times": "inf", "blocks": None}]
    assert body["hit_curve"]["retired"] == {"tenants": 3, "prompts": 2, "prompt_tokens": 20, "served_tokens": 4,
                                            "looked_tokens": 16,
                                            "hit_tokens": {"0.5": 8, "1": 8, "2": 8, "3.9": 4, "4": 8, "inf": 8}}
    acme, initech = body["tenants"]
    assert initech["hit_curve"] is None  # only the older replica had it
    assert acme["prompt_tokens"] == 1_507 and acme["hit_tokens"] == 407
    assert acme["hit_curve"] == {"prompts": 6, "prompt_tokens": 1_500, "served_tokens": 400, "looked_tokens": 1_500,
                                 "hit_tokens": {"0.5": 100, "1": 500, "2": 1_100, "3.9": 200, "4": 1_150,
                                                "inf": 1_210}, "alone": None}
    console = Console(width=100, record=True)
    console.print(render_tenant_curve(body, "acme"))
    lines = [" ".join(line.split()) for line in console.export_text().splitlines()]
    assert "shared by every tenant as kvd's is (at each replica, their blocks summed), would have served it:" \
        in " ".join(lines)
    assert "2x 400 1,100 73.3% ███████████████" in lines
    assert not any(line.startswith("3.9x") for line in lines)
    assert "kvd served 'acme' 26.7% in fact (400 tokens)" in " ".join(lines)
    assert "not listed: r3 (connection refused)" in lines
    console = Console(width=100, record=True)
    console.print(render_tenant_curves(body, top=0))
    lines = [" ".join(line.split()) for line in console.export_text().splitlines()]
    assert lines[0].startswith("What one LRU cache of each size (times each replica's blocks, their figures summed,")
    assert [line.split()[0] for line in lines if line.startswith(("acme", "initech"))] == ["acme"]
    assert "not listed: r3 (connection refused)" in lines
    console = Console(width=100, record=True)
    console.print(render_tenant_curve(body, "initech"))
    assert console.export_text().strip() == "no prompt of 'initech' counted by the hit curve yet"
    _, none = merge_tenant_lists(["r0"], [(200, {"tenants": [{"tenant": "acme", "prompt_tokens": 1, "hit_tokens": 0}],
                                                 "blocks": 8})])
    assert none["hit_curve"] is None and none["tenants"][0]["hit_curve"] is None


def test_kvctl_hit_curve_last_draws_a_recent_window_and_refuses_what_kvd_does_not_keep(tmp_path, capsys):
    from .test_cli import cli
    from .test_health_checks import served_on

    service = start_service(tmp_path, num_blocks=64)
    try:
        app = create_app(service, service.metrics, front="unix")
        a_b_c_a(app)
        curve = call(app, "GET", "/admin/status").json()["hit_curve"]
        assert curve["served_tokens"] == 64
        five, hour = curve["recent"]
        assert (five["window"], hour["window"]) == (300, 3600) and five["seconds"] < 300
        for recent in (five, hour):  # younger than either window: since kvd started
            assert {key: recent[key] for key in ("prompts", "prompt_tokens", "served_tokens", "looked_tokens",
                                                 "sizes")} \
                == {key: curve[key] for key in ("prompts", "prompt_tokens", "served_tokens", "looked_tokens", "sizes")}
        with served_on(app, str(tmp_path / "served.sock")) as path:
            status, out, err = cli(capsys, "--socket", path, "hit-curve", "--last", "1h")
            assert status == 0, err
            rows = [" ".join(line.split()) for line in out.splitlines()]
            assert re.match(r"4 prompts, 284 tokens since kvd started, \d+s ago \(of them 256 in full blocks", rows[0])
            assert "1x (device) 64 1.0 MiB 64 22.5% █████" in rows
            assert "kvd served 22.5% in fact (64 tokens)" in " ".join(rows)
            status, _, err = cli(capsys, "--socket", path, "hit-curve", "--last", "2h")
            assert status != 0 and "last: must be 5m or 1h, got '2h'" in err
            status, _, err = cli(capsys, "--socket", path, "hit-curve", "--last", "5m", "--tenants")
            assert status != 0
            said = " ".join(err.split())
            assert ("last: the tenants' figures are since kvd started (give --last without --tenants; a tenant "
                    "followed alone, hit_curve_tenants, has recent windows: --tenant T --last 1h)") in said
    finally:
        service.shutdown(deadline=2)


def test_a_full_window_says_so_and_an_older_kvd_keeps_none():
    from rich.console import Console

    from kvctl.hit_curve_cmd import render_hit_curve

    since_start = curve(10, [100, 500, 700, 705])
    hour = {"window": 3600, "seconds": 3_630.0, "prompts": 2, "prompt_tokens": 200, "served_tokens": 50,
            "looked_tokens": 180,
            "sizes": [{**row, "hit_tokens": hits} for row, hits in zip(since_start["sizes"], [0, 50, 120, 150])]}
    five = {**hour, "window": 300, "seconds": 320.0, "prompts": 0, "prompt_tokens": 0, "served_tokens": 0,
            "looked_tokens": 0, "sizes": [{**row, "hit_tokens": 0} for row in since_start["sizes"]]}
    status = {"hit_curve": {**since_start, "served_tokens": 480, "recent": [five, hour]}, "bytes_per_block": 1024,
              "tokens": {"hit": 480}}

    def drawn(last):
        console = Console(width=200, record=True)
        console.print(render_hit_curve(status, last))
        return [" ".join(line.split()) for line in console.export_text().splitlines()]

    rows = drawn("1h")
    assert rows[0].startswith("2 prompts, 200 tokens in the last 1h (of them 180 in full blocks")
    assert "2x 200 200.0 KiB 120 60.0% ████████████" in rows
    assert "kvd served 25.0% in fact (50 tokens)" in " ".join(rows)
    assert drawn("5m") == ["no prompt admitted in the last 5m: nothing to draw yet"]
    assert drawn(None)[0].startswith("10 prompts, 1,000 tokens since kvd started")
    status["hit_curve"] = since_start  # a kvd from before the windows (and served_tokens)
    assert drawn("1h") == ["this kvd keeps no recent hit curve (it is older than kvctl hit-curve --last)"]
    assert "kvd served 48.0% in fact (480 tokens)" in " ".join(drawn(None))


def test_the_dashboard_s_hit_curve_panels_read_what_kvctl_hit_curve_shows(tmp_path):
    """The Grafana panels' PromQL on two scrapes of a real kvd: each size's hit ratio, each tenant's
    at 1x and 2x beside what kvd served it, and a tenant's alone at each share (the 6 h range is the
    scrapes' interval)."""
    from pathlib import Path

    from .promql_eval import Scrapes, samples

    dashboard = json.loads((Path(__file__).parent.parent / "examples" / "grafana" / "kvd.json").read_text())
    panels = {panel["title"].split(":")[0]: panel for panel in dashboard["panels"]}
    service = start_service(tmp_path, num_blocks=64, max_tenant_metric_series=1, hit_curve_tenants="acme")
    try:
        app = create_app(service, service.metrics, front="unix")
        complete(app, [99] * 5, "acme")  # shorter than a block: every series shows, nothing is cached
        complete(app, [98] * 5, "globex")

        def scrape():
            return samples(call(app, "GET", "/metrics").text, job="kvd", instance="kvd-0:8000")

        before = scrape()
        a_b_c_a(app, tenants=("acme", "globex", "globex", "acme"))
        scrapes = Scrapes(before, scrape())

        def evaluated(panel, ref):
            expr = next(t["expr"] for t in panels[panel]["targets"] if t["refId"] == ref)
            return {tuple(sorted((k, v) for k, v in labels if k in ("tenant", "times", "share"))): round(value, 4)
                    for labels, value in scrapes.evaluate(expr.replace("$instance", ".*")).items()}

        curve = evaluated("Hit curve", "A")
        assert curve[(("times", "0.125"),)] == 0.0 and curve[(("times", "1"),)] == round(64 / 284, 4)
        assert len(curve) == 11
        assert evaluated("Hit curve", "B") == {(): round(64 / 284, 4)}
        acme = round(64 / 142, 4)  # globex, summed under "*", had no hit at either size
        assert evaluated("Hit curve by tenant", "A") == {
            (("tenant", "acme"), ("times", "1")): acme, (("tenant", "acme"), ("times", "2")): acme,
            (("tenant", "*"), ("times", "1")): 0.0, (("tenant", "*"), ("times", "2")): 0.0}
        assert evaluated("Hit curve by tenant", "B") == {(("tenant", "acme"),): acme, (("tenant", "*"),): 0.0}
        alone = evaluated("Share sizing", "A")  # alone, a's second turn hits at every share (4 blocks and up)
        assert alone == {(("share", share), ("tenant", "acme")): acme
                         for share in ("0.0625", "0.125", "0.25", "0.5", "0.75", "1", "inf")}
    finally:
        service.shutdown(deadline=2)


def test_a_tenant_followed_alone_shows_the_share_that_would_serve_it(tmp_path, capsys):
    """tenant_cache_shares names acme, so the curve follows it alone: its second turn hits in a
    cache of its own of 4 blocks (a share of 0.0625), where the cache it shares needed 16."""
    from dataclasses import replace

    from .test_cli import cli
    from .test_health_checks import served_on

    service = start_service(tmp_path, num_blocks=64, tenant_cache_shares="acme=0.5,*=0.5")
    try:
        app = create_app(service, service.metrics, front="unix")
        a_b_c_a(app, tenants=("acme", "globex", "globex", "acme"))
        body = call(app, "GET", "/admin/tenants").json()
        assert body["hit_curve"]["alone_sizes"] == [
            {"times": "0.0625", "blocks": 4}, {"times": "0.125", "blocks": 8}, {"times": "0.25", "blocks": 16},
            {"times": "0.5", "blocks": 32}, {"times": "0.75", "blocks": 48}, {"times": "1", "blocks": 64},
            {"times": "inf", "blocks": None}]
        rows = {row["tenant"]: row for row in body["tenants"]}
        alone = rows["acme"]["hit_curve"]["alone"]
        assert (alone["prompts"], alone["prompt_tokens"], alone["served_tokens"]) == (2, 142, 64)
        assert set(alone["hit_tokens"].values()) == {64}  # a's blocks, 3 of its own used since
        # the recent windows: the curve is younger than both, so each covers all of it
        assert [(w["window"], w["prompt_tokens"], w["hit_tokens"]) for w in alone["recent"]] \
            == [(300, 142, alone["hit_tokens"]), (3600, 142, alone["hit_tokens"])]
        assert rows["acme"]["hit_curve"]["hit_tokens"]["0.125"] == 0  # shared: globex's 8 blocks came between
        assert rows["globex"]["hit_curve"]["alone"] is None
        with served_on(app, str(tmp_path / "served.sock")) as path:
            status, out, err = cli(capsys, "--socket", path, "hit-curve", "--tenant", "acme")
            assert status == 0, err
            lines = [" ".join(line.split()) for line in out.splitlines()]
            text = " ".join(lines)
            assert ("Alone, in a cache of its own of each share of the device's blocks (tenant_cache_shares), the "
                    "same 2 prompts of 'acme' would have been served") in text
            assert "0.0625 4 64 45.1% █████████" in lines
            assert "0.5 (its share) 32 64 45.1% █████████" in lines
            assert ("a share of 0.0625 (4 blocks) would serve 'acme' within 1 point of a cache of its own that never "
                    "evicts (tenant_cache_shares: acme=0.0625)") in text
            status, out, _ = cli(capsys, "--socket", path, "hit-curve", "--tenants")
            assert "followed alone too, to size their shares by (kvctl hit-curve --tenant T): acme" \
                in " ".join(out.split())
            status, out, _ = cli(capsys, "--socket", path, "hit-curve", "--tenant", "acme", "--json")
            answer = json.loads(out)
            assert without_spans(answer["hit_curve"]["alone"]) == without_spans(alone)
            assert answer["alone_sizes"][0] == {"times": "0.0625", "blocks": 4}
            # over the last hour (all of it: kvd is younger), the share its traffic needs now
            status, out, err = cli(capsys, "--socket", path, "hit-curve", "--tenant", "acme", "--last", "1h")
            assert status == 0, err
            lines = [" ".join(line.split()) for line in out.splitlines()]
            text = " ".join(lines)
            assert re.search(r"the same 2 prompts of 'acme' would have been served since it was followed, \d+s ago:",
                             text), text
            assert "0.5 (its share) 32 64 45.1% █████████" in lines and "Alone" in lines[0]
            assert "its part of the shared curve is counted since kvd started: kvctl hit-curve --tenant acme" in text
            status, out, _ = cli(capsys, "--socket", path, "hit-curve", "--tenant", "acme", "--last", "5m", "--json")
            answer = json.loads(out)
            assert status == 0 and answer["tenant"] == "acme" and answer["alone_sizes"][0]["blocks"] == 4
            assert without_spans({"recent": [answer["alone"]]}) == without_spans({"recent": alone["recent"][:1]})
            status, _, err = cli(capsys, "--socket", path, "hit-curve", "--tenant", "globex", "--last", "5m")
            assert status != 0
            said = " ".join(err.split())
            assert ("last: 'globex' is not followed alone (hit_curve_tenants), and its part of the shared curve is "
                    "counted since kvd started: kvctl hit-curve --tenant globex without --last") in said
            service.reload(replace(service.config, hit_curve_tenants=("globex", "initech")))
            body = call(app, "GET", "/admin/tenants").json()
            rows = {row["tenant"]: row for row in body["tenants"]}
            assert rows["acme"]["hit_curve"]["alone"] is None  # no longer named: let go
            assert rows["globex"]["hit_curve"]["alone"]["prompts"] == 0  # followed from now
            assert rows["initech"]["hit_curve"]["alone"]["prompts"] == 0  # named: listed before any prompt
            complete(app, [11] + [7] * 70, "globex")
            status, out, _ = cli(capsys, "--socket", path, "hit-curve", "--tenant", "globex")
            text = " ".join(out.split())
            assert "the same 1 prompts of 'globex' would have been served" in text
            assert "0.5 (its share) 32 0 0.0%" in [" ".join(line.split()) for line in out.splitlines()]  # "*"'s
    finally:
        service.shutdown(deadline=2)


def test_hit_curve_tenants_is_checked_where_it_is_given():
    from kvctl.daemon.config import ConfigError, resolve

    assert resolve({"hit_curve_tenants": ["acme", "docs", "acme"]}, env={}).hit_curve_tenants == ("acme", "docs")
    assert resolve({}, env={"KVD_HIT_CURVE_TENANTS": "acme, docs"}).hit_curve_tenants == ("acme", "docs")
    with pytest.raises(ConfigError, match=r"hit_curve_tenants: invalid value .* at most 8 tenants, got 9"):
        resolve({"hit_curve_tenants": [f"t{i}" for i in range(9)]}, env={})
    with pytest.raises(ConfigError, match=r"hit_curve_tenants: invalid value .*tenant 'a b' is not a tenant name"):
        resolve({"hit_curve_tenants": "acme,a b"}, env={})
    with pytest.raises(ConfigError) as refused:
        resolve({"hit_curve_tenants": "acme"}, env={"KVD_HIT_CURVE": "false"})
    assert str(refused.value) == ("hit_curve_tenants: set (from --hit-curve-tenants) but hit_curve is false: the "
                                  "tenants are followed beside the curve; set hit_curve: true")


def test_kvd_router_sums_a_tenant_s_curve_alone_over_the_replicas_that_follow_it():
    from kvctl.daemon.server.fleet_admin import merge_tenant_lists

    alone_sizes = [{"times": "0.5", "blocks": 50}, {"times": "1", "blocks": 100}, {"times": "inf", "blocks": None}]

    def replica(alone):
        row = tenant("acme", 1_000, 300, [100, 400, 900, 950, 960])
        row["hit_curve"]["alone"] = alone
        return 200, {"tenants": [row], "blocks": 100, "hit_curve": {
            "sizes": SIZES, "alone_sizes": alone_sizes if alone else [],
            "retired": {"tenants": 0, "prompts": 0, "prompt_tokens": 0, "served_tokens": 0, "looked_tokens": 0,
                        "hit_tokens": {}}}}

    def figures(hits, prompts=3):
        return {"prompts": prompts, "prompt_tokens": 1_000, "served_tokens": 300, "looked_tokens": 900,
                "hit_tokens": dict(zip(("0.5", "1", "inf"), hits))}

    def alone(hits, seconds=(300.0, 3600.0)):
        tenth = figures([h // 10 for h in hits], 1)
        return {**figures(hits), "recent": [{"window": 300, "seconds": seconds[0], **tenth},
                                            {"window": 3600, "seconds": seconds[1], **figures(hits, 2)}]}

    _, body = merge_tenant_lists(["r0", "r1", "r2"], [replica(alone([500, 800, 900])),
                                                      replica(alone([100, 200, 300], (290.5, 1200.0))),
                                                      replica(None)])  # r2 does not follow acme alone
    (acme,) = body["tenants"]
    summed = {"prompt_tokens": 2_000, "served_tokens": 600, "looked_tokens": 1_800}
    assert acme["hit_curve"]["alone"] == {
        "prompts": 6, **summed, "hit_tokens": {"0.5": 600, "1": 1_000, "inf": 1_200},
        # each window over the span every replica's covers (r1's curve is 20 minutes old)
        "recent": [{"window": 300, "seconds": 290.5, "prompts": 2, **summed,
                    "hit_tokens": {"0.5": 60, "1": 100, "inf": 120}},
                   {"window": 3600, "seconds": 1200.0, "prompts": 4, **summed,
                    "hit_tokens": {"0.5": 600, "1": 1_000, "inf": 1_200}}]}
    older = {key: value for key, value in alone([1, 2, 3]).items() if key != "recent"}  # a kvd before the windows
    _, body = merge_tenant_lists(["r0", "r1"], [replica(alone([500, 800, 900])), replica(older)])
    assert body["tenants"][0]["hit_curve"]["alone"]["recent"] is None
    assert body["tenants"][0]["hit_curve"]["alone"]["hit_tokens"] == {"0.5": 501, "1": 802, "inf": 903}
    assert acme["hit_curve"]["prompts"] == 9  # the shared curve: every replica's
    assert body["hit_curve"]["alone_sizes"] == [{"times": "0.5", "blocks": 100}, {"times": "1", "blocks": 200},
                                                {"times": "inf", "blocks": None}]


def test_the_tenants_curves_are_copied_under_the_engine_s_lock_and_made_after_it(tmp_path, monkeypatch):
    """At 10,000 tenants a row each, the figures are made after the lock, as the tenants' rows are
    (test_api's test_the_tenants_rows_are_made_after_the_engines_lock): only copies are made under it."""
    from kvctl.daemon.cache.hit_curve import HitCurve

    from .daemon_fixtures import holds_engine_lock

    service = start_service(tmp_path, num_blocks=64, tenant_cache_shares="acme=0.5,*=0.5")
    try:
        app = create_app(service, service.metrics, front="unix")
        a_b_c_a(app, tenants=("acme", "globex", "globex", "acme"))
        made, figures = [], HitCurve.row_figures

        def watched(curve, row, block_size, sizes=False):
            made.append(holds_engine_lock(service))
            return figures(curve, row, block_size, sizes)

        monkeypatch.setattr(HitCurve, "row_figures", watched)
        body = call(app, "GET", "/admin/tenants").json()
        assert body["tenants"][0]["hit_curve"]["alone"]["prompts"] == 2
        # acme's and globex's rows, the retired sum, acme alone (since followed, over 5 minutes and an hour)
        assert made == [False] * 6
    finally:
        service.shutdown(deadline=2)
