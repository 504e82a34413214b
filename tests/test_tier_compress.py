"""Compressed lower tiers (`tier_compress`): the codec's rules and bounds, the payload's version
and size, blocks written before a change of setting, a quantised device cache, the engine
restoring a compressed prefix, and the operator surface (config, reload, kvctl tiers)."""

from __future__ import annotations

import struct

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
xxhash = pytest.importorskip("xxhash")

from kvctl.daemon.cache.tiers import BlockLayout, BlockMeta, PayloadError, decode_block, encode_blocks  # noqa: E402
from kvctl.daemon.cache.tiers.codec import check_codec, compress, decompress, error_bound  # noqa: E402
from kvctl.daemon.cache.tiers.payload import encode_parts  # noqa: E402

from .daemon_fixtures import call, start_service  # noqa: E402
from .tier_engine import TEXT_A, demo, engine_with, generate, push_out  # noqa: E402,F401,F811
from .tier_fixtures import redis_server  # noqa: E402,F401

SPACE = b"S" * 32
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def _metas(n: int) -> list[BlockMeta]:
    return [BlockMeta(bytes([i + 1]) * 32, b"r" * 32, 0, None) for i in range(n)]


def _group(layout: BlockLayout, n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (n, layout.block_size, layout.num_kv_heads, layout.head_dim)
    out = []
    for layer, dtype in enumerate(layout.layer_dtypes):
        k = (torch.randn(shape, generator=gen) * (layer + 1) * 4).to(dtype)
        v = torch.randn(shape, generator=gen).to(dtype)
        out.append((k, v))
    return out


def _round_trip(layout, layers, codec):
    metas = _metas(layers[0][0].shape[0])
    payloads = [b"".join(p) for p in encode_parts(layout, SPACE, metas, layers, codec)]
    return payloads, [decode_block(p, layout, SPACE, m.key) for p, m in zip(payloads, metas)]


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_a_compressed_block_comes_back_within_the_codec_s_bound_of_every_value(dtype, codec):
    layout = BlockLayout((dtype,) * 3, 16, 2, 64, "v1")
    layers = _group(layout, 4)
    layers[1][0][2, 5, 1] = 0.0  # a row of zeros: scale 1, values 0, back exactly
    layers[2][1][0, 0, 0, :8] = 1e4  # one row with a large outlier
    payloads, blocks = _round_trip(layout, layers, codec)
    for i, block in enumerate(blocks):
        for layer, (k, v) in enumerate(block):
            for got, want in ((k, layers[layer][0][i]), (v, layers[layer][1][i])):
                assert got.dtype == dtype and got.shape == want.shape
                rounding = want.float().abs() * {torch.float32: 0, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
                assert ((got.float() - want.float()).abs() <= error_bound(want, codec) + rounding).all()
    assert torch.equal(blocks[2][1][0][5, 1], torch.zeros(64, dtype=dtype))


def test_int8_stores_value_over_row_maximum_times_127_rounded_to_the_nearest_integer():
    k = torch.zeros(1, 8, 1, 4)
    k[0, 0, 0] = torch.tensor([12.7, -6.3, 0.26, 0.04])  # scale 0.1: 127, -63, 2.6 -> 3, 0.4 -> 0
    v = torch.full((1, 8, 1, 4), -3.0)
    scales, values = compress([(k, v)], "int8")
    rows = scales.view(torch.float32).view(2, 8)
    assert rows[0, 0].item() == pytest.approx(0.1) and rows[0, 1].item() == 1.0  # zeros keep scale 1
    assert rows[1].tolist() == pytest.approx([3.0 / 127] * 8)
    q = values.view(torch.int8).view(2, 8, 4)
    assert q[0, 0].tolist() == [127, -63, 3, 0] and (q[0, 1:] == 0).all()
    assert (q[1] == -127).all()
    body = torch.cat([scales[0], values[0]])
    back = decompress(body, "int8", torch.float32, 1, 8, 1, 4)
    assert back[0, 1].unique().tolist() == pytest.approx([-3.0])  # [layer, K|V, token, head, dim]
    assert back[0, 0, 0, 0].tolist() == pytest.approx([12.7, -6.3, 0.3, 0.0], rel=1e-6)


def test_sizes_versions_and_codec_byte_of_stored_payloads():
    layout = BlockLayout((torch.bfloat16,) * 2, 16, 2, 64, "cal-1")
    layers = _group(layout, 2)
    raw, _ = _round_trip(layout, layers, "none")
    small, _ = _round_trip(layout, layers, "int8")
    rows = 2 * 2 * 16 * 2  # layers, K and V, tokens, heads
    assert layout.body_bytes("none") == rows * 64 * 2 and layout.body_bytes("int8") == rows * 4 + rows * 64
    assert [len(p) for p in raw] == [layout.stored_bytes("none")] * 2 == [layout.payload_bytes] * 2
    assert [len(p) for p in small] == [layout.stored_bytes("int8")] * 2
    assert len(small[0]) - len(raw[0]) == rows * 4 + rows * 64 - rows * 128 + 1  # + the codec byte
    assert struct.unpack_from("<H", raw[0], 4) == (4,)  # stored as the device holds it: the old format, byte for byte
    assert raw == encode_blocks(layout, SPACE, _metas(2), layers)
    (version, header_len) = struct.unpack_from("<HH", small[0], 4)
    assert version == 5 and small[0][header_len - 1] == 1  # int8
    _, blocks = _round_trip(layout, layers, "fp8_e4m3")
    assert blocks[0].codec == "fp8_e4m3"


def test_a_payload_naming_an_unknown_codec_or_with_a_flipped_byte_is_refused():
    layout = BlockLayout((torch.float16,), 16, 1, 64, "")
    layers = _group(layout, 1)
    [payload], _ = _round_trip(layout, layers, "int8")
    key = _metas(1)[0].key
    header_len = struct.unpack_from("<H", payload, 6)[0]
    forged = bytearray(payload)
    forged[header_len - 1] = 9
    body = bytes(forged[:-8])
    forged[-8:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    with pytest.raises(PayloadError, match="layout: unknown compression code 9"):
        decode_block(bytes(forged), layout, SPACE, key)
    for header_len in (0, 5, len(payload) + 1):  # a torn or forged header length: refused, never read out of place
        bad = bytearray(payload)
        bad[6:8] = struct.pack("<H", header_len)
        with pytest.raises(PayloadError, match="length: "):
            decode_block(bytes(bad), layout, SPACE, key)
    flipped = bytearray(payload)
    flipped[len(payload) // 2] ^= 0x10
    with pytest.raises(PayloadError, match="checksum"):
        decode_block(bytes(flipped), layout, SPACE, key)


def test_a_compressed_payload_is_refused_by_a_layout_that_cannot_hold_it():
    """Written by a bfloat16 cache, read where the cache is int8: the layouts differ anyway."""
    bf16 = BlockLayout((torch.bfloat16,), 16, 1, 64, "")
    [payload], _ = _round_trip(bf16, _group(bf16, 1), "int8")
    with pytest.raises(PayloadError, match="layout: payload layout differs"):
        decode_block(payload, BlockLayout((torch.int8,), 16, 1, 64, ""), SPACE, _metas(1)[0].key)


def test_a_quantised_device_cache_and_a_group_with_a_non_finite_value_are_stored_as_they_are():
    quantised = BlockLayout((torch.int8, torch.float16), 16, 1, 64, "cal-1")
    assert quantised.codec_for("int8") == "none"
    layers = [(torch.randint(-127, 127, (2, 16, 1, 64), dtype=torch.int8),) * 2, _group(quantised, 2)[1]]
    payloads, blocks = _round_trip(quantised, layers, "int8")
    assert [len(p) for p in payloads] == [quantised.payload_bytes] * 2 and blocks[0].codec == "none"
    assert torch.equal(blocks[1][0][0], layers[0][0][1])
    floats = BlockLayout((torch.float16,), 16, 1, 64, "")
    layers = _group(floats, 2)
    layers[0][1][1, 3, 0, 7] = float("inf")
    payloads, blocks = _round_trip(floats, layers, "int8")
    assert [b.codec for b in blocks] == ["none", "none"]  # the whole group: the scale would not be finite
    assert torch.equal(blocks[0][0][0], layers[0][0][0])


def test_an_unknown_codec_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="tier_compress: unknown value 'zstd'; use none, int8, fp8_e4m3"):
        check_codec("zstd")


def _device_kv(engine, keys):
    """Each block's K and V in every layer, as the device cache holds them now."""
    ids = [engine.cache.pool.block_of(k) for k in keys]
    assert None not in ids
    return [[(c.k[i].clone(), c.v[i].clone()) for c in engine.kv_caches] for i in ids]


def test_the_engine_restores_a_prefix_from_a_compressed_disk_tier_as_the_codec_gives_it(demo, tmp_path):
    from kvctl.daemon.cache.keys import PrefixHasher

    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d", compress="int8")
    ids = demo.tokenizer.encode(TEXT_A)
    keys = PrefixHasher(engine.namespace("default")).feed(ids)[:(len(ids) - 1) // 16]
    generate(engine, TEXT_A, demo)
    before = _device_kv(engine, keys)
    push_out(engine, demo)
    assert tiered.flush(timeout=30)
    assert engine.cache.lookup(keys) == 0
    name, offset, length = tiered.disk.index[keys[0]]
    assert length == tiered.layout.stored_bytes("int8") < tiered.layout.payload_bytes * 0.6
    warm = generate(engine, TEXT_A, demo)
    assert warm.metrics.restored_tokens == len(keys) * 16
    after = _device_kv(engine, keys)
    for block_before, block_after in zip(before, after):
        layers = [(k[None], v[None]) for k, v in block_before]
        scales, values = compress(layers, "int8")
        expected = decompress(torch.cat([scales[0], values[0]]), "int8", block_before[0][0].dtype,
                              len(layers), 16, *block_before[0][0].shape[1:])
        assert all(torch.equal(k, expected[layer, 0]) and torch.equal(v, expected[layer, 1])
                   for layer, (k, v) in enumerate(block_after))
        assert any(not torch.equal(k, k0) for (k, _), (k0, _) in zip(block_after, block_before))  # lossy indeed


def test_a_daemon_that_does_not_compress_reads_a_compressing_daemon_s_blocks_from_redis(demo, redis_server):
    pytest.importorskip("redis")
    first, written = engine_with(demo, remote_url=redis_server.url, write_policy="write_through", compress="int8")
    generate(first, TEXT_A, demo)
    assert first.tiers.flush(timeout=30)
    blocks = (len(demo.tokenizer.encode(TEXT_A)) - 1) // 16
    stored = written.stats["remote"].bytes_in
    assert stored == written.layout.stored_bytes("int8") * len(written.remote.index) and blocks <= len(written.remote.index)
    second, tiered = engine_with(demo, remote_url=redis_server.url)
    warm = generate(second, TEXT_A, demo)
    assert warm.metrics.restored_tokens == blocks * 16
    assert tiered.stats["remote"].restored_blocks == blocks and tiered.stats["remote"].checksum_failures == 0
    assert tiered.stats["remote"].bytes_out == blocks * written.layout.stored_bytes("int8")


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_disk_budget_holds_as_many_more_blocks_as_compression_saves(tmp_path, codec):
    from kvctl.daemon.cache.tiers import DiskTier, TieredCache

    layout = BlockLayout((torch.bfloat16,) * 2, 16, 2, 64, "")
    budget = 40 * layout.payload_bytes
    disk = DiskTier(tmp_path / "d", budget, layout, SPACE)
    tiered = TieredCache([], layout, SPACE, disk=disk, compress=codec)
    for group in range(12):  # 96 blocks offered, in groups of 8
        metas = [BlockMeta(bytes([group, i + 1]) * 16, b"r" * 32, 0, None) for i in range(8)]
        assert tiered.copy_to("disk", metas, _group(layout, 8, seed=group), src="device") == 8
    fits = budget // layout.stored_bytes(codec) // 8 * 8  # whole groups of the newest
    assert len(disk.index) == fits == {"none": 40, "int8": 72}[codec]
    assert disk.used_bytes == fits * layout.stored_bytes(codec) <= budget
    tiered.close()


def test_after_a_restart_the_disk_re_indexes_compressed_and_whole_blocks_alike(tmp_path):
    from kvctl.daemon.cache.tiers import DiskTier, TieredCache

    layout = BlockLayout((torch.float16,) * 2, 16, 1, 64, "")
    disk = DiskTier(tmp_path / "d", 1 << 22, layout, SPACE)
    tiered = TieredCache([], layout, SPACE, disk=disk, compress="int8")
    squeezed, whole = _metas(4)[:2], _metas(4)[2:]
    layers = _group(layout, 2)
    tiered.copy_to("disk", squeezed, layers, src="device")
    tiered.compress = "none"
    tiered.copy_to("disk", whole, layers, src="device")
    tiered.close()
    again = DiskTier(tmp_path / "d", 1 << 22, layout, SPACE)
    report = again.scan()
    assert (report.blocks, report.segments, report.corrupt, report.foreign) == (4, 2, 0, 0)
    got = [decode_block(again.read(m.key), layout, SPACE, m.key) for m in squeezed + whole]
    assert [b.codec for b in got] == ["int8", "int8", "none", "none"]
    assert torch.equal(got[2][1][0], layers[1][0][0])  # stored whole: exact
    assert ((got[0][1][0].float() - layers[1][0][0].float()).abs()
            <= error_bound(layers[1][0][0], "int8") + layers[1][0][0].float().abs() * 2**-10).all()
    again.close()


def test_disk_and_redis_compress_apart_and_each_payload_says_how_it_is_stored(demo, tmp_path, redis_server):
    from kvctl.daemon.cache.keys import PrefixHasher
    from kvctl.tiers_cmd import compress_line

    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d", remote_url=redis_server.url,
                                 write_policy="write_through", compress={"disk": "none", "remote": "int8"})
    cold = generate(engine, TEXT_A, demo)
    assert tiered.flush(timeout=30)
    ids = demo.tokenizer.encode(TEXT_A)
    keys = PrefixHasher(engine.namespace("default")).feed(ids)[:(len(ids) - 1) // 16]
    layout = tiered.layout
    assert {tiered.disk.index[k][2] for k in keys} == {layout.stored_bytes("none")}
    assert {tiered.remote.written[k] for k in keys} == {layout.stored_bytes("int8")}
    assert (tiered.block_bytes_in("disk"), tiered.block_bytes_in("remote")) == (
        layout.stored_bytes("none"), layout.stored_bytes("int8"))
    line = compress_line(tiered.report()["compress"])
    assert line.startswith("disk stores blocks as the device does (") and \
        "; Redis stores blocks compressed (int8, lossy): " in line
    with pytest.raises(ValueError, match="tier_compress: 'host' is not a tier that stores payloads; use disk or remote"):
        tiered.compress = {"host": "int8"}
    push_out(engine, demo)
    assert tiered.flush(timeout=30)
    warm = generate(engine, TEXT_A, demo)  # from disk, where it is whole: the same tokens
    assert warm.metrics.restored_tokens == len(keys) * 16
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids


def test_a_disk_segment_salvaged_to_redis_is_stored_as_redis_stores_blocks(demo, tmp_path, redis_server):
    """write_back: a segment the disk evicts for room goes to Redis; the disk holds it whole, Redis
    compresses, so it is verified and encoded again on the way."""
    engine, tiered = engine_with(demo, disk_bytes=6 * 16_622, disk_path=tmp_path / "d", remote_url=redis_server.url,
                                 compress={"disk": "none", "remote": "int8"})
    assert tiered.layout.payload_bytes == 16_622
    generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    assert tiered.flush(timeout=30)
    salvaged = dict(tiered.remote.written)
    assert salvaged and set(salvaged.values()) == {tiered.layout.stored_bytes("int8")}
    assert not set(salvaged) & set(tiered.disk.index)  # what the disk dropped, Redis took
    assert all(length == tiered.layout.payload_bytes for _, _, length in tiered.disk.index.values())
    warm = generate(engine, TEXT_A, demo)  # from wherever it is now: disk, or Redis compressed
    assert warm.metrics.cached_tokens > 0 and tiered.stats["remote"].checksum_failures == 0


def test_blocks_written_before_compression_was_turned_on_still_restore_exactly(demo, tmp_path):
    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d")
    cold = generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    assert tiered.flush(timeout=30)
    tiered.compress = "fp8_e4m3"  # as a reload does: from now on
    assert tiered.block_bytes_in("disk") == tiered.layout.stored_bytes("fp8_e4m3")
    warm = generate(engine, TEXT_A, demo)
    assert warm.metrics.restored_tokens > 0
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids  # those blocks were stored whole


def test_kvd_compresses_from_its_config_reloads_the_setting_and_kvctl_tiers_says_so(tmp_path):
    from dataclasses import replace

    from rich.console import Console

    from kvctl.daemon.config import ConfigError, resolve
    from kvctl.daemon.server.app import create_app
    from kvctl.daemon.server.cache_questions import route_facts
    from kvctl.tiers_cmd import render_tiers

    path = tmp_path / "kvd.yaml"
    path.write_text("tiers:\n  disk: {bytes: 4MiB, compress: none}\n  compress: int8\n")
    cfg = resolve({}, env={}, config_file=path)
    assert (cfg.tier_compress, cfg.disk_compress, cfg.tier_codecs()) == ("int8", "none", {"disk": "none", "remote": "int8"})
    assert resolve({"remote_compress": "fp8_e4m3"}, env={}).tier_codecs() == {"disk": "none", "remote": "fp8_e4m3"}
    assert resolve({}, env={"KVD_TIER_COMPRESS": "fp8_e4m3"}).tier_compress == "fp8_e4m3"
    with pytest.raises(ConfigError, match="tier_compress: invalid value 'zstd'.*must be none, int8 or fp8_e4m3"):
        resolve({"tier_compress": "zstd"}, env={})
    with pytest.raises(ConfigError, match="disk_compress: invalid value 'lz4'.*must be none, int8 or fp8_e4m3"):
        resolve({}, env={"KVD_DISK_COMPRESS": "lz4"})
    service = start_service(tmp_path / "state", disk_cache_bytes="4MiB", tier_compress="int8")
    try:
        app = create_app(service, service.metrics, front="unix")
        report = call(app, "GET", "/admin/tiers").json()
        layout = service.tiers.layout
        assert report["compress"] == {"disk": {"setting": "int8", "codec": "int8", "inactive_reason": None,
                                               "block_bytes": layout.payload_bytes,
                                               "stored_block_bytes": layout.stored_bytes("int8")}}
        assert report["tiers"]["disk"]["blocks"] == 0
        assert report["tiers"]["disk"]["block_bytes"] == layout.stored_bytes("int8")
        metrics = call(app, "GET", "/metrics").text
        assert f'kvd_tier_block_bytes{{tier="disk"}} {float(layout.stored_bytes("int8"))}' in metrics
        console = Console(record=True, width=200)
        render_tiers(report, console)
        ratio = layout.stored_bytes("int8") / layout.payload_bytes
        text = console.export_text()
        assert "disk stores blocks compressed (int8, lossy)" in text
        assert f"({ratio:.2f}); blocks stored before stay as they were" in text
        facts = route_facts(service, [1] * 40, "default")  # what a router prices a restore from disk with
        assert facts["restore_rates"]["disk"]["block_bytes"] == layout.stored_bytes("int8")
        result = service.reload(replace(service.config, tier_compress="none"))
        assert result["changed"] == {"tier_compress": "none"}
        assert service.tiers.compress == {"disk": "none", "remote": "none"}
        report = call(app, "GET", "/admin/tiers").json()
        assert report["compress"]["disk"]["codec"] == "none"
        console = Console(record=True, width=200)
        render_tiers(report, console)
        assert f"disk stores blocks as the device does ({_size(layout.payload_bytes)} a block)" in \
            console.export_text()
    finally:
        service.shutdown(deadline=2)


def _size(n):
    from kvctl.tables import size

    return size(n)


def test_a_quantised_device_cache_says_why_compression_is_not_applied(demo, tmp_path):
    from kvctl.daemon.cache.tiers import build_tiers
    from kvctl.daemon.engine.engine import Engine, EngineSettings
    from kvctl.tiers_cmd import compress_line

    engine = Engine(demo, EngineSettings(num_blocks=12, block_size=16, cache_dtype="int8"))
    tiered, _ = build_tiers(engine, disk_bytes=1 << 22, disk_path=tmp_path / "d", compress="fp8_e4m3")
    report = tiered.report()["compress"]
    assert report["disk"]["codec"] == "none" and report["disk"]["setting"] == "fp8_e4m3"
    assert compress_line(report).endswith(
        "compress fp8_e4m3 is not applied: the device cache is int8: only float32, float16 and bfloat16 "
        "caches are compressed")


def test_a_compressed_block_is_decompressed_when_fetched_not_when_the_engine_restores_it(demo, tmp_path):
    from kvctl.daemon.cache.keys import PrefixHasher

    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d", compress="int8")
    ids = demo.tokenizer.encode(TEXT_A)
    keys = PrefixHasher(engine.namespace("default")).feed(ids)[:(len(ids) - 1) // 16]
    generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    assert tiered.flush(timeout=30)
    job = tiered.fetch_now(keys)
    staged = [tiered.staged[k][0] for k in keys]
    assert [b.codec for b in staged] == ["int8"] * len(keys)
    assert all(b.decoded for b in staged)  # the reader thread decompressed them
    tiered.finish_prefetch(job)


def test_an_operator_swaps_a_prefix_to_a_compressed_disk_and_back(tmp_path):
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB", tier_compress="int8", tiering="always")
    try:
        app = create_app(service, service.metrics, front="unix")
        response = call(app, "POST", "/v1/completions", json={"prompt": TEXT_A, "max_tokens": 1, "temperature": 0})
        assert response.status_code == 200
        [prefix] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        moved = call(app, "POST", "/admin/swap", json={"prefix": prefix["prefix_id"], "to": "disk"}).json()
        assert moved["verified_blocks"] == moved["blocks"] == prefix["blocks"]  # read back and checked, compressed
        keys = service.engine.prefix_keys("default", service.engine.tokenizer.encode(TEXT_A))[2][:prefix["blocks"]]
        assert {service.tiers.disk.index[k][2] for k in keys} == {service.tiers.layout.stored_bytes("int8")}
        back = call(app, "POST", "/admin/swap", json={"prefix": prefix["prefix_id"], "to": "device"}).json()
        assert back["verified_blocks"] == back["blocks"] == prefix["blocks"]
        again = call(app, "POST", "/v1/completions", json={"prompt": TEXT_A, "max_tokens": 1, "temperature": 0})
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == prefix["blocks"] * 16
    finally:
        service.shutdown(deadline=2)


def test_a_prefix_fetched_compressed_is_restored_though_its_whole_bytes_at_the_tier_s_rate_would_lose(demo, tmp_path):
    """The fetch is judged at the bytes the tier stores (0.28 of a float32 block here) and worth
    it; once staged, the blocks are in memory as the device holds them. Installing them used to be
    judged again at the tier's read rate and the whole blocks' bytes: 1.7 times the recompute time
    here, so the request recomputed a prefix it had just fetched, and every fetch was wasted."""
    from kvctl.daemon.cache.tiers import build_tiers
    from kvctl.daemon.engine.engine import Engine, EngineSettings
    from kvctl.policies.tiering import RateMeter

    from .tier_engine import GREEDY, TEXT_B, TEXT_C

    engine = Engine(demo, EngineSettings(num_blocks=12, block_size=16))
    tiered, _ = build_tiers(engine, disk_bytes=16 << 20, disk_path=tmp_path / "disk", tiering="measured",
                            write_policy="write_through", compress="int8")
    block, stored = tiered.layout.block_bytes, tiered.block_bytes_in("disk")
    assert stored < 0.3 * block
    prefill = 1000.0  # tokens per second: a block of 16 recomputes in 16 ms
    rates = {"prefill": RateMeter(rate=prefill), "disk": RateMeter(rate=block * prefill / 16 * 0.6),
             "host": RateMeter(rate=block * prefill / 16 * 100)}  # staging to the device: a copy
    for meter in rates.values():
        meter.observe = lambda *a, **k: None  # the rates stay as set, whatever this run measures
    tiered.policy.prefill, tiered.stats["disk"].read, tiered.stats["host"].read = (
        rates["prefill"], rates["disk"], rates["host"])
    cold = engine.add_request(demo.tokenizer.encode(TEXT_A), GREEDY)
    engine.run_until_done()
    for text in (TEXT_B, TEXT_C):  # A's blocks leave the device; written through, they are on disk
        engine.add_request(demo.tokenizer.encode(text), GREEDY)
        engine.run_until_done()
    tiered.flush()
    prompt = demo.tokenizer.encode(TEXT_A)
    blocks = (len(prompt) - 1) // 16
    assert engine.cache.pool.match(engine.prefix_keys("default", prompt)[2], blocks) == []
    warm = engine.add_request(prompt, GREEDY)
    engine.run_until_done()
    engine.cache.audit()
    assert warm.metrics.prefetch_outcome == "complete"
    assert warm.metrics.restored_tokens == blocks * 16 and warm.metrics.cached_tokens == blocks * 16
    assert tiered.stats["disk"].restored_blocks == blocks
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids


@pytest.mark.parametrize("reader", ["read", "read_many"])
def test_a_segment_whose_blocks_are_all_dropped_while_it_is_read_goes_when_the_read_ends(tmp_path, reader):
    """An operator's eviction drops blocks while a prefetch reads their segment: the segment must
    stay for that read, and it went nowhere after it (`kvctl tiers` showed disk bytes used with no
    block held, until the budget needed room). The last read out now removes it."""
    from kvctl.daemon.cache.tiers import DiskTier, TieredCache

    layout = BlockLayout((torch.float16,) * 2, 16, 1, 64, "")
    disk = DiskTier(tmp_path / "d", 1 << 22, layout, SPACE)
    tiered = TieredCache([], layout, SPACE, disk=disk)
    metas = _metas(2)
    assert tiered.copy_to("disk", metas, _group(layout, 2), src="device") == 2
    [name] = disk.segments
    keys = [m.key for m in metas]
    read_range = disk._read_range

    def dropped_meanwhile(*args):
        for key in keys:
            disk.drop(key)
        assert name in disk.segments and (disk.segment_dir / name).exists()  # kept for this read
        return read_range(*args)

    disk._read_range = dropped_meanwhile
    got = disk.read(keys[0]) if reader == "read" else disk.read_many(keys)
    assert got is not None and len(got) > 0  # the read in flight got its bytes
    assert (list(disk.segments), disk.used_bytes, disk.index) == ([], 0, {})
    assert not (disk.segment_dir / name).exists()
    tiered.close()
