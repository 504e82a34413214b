"""The hit curve as kvd reports it: /admin/status's hit_curve and the kvd_hit_curve_* families."""

from __future__ import annotations

import json
import re

from kvctl.daemon.server.app import create_app

from .daemon_fixtures import call, start_service


def complete(app, ids) -> None:
    answer = call(app, "POST", "/v1/completions", json={"prompt": ids, "max_tokens": 2, "temperature": 0,
                                                        "ignore_eos": True})
    assert answer.status_code == 200, answer.text


def test_status_and_metrics_say_what_a_cache_of_each_size_would_have_served(tmp_path):
    service = start_service(tmp_path, num_blocks=64)
    try:
        app = create_app(service, service.metrics, front="unix")
        prompts = {name: [first] + [7] * 70 for name, first in (("a", 11), ("b", 12), ("c", 13))}  # 4 full blocks
        for name in ("a", "b", "c", "a"):
            complete(app, prompts[name])
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
        prompts = {name: [first] + [7] * 70 for name, first in (("a", 11), ("b", 12), ("c", 13))}
        for name in ("a", "b", "c", "a"):
            complete(app, prompts[name])
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
