"""Quantised caches in service: scale derivation, quality against the float cache, the
calibration job's storage, skip, refusal and apply, and the scale version in the namespace."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")

from kvctl.daemon import calibration as cal  # noqa: E402
from kvctl.daemon.model.demo import ensure_demo_checkpoint  # noqa: E402
from kvctl.daemon.model.llama import load_model  # noqa: E402
from kvctl.kernels import cache_dtype  # noqa: E402

from .daemon_fixtures import apps, call, start_service, token_table  # noqa: E402

TEXTS = ["The cache keeps blocks of tokens for every tenant and evicts the least useful first. " * 3,
         "def route(request):\n    return replicas[hash(request.prefix) % len(replicas)]\n" * 4,
         "Operators pin system prompts, watch hit ratios and roll policies out to cohorts. " * 3,
         '{"tier": "device", "hits": 3}\n{"tier": "host", "hits": 0}\n' * 6]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return load_model(ensure_demo_checkpoint(tmp_path_factory.mktemp("state")))


def test_scales_come_from_the_maxima_and_the_margin():
    k_max = torch.tensor([[224.0, 448.0], [1.0, 0.0]])
    v_max = torch.tensor([[127.0, 63.5], [0.5, 2.0]])
    fp8 = cal.derive_scales(k_max, v_max, "fp8_e4m3", margin=1.0)
    assert fp8[0][0] == pytest.approx([0.5, 1.0]) and fp8[1][0][1] == pytest.approx(1e-6 / 448)
    int8 = cal.derive_scales(k_max, v_max, "int8", margin=2.0)
    assert int8[0][1] == pytest.approx([2.0, 1.0]) and int8[1][1] == pytest.approx([1 / 127, 4 / 127])


def test_measured_maxima_are_the_maxima_the_model_produces(demo):
    prompts = [demo.tokenizer.encode(t) for t in TEXTS[:2]]
    k_max, v_max = cal.measure_absmax(demo, prompts)
    seen = {}

    def record(layer, k, v):
        seen.setdefault(layer, []).append((k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2))))

    for ids in prompts:
        caches, blocks = cal._scratch(demo, len(ids))
        demo.model.forward(cal._batch(ids, 0, blocks, all_rows=False), caches, observer=record)
    for layer, pairs in seen.items():
        assert torch.equal(k_max[layer], torch.stack([p[0] for p in pairs]).amax(0))
        assert torch.equal(v_max[layer], torch.stack([p[1] for p in pairs]).amax(0))


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_quantised_cache_agrees_with_the_float_cache(demo, dtype):
    """log q_i - log p_i moves by at most 2 delta when every logit moves by at most delta, so
    KL(p || q) <= 2 delta with delta the largest logit change we measure."""
    prompts = [demo.tokenizer.encode(t) for t in TEXTS]
    scales = cal.derive_scales(*cal.measure_absmax(demo, prompts[:2]), dtype, margin=1.0)
    for ids in prompts[2:]:
        ref = cal._logits(demo, ids, None, (), None)
        quant = cal._logits(demo, ids, cache_dtype(dtype), (), scales)
        delta = float((ref - quant).abs().max())
        metrics = cal.compare(demo, ids, cache_dtype(dtype), (), scales, 16)
        assert 0 < metrics["kl"] <= 2 * delta
        # Given the same context, the greedy (top-1) token is the same at most positions.
        assert metrics["top1"] >= 0.9
        assert metrics["match"] >= 1  # the first generated token agrees


def test_calibration_batches_are_built_on_the_models_device():
    """On a GPU the model's weights and caches are CUDA tensors: the prompt batch must be too."""
    batch = cal._batch([5, 6, 7], 2, 3, all_rows=True)
    assert (batch.input_ids.tolist(), batch.positions.tolist(), batch.slot_mapping.tolist()) == (
        [5, 6, 7], [2, 3, 4], [2, 3, 4])
    assert (batch.query_start_loc.tolist(), batch.context_lens.tolist(), batch.block_tables.tolist(),
            batch.logits_indices.tolist()) == ([0, 3], [5], [[0, 1, 2]], [0, 1, 2])
    assert cal._batch([9], 4, 1, all_rows=False).logits_indices.tolist() == [0]
    on_meta = cal._batch([5, 6, 7], 2, 3, all_rows=False, device="meta")
    tensors = [getattr(on_meta, name) for name in ("input_ids", "positions", "slot_mapping", "query_start_loc",
                                                    "context_lens", "block_tables", "logits_indices")]
    assert {t.device.type for t in tensors} == {"meta"}
    assert [t.dtype for t in tensors] == [torch.int64] * 3 + [torch.int32] * 3 + [torch.int64]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_calibration_compares_formats_with_the_model_on_a_gpu(tmp_path):
    gpu = load_model(ensure_demo_checkpoint(tmp_path), device="cuda")
    prompts = [gpu.tokenizer.encode(t) for t in TEXTS]
    scales = cal.derive_scales(*cal.measure_absmax(gpu, prompts[:2]), "int8", margin=1.0)
    metrics = cal.compare(gpu, prompts[2], cache_dtype("int8"), (), scales, 8)
    assert metrics["kl"] > 0 and metrics["top1"] >= 0.9 and metrics["match"] >= 1


def test_a_quantised_cache_without_calibration_refuses_to_start(tmp_path):
    from kvctl.daemon.config import resolve
    from kvctl.daemon.server.service import EngineService
    from kvctl.daemon.store import Store

    config = resolve({"state_dir": str(tmp_path), "socket": str(tmp_path / "s"), "num_blocks": 32,
                      "cache_dtype": "fp8_e4m3"}, env={})
    service = EngineService(config, Store(tmp_path / "kvd.sqlite3"))
    with pytest.raises(ValueError, match="cache_dtype: fp8_e4m3 has no applied calibration"):
        service.load()
    loud = start_service(tmp_path, cache_dtype="fp8_e4m3", allow_uncalibrated=True)
    try:
        unix, _ = apps(loud, token_table(tmp_path))
        cache = call(unix, "GET", "/admin/status").json()["cache"]
        assert cache["uncalibrated"] is True and cache["scale_version"] == "unit"
        assert "kvd_cache_uncalibrated 1.0" in call(unix, "GET", "/metrics").text
    finally:
        loud.shutdown(1)


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 9), False), ((9, 0), False)])
def test_an_fp8_e4m3_cache_on_a_gpu_without_it_is_refused_before_the_model_loads(tmp_path, monkeypatch,
                                                                                   capability, refused):
    """Triton has no float8_e4m3 on compute capability 8.0 (A100): kvd says so and names the
    formats that do run there, instead of failing to compile at the first request."""
    import torch

    from kvctl.daemon.config import resolve
    from kvctl.daemon.server import service as service_module
    from kvctl.daemon.store import Store

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU this test stands in for
    loads = []
    monkeypatch.setattr(service_module, "load_model", lambda *a, **k: loads.append(a) or (_ for _ in ()).throw(
        RuntimeError("model loading reached")))
    config = resolve({"state_dir": str(tmp_path), "socket": str(tmp_path / "s"), "num_blocks": 32,
                      "cache_dtype": "fp8_e4m3", "device": "cuda"}, env={})
    service = service_module.EngineService(config, Store(tmp_path / "kvd.sqlite3"))
    if refused:
        with pytest.raises(ValueError) as info:
            service.load()
        assert str(info.value) == ("cache_dtype: fp8_e4m3 needs a GPU of compute capability 8.9 or newer "
                                   "(L4, L40S, H100, H200); this one is 8.0: use fp8_e5m2 or int8")
        assert loads == []
    else:
        with pytest.raises(RuntimeError, match="model loading reached"):
            service.load()


def test_calibrating_for_fp8_e4m3_on_a_gpu_without_it_is_refused_by_name(tmp_path, monkeypatch):
    import torch

    from kvctl.daemon.server.calibrate_ops import calibrate
    from kvctl.daemon.server.calls import ServiceError

    service = start_service(tmp_path)
    try:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        monkeypatch.setattr(service.loaded.model, "device", torch.device("cuda"))  # as on an A100
        with pytest.raises(ServiceError) as info:
            calibrate(service, dtype="fp8_e4m3", prompts=None, greedy_tokens=4, max_kl=0.1, margin=1.0,
                      slices=[64], if_older_than=None, apply=False, principal=None)
        assert info.value.status == 400 and info.value.param == "dtype"
        assert str(info.value).startswith("dtype: fp8_e4m3 needs a GPU of compute capability 8.9 or newer")
        assert service.store.calibration(service.loaded.revision, "fp8_e4m3", applied=False) is None
    finally:
        monkeypatch.undo()
        service.shutdown(1)


@pytest.mark.parametrize("margin", [0.5, 100.5, 1e308, float("nan")])
def test_a_margin_outside_1_to_100_is_refused_and_nothing_is_stored(tmp_path, margin):
    from kvctl.daemon.server.calibrate_ops import calibrate
    from kvctl.daemon.server.calls import ServiceError

    service = start_service(tmp_path)
    try:
        with pytest.raises(ServiceError) as info:
            calibrate(service, dtype="int8", prompts=None, greedy_tokens=4, max_kl=0.1, margin=margin,
                      slices=[64], if_older_than=None, apply=False, principal=None)
        assert (info.value.status, info.value.param) == (400, "margin")
        assert str(info.value) == (f"margin: must be from 1.0 to 100, got {margin} (scale = absmax x margin / the "
                                   "format's largest value: at 100 int8 keeps one step for the largest)")
        assert service.store.calibration(service.loaded.revision, "int8", applied=False) is None
    finally:
        service.shutdown(1)


def test_slices_that_name_no_context_length_are_refused_by_name(tmp_path):
    from kvctl.daemon.server.calibrate_ops import calibrate
    from kvctl.daemon.server.calls import ServiceError

    service = start_service(tmp_path)
    try:
        for slices, message, param in [
                ([], "slices: must name at least one context length, got []", "slices"),
                ([64, 0], "slices[1]: must be a context length of 1 token or more, got 0", "slices[1]")]:
            with pytest.raises(ServiceError) as info:
                calibrate(service, dtype="int8", prompts=None, greedy_tokens=4, max_kl=0.1, margin=1.0,
                          slices=slices, if_older_than=None, apply=False, principal=None)
            assert (info.value.status, str(info.value), info.value.param) == (400, message, param)
        assert service.store.calibration(service.loaded.revision, "int8", applied=False) is None
    finally:
        service.shutdown(1)


def test_only_fp8_e4m3_depends_on_the_compute_capability():
    import torch

    from kvctl.kernels import format_unsupported

    assert "use fp8_e5m2 or int8" in format_unsupported(torch.float8_e4m3fn, (8, 6))
    for dtype in (torch.float8_e5m2, torch.int8, torch.bfloat16, torch.float16, torch.float32):
        assert format_unsupported(dtype, (8, 0)) is None
    assert format_unsupported(torch.float8_e4m3fn, (8, 9)) is None


def test_calibrate_store_skip_refuse_apply_and_serve(tmp_path, caplog):
    """Also: a pin made under one cache format or set of scales is stranded once kvd serves
    another (its keys name them): kvd says so at the start and when new scales load."""
    import logging

    service = start_service(tmp_path)
    unix, _ = apps(service, token_table(tmp_path))
    body = {"dtype": "fp8_e4m3", "prompts": TEXTS, "max_tokens": 4, "slices": [512], "max_kl": 1.0}
    try:
        float_pin = call(unix, "POST", "/admin/pins", json={"text": TEXTS[2]}).json()
        first = call(unix, "POST", "/admin/calibrate", json=body).json()
        assert first["calibration_id"] == 1 and first["meets_target"] is True and first["applied"] is False
        assert [s["max_context"] for s in first["slices"]] == [512]
        assert set(first["slices"][0]) >= {"kl", "top1_agreement", "greedy_match_len", "ppl_delta"}
        assert len(first["layer_sensitivity"]) == 2
        skipped = call(unix, "POST", "/admin/calibrate", json={**body, "dtype": "fp8", "if_older_than": 3600}).json()
        assert skipped["skipped"] is True and skipped["calibration_id"] == 1  # fp8 is fp8_e4m3, as in vLLM
        assert skipped["dtype"] == "fp8_e4m3"
        assert skipped["reason"] == (f"calibration 1 was made {int(skipped['age_seconds'])}s ago, "
                                     "within if_older_than 1h")
        strict = call(unix, "POST", "/admin/calibrate", json={**body, "max_kl": 1e-12, "apply": True}).json()
        assert strict["applied"] is False and strict["meets_target"] is False
        assert strict["refused"].startswith(f"apply: calibration {strict['calibration_id']} misses the target: "
                                            "worst slice KL")
        assert "> max_kl 1e-12 (by " in strict["refused"]
        applied = call(unix, "POST", "/admin/calibrate", json={**body, "apply": True}).json()
        assert applied["applied"] is True and applied["takes_effect"] == "when kvd serves cache_dtype fp8_e4m3"
    finally:
        service.shutdown(1)
    with caplog.at_level(logging.WARNING, logger="kvd"):
        service = start_service(tmp_path, cache_dtype="fp8_e4m3")
    stranded_logs = [r.getMessage() for r in caplog.records if "no request can reach" in r.getMessage()]
    assert stranded_logs == [
        f"pins restored from the store: 1 pins ({float_pin['pin_id']}) hold {float_pin['blocks']} blocks no request "
        "can reach now (made under a model revision, tokenizer, cache format, scales or block size kvd no longer "
        "serves); pin their prompts again, then kvctl unpin --stranded"]
    try:
        unix, _ = apps(service, token_table(tmp_path))
        [restored] = call(unix, "GET", "/admin/pins").json()["pins"]
        assert (restored["pin_id"], restored["stranded"]) == (float_pin["pin_id"], "space")
        assert restored["space"] != service.block_space()
        fp8_pin = call(unix, "POST", "/admin/pins", json={"text": TEXTS[2]}).json()
        assert fp8_pin["pin_id"] != float_pin["pin_id"]
        status = call(unix, "GET", "/admin/status").json()
        assert status["stranded_pins"] == 1
        cache = status["cache"]
        assert cache["scale_set"]["id"] == applied["calibration_id"] and cache["scales_verified"] is True
        # float32 demo model: an fp8 cache holds four times the tokens in the same bytes
        assert status["bytes_per_token"] == 2 * 2 * 1 * 64 * 1
        assert status["extra_tokens_vs_model_dtype"] == 3 * status["capacity_tokens"]
        assert cache["scale_version"] == f"cal-{applied['calibration_id']}" and cache["uncalibrated"] is False
        prompt = {"prompt": TEXTS[0], "max_tokens": 2}
        call(unix, "POST", "/v1/completions", json=prompt)
        warm = call(unix, "POST", "/v1/completions", json=prompt).json()
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        caplog.set_level(logging.INFO, logger="kvd")
        live = call(unix, "POST", "/admin/calibrate", json={**body, "margin": 1.2, "apply": True}).json()
        assert live["takes_effect"].startswith("now")
        for _ in range(100):
            if service.engine.scale_version == f"cal-{live['calibration_id']}":
                break
            import time
            time.sleep(0.05)
        after = call(unix, "POST", "/v1/completions", json=prompt).json()
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # new scales, new namespace
        # the trees cached under the scales before went as the new ones loaded (no request reaches
        # them; a hot one would have outlived fresh blocks under lfu), but for the pinned one: stale
        rows = call(unix, "GET", "/admin/prefixes").json()["prefixes"]
        assert [(r["tokens"], r["hits"], r["pinned"], r["stale"]) for r in rows] == [
            (256, 0, False, False), (240, 0, True, True)]
        status = call(unix, "GET", "/admin/status").json()
        assert status["evictions"] == {"capacity": 0, "operator": 0, "tenant_share": 0, "space": 16, "sleep": 0, "private": 0}
        assert 'kvd_evicted_blocks_total{reason="space"} 16.0' in call(unix, "GET", "/metrics").text
        from .test_router import _kvctl_prints

        [evictions] = [line for line in _kvctl_prints(["status"], status).splitlines() if "evictions" in line]
        assert evictions.split(None, 1)[1].rstrip() == "0 by lru, 0 by operators, 16 made under scales since replaced"
        assert f"calibration {live['calibration_id']} loaded into the kernels; 16 cached blocks made under the " \
               "scales before were dropped (no request reaches them)" in [r.getMessage() for r in caplog.records]
        refused = call(unix, "POST", "/admin/pins", json={"prefix": rows[1]["prefix_id"]})
        assert refused.status_code == 409 and refused.json()["error"]["message"] == (
            f"prefix: {rows[1]['prefix_id']!r} is unreachable (made under a model revision, tokenizer, cache format, "
            "scales or block size kvd no longer serves); pin it by its text to compute it again")
        # the pin made under the scales before: stranded as they went (logged by the engine's thread)
        assert [(p["pin_id"], p["stranded"]) for p in call(unix, "GET", "/admin/pins").json()["pins"]] == [
            (float_pin["pin_id"], "space"), (fp8_pin["pin_id"], "space")]
        assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("calibration ")][-1] == (
            f"calibration {live['calibration_id']}: 1 pins ({fp8_pin['pin_id']}) hold {fp8_pin['blocks']} blocks no "
            "request can reach now (made under a model revision, tokenizer, cache format, scales or block size kvd "
            "no longer serves); pin their prompts again, then kvctl unpin --stranded")
        assert call(unix, "GET", "/admin/status").json()["cache"]["scales_verified"] is True
        # unpinning the stranded pin drops its cached blocks too
        assert call(unix, "DELETE", f"/admin/pins/{fp8_pin['pin_id']}").json() == {
            "pin_id": fp8_pin["pin_id"], "unpinned_blocks": 15, "dropped_stale_blocks": 15}
        assert [r["stale"] for r in call(unix, "GET", "/admin/prefixes").json()["prefixes"]] == [False]
        assert call(unix, "GET", "/admin/status").json()["evictions"]["space"] == 31
        actions = [e["result"] for e in call(unix, "GET", "/admin/audit", params={"action": "calibrate"}).json()["entries"]]
        assert actions == ["applied", "applied", "refused", "stored"]
    finally:
        service.shutdown(1)


def test_kvctl_calibrate_names_the_line_and_field_of_a_prompts_file_it_cannot_use(capsys, tmp_path):
    """The file is refused before kvd is asked: each line's fault by number and field."""
    from .test_cli import cli

    cases = {'{"text": 5}': "line 2: 'text' must be a string, got 5",
             '{"tokens": "1,2,3"}': "line 2: 'tokens' must be a list of token ids, got \"1,2,3\"",
             '{"prompt": "hi"}': "line 2 needs a 'text' or 'tokens' field",
             "not json": "line 2 is not JSON"}
    for line, said in cases.items():
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"text": "a good one"}\n' + line + "\n")
        status, _, err = cli(capsys, "--socket", str(tmp_path / "none.sock"), "calibrate", "--prompts", str(prompts))
        assert status == 2 and " ".join(err.split()) == f"error: prompts: prompts.jsonl {said}"
