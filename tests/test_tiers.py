"""Tiers in the engine and the daemon: demotion, restore with identical tokens, warm restarts,
sharing through Redis between two daemons, Redis outages, disk full, cancellation during a
transfer, and the operator surface (kvctl tiers, swap, prefixes, evict, metrics)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("redis")

from kvctl.daemon.cache.events import EventLog  # noqa: E402
from kvctl.daemon.cache.keys import PrefixHasher  # noqa: E402
from kvctl.daemon.cache.tiers import build_tiers  # noqa: E402
from kvctl.daemon.engine.engine import Engine, EngineSettings  # noqa: E402

from .daemon_fixtures import a_long_step, call, start_service  # noqa: E402
from .tier_engine import GREEDY, TEXT_A, TEXT_B, TEXT_C, demo, engine_with, generate, push_out  # noqa: E402,F401
from .tier_fixtures import redis_cluster, redis_server  # noqa: E402,F401


@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"])
def test_an_evicted_prefix_comes_back_from_a_lower_tier_with_identical_tokens(demo, tmp_path, tiers):
    settings = {"host": dict(host_bytes=1 << 20), "disk": dict(disk_bytes=1 << 22, disk_path=tmp_path / "d"),
                "host+disk": dict(host_bytes=40_000, disk_bytes=1 << 22, disk_path=tmp_path / "d")}[tiers]
    engine, tiered = engine_with(demo, **settings)
    cold = generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()
    from kvctl.daemon.cache.keys import PrefixHasher

    keys = PrefixHasher(engine.namespace("default")).feed(demo.tokenizer.encode(TEXT_A))
    assert engine.cache.lookup(keys) == 0  # nothing of A is left on the device
    warm = generate(engine, TEXT_A, demo)
    blocks = (len(demo.tokenizer.encode(TEXT_A)) - 1) // 16
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids
    assert warm.metrics.restored_tokens == warm.metrics.cached_tokens == blocks * 16
    assert engine.stats.restored_tokens == blocks * 16
    # NOTE: the warm run evicts B's or C's blocks to make room, and the writer thread publishes them
    # on its own time: they are `moving` until it has
    assert tiered.flush(timeout=30)
    report = tiered.report()
    restored = sum(t["restored_blocks"] for t in report["tiers"].values())
    assert restored == blocks
    assert report["moving_blocks"] == 0 and report["staged_blocks"] == 0


def test_new_scales_drop_the_old_trees_from_the_device_and_host_memory_but_not_disk(demo, tmp_path):
    """Blocks written under scales since replaced can never be hit (the scale version is in their
    keys): kvd drops them from the device and host memory as the new scales load, with `space` as
    the reason; disk keeps its segments (replicas still on the old scales may share them)."""
    engine, tiered = engine_with(demo, host_bytes=1 << 20, disk_bytes=1 << 22, disk_path=tmp_path / "d",
                                 write_policy="write_through")
    generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    assert tiered.flush(timeout=30)
    a_keys = engine.prefix_keys("default", demo.tokenizer.encode(TEXT_A))[2]
    on_device = engine.cache.pool.num_indexed
    in_host = [key for key in tiered.host.index]
    on_disk = len(tiered.disk.index)
    assert set(a_keys) <= set(in_host) and engine.cache.lookup(a_keys) == 0  # A went down to host memory
    assert engine.set_scales({}, "cal-9") == (on_device, len(in_host))
    assert engine.cache.pool.num_indexed == 0 and len(tiered.host.index) == 0
    assert len(tiered.disk.index) == on_disk > 0  # disk's are another matter (kvctl evict --model-revision)
    assert engine.cache.pool.space_evictions == on_device
    removed = engine.events.last(100, ("removed",)).events
    assert {(e.tier, e.reason) for e in removed} >= {("device", "space"), ("host", "space")}
    again = generate(engine, TEXT_A, demo)
    assert again.metrics.cached_tokens == 0 and again.metrics.restored_tokens == 0
    assert engine.set_scales({}, "cal-9") == (0, 0)  # nothing left to drop: the served space is unchanged


def test_without_tiers_the_same_sequence_recomputes(demo):
    engine = Engine(demo, EngineSettings(num_blocks=12, block_size=16))
    generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    warm = generate(engine, TEXT_A, demo)
    assert warm.metrics.cached_tokens == 0 and warm.metrics.restored_tokens == 0


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8_e4m3"])
def test_quantised_blocks_round_trip_through_disk(demo, tmp_path, cache_dtype):
    engine = Engine(demo, EngineSettings(num_blocks=12, block_size=16, cache_dtype=cache_dtype))
    tiered, _ = build_tiers(engine, tiering="always", disk_bytes=1 << 22, disk_path=tmp_path / "d")
    cold = generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()
    warm = generate(engine, TEXT_A, demo)
    assert warm.metrics.restored_tokens > 0
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids


def test_a_corrupted_disk_block_is_a_counted_miss_and_the_request_recomputes_from_it(demo, tmp_path):
    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d")
    cold = generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()
    from kvctl.daemon.cache.keys import PrefixHasher

    keys = PrefixHasher(engine.namespace("default")).feed(demo.tokenizer.encode(TEXT_A))
    name, offset, length = tiered.disk.index[keys[2]]
    path = tiered.disk.segment_dir / name
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x01
    path.write_bytes(bytes(data))
    warm = generate(engine, TEXT_A, demo)
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids
    assert warm.metrics.restored_tokens == 2 * 16  # blocks 0 and 1; recomputed from block 2
    assert tiered.stats["disk"].checksum_failures == 1
    assert keys[2] not in tiered.disk.index
    assert [(e.keys, e.reason) for e in engine.events.since(0, tiers=("disk",), kinds=("removed",)).events] == [
        ((keys[2],), "corrupt")]


def test_disk_full_marks_the_tier_degraded_and_serving_goes_on(demo, tmp_path, monkeypatch):
    import errno
    import os

    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d")
    real = os.writev

    def full(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    cold = generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()
    monkeypatch.setattr(os, "writev", real)
    report = tiered.report()["tiers"]["disk"]
    assert report["health"] == "degraded" and "No space left" in report["degraded_reason"]
    assert report["blocks"] == 0 and report["errors"] >= 1
    assert list(tiered.disk.segment_dir.iterdir()) == []
    warm = generate(engine, TEXT_A, demo)
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids and warm.metrics.restored_tokens == 0


def test_cancelling_during_a_prefetch_releases_the_source_and_what_was_staged(demo, tmp_path):
    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d")
    generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()
    entered, release = threading.Event(), threading.Event()
    tiered.FETCH_GROUP = 1  # one block per read, so the second read can hang alone
    real_read = tiered.disk._read_range
    calls = []

    def slow_read(*where):
        calls.append(where)
        if len(calls) == 2:  # the first block is staged; the second read hangs holding its segment
            entered.set()
            release.wait(10)
        return real_read(*where)

    tiered.disk._read_range = slow_read
    request = engine.add_request(demo.tokenizer.encode(TEXT_A), GREEDY)
    assert entered.wait(10)
    assert len(tiered.staged) == 1 and tiered.disk.busy  # a segment is held by the read in flight
    engine.cancel(request.request_id)
    release.set()
    tiered._reader.submit(lambda: None).result(5)  # the fetch has ended
    assert tiered.staged == {} and tiered.disk.busy == {}
    assert engine.cache.state_counts()["reserved"] == 0 and not engine.has_work()
    engine.cache.audit()


def test_write_through_puts_every_full_block_on_disk_before_any_eviction(demo, tmp_path):
    engine, tiered = engine_with(demo, num_blocks=64, disk_bytes=1 << 22, disk_path=tmp_path / "d",
                                 write_policy="write_through")
    generate(engine, TEXT_A, demo)
    tiered.flush()
    full_blocks = (len(demo.tokenizer.encode(TEXT_A)) + 8 - 1) // 16
    assert len(tiered.disk.index) == full_blocks
    assert engine.cache.pool.evictions == 0


def hold_disk_writes(disk):
    """Hold every segment write of `disk` (the writer thread waits) until the returned event is set,
    so that blocks written through stay `moving`; each write goes on once it is set."""
    import threading

    gate, write_group = threading.Event(), disk.write_group
    disk.write_group = lambda *args, **kwargs: gate.wait(10) and write_group(*args, **kwargs)
    return gate


def test_an_eviction_waits_for_blocks_on_their_way_to_disk_and_drops_them_too(demo, tmp_path):
    """Written through, a prompt's blocks are `moving` until the writer thread publishes them. An
    eviction skipped those, and the write then put them on disk after the eviction had said what it
    removed. It now waits for those writes and drops what they published; what is still moving
    when it gives up is counted, never silently kept."""
    import threading

    engine, tiered = engine_with(demo, num_blocks=64, disk_bytes=1 << 22, disk_path=tmp_path / "d",
                                 write_policy="write_through")
    gate = hold_disk_writes(tiered.disk)
    generate(engine, TEXT_A, demo)
    moving = [k for k, (_, tier) in tiered.known_metas().items() if tier == "moving"]
    full_blocks = (len(demo.tokenizer.encode(TEXT_A)) + 8 - 1) // 16
    assert len(moving) == full_blocks and not tiered.disk.index
    assert tiered.wait_for_writes(moving, timeout=0.05) == full_blocks  # the writer is held: all still moving
    threading.Timer(0.2, gate.set).start()
    assert tiered.wait_for_writes(moving, timeout=10) == 0
    assert tiered.drop(moving) == full_blocks
    assert tiered.flush(timeout=10) and not tiered.disk.index  # nothing lands after the eviction


def test_write_through_selective_writes_a_block_down_when_it_is_first_reused(demo, tmp_path):
    """SGLang HiCache's write_through_selective: what a prompt fills stays on the device until a
    prefix hit proves it reusable; then (the same step) it goes to disk, once."""
    engine, tiered = engine_with(demo, num_blocks=64, disk_bytes=1 << 22, disk_path=tmp_path / "d",
                                 write_policy="write_through_selective")
    generate(engine, TEXT_A, demo)
    generate(engine, TEXT_B, demo)
    tiered.flush()
    assert len(tiered.disk.index) == 0  # filled, never reused: nothing written
    again = generate(engine, TEXT_A, demo)
    tiered.flush()
    hit_blocks = again.metrics.cached_tokens // 16
    assert hit_blocks > 0 and len(tiered.disk.index) == hit_blocks
    from kvctl.daemon.cache.keys import PrefixHasher

    keys = PrefixHasher(engine.namespace("default")).feed(demo.tokenizer.encode(TEXT_A))
    assert set(tiered.disk.index) == set(keys[:hit_blocks])  # TEXT_A's reused blocks, not TEXT_B's
    generate(engine, TEXT_A, demo)  # reused again: already below, not written twice
    tiered.flush()
    assert len(tiered.disk.index) == hit_blocks and tiered.stats["disk"].write.samples == 1
    assert engine.cache.pool.evictions == 0


def test_a_group_the_disk_already_holds_does_not_move_its_measured_write_rate(demo, tmp_path):
    """Rewriting blocks the disk holds writes nothing: no sample (it once divided the group's bytes
    by a few microseconds, less an earlier write's fsync, and reported terabytes a second)."""
    from kvctl.daemon.cache.tiers import encode_parts

    from .tier_fixtures import block_key, group

    _, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d")
    metas, layers = group(tiered.layout, [block_key(i) for i in range(4)])
    items = list(zip(metas, encode_parts(tiered.layout, tiered.space, metas, layers)))
    tiered._publish_to("disk", items, "host")
    meter = tiered.stats["disk"].write
    first = (meter.samples, meter.rate)
    assert first[0] == 1 and tiered.stats["disk"].bytes_in == sum(len(bytes(b)) for _, p in items for b in p)
    tiered._publish_to("disk", items, "host")
    assert (meter.samples, meter.rate) == first


# ---- Redis -----------------------------------------------------------------------------------
def test_two_engines_share_a_prefix_through_redis(demo, redis_server):
    first, _ = engine_with(demo, remote_url=redis_server.url, write_policy="write_through")
    cold = generate(first, TEXT_A, demo)
    first.tiers.flush()
    second, tiered = engine_with(demo, remote_url=redis_server.url)
    warm = generate(second, TEXT_A, demo)
    blocks = (len(demo.tokenizer.encode(TEXT_A)) - 1) // 16
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids
    assert warm.metrics.restored_tokens == blocks * 16
    assert tiered.stats["remote"].restored_blocks == blocks


def test_redis_down_opens_the_breaker_serving_goes_on_and_it_reconnects(demo, redis_server):
    engine, tiered = engine_with(demo, remote_url=redis_server.url)
    tiered.remote.breaker.cooldown = 0.2
    redis_server.stop()
    generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()
    assert tiered.report()["tiers"]["remote"]["health"] in ("down", "probing")
    assert tiered.stats["remote"].errors >= 1
    redis_server.start()
    time.sleep(0.3)
    generate(engine, TEXT_B, demo)  # evicts A's blocks again: written now that Redis is back
    push_out(engine, demo)
    tiered.flush()
    assert tiered.report()["tiers"]["remote"]["health"] == "ok"
    assert len(tiered.remote.index) > 0
    warm = generate(engine, TEXT_C, demo)
    assert warm.sequences[0].output_ids == generate(engine, TEXT_C, demo).sequences[0].output_ids


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_redis_round_trip_is_bit_exact_for_every_cache_dtype(redis_server, dtype):
    from kvctl.bench_tiers import _group, _layout
    from kvctl.daemon.cache.tiers import RemoteTier, decode_block, encode_parts

    layout = _layout(3, 2, 64, 16, dtype)
    metas, layers = _group(layout, 5, 1)
    tier = RemoteTier(redis_server.url, 1 << 30, b"S" * 32)
    tier.write_group(list(zip(metas, encode_parts(layout, b"S" * 32, metas, layers))))
    payloads = tier.read_many([m.key for m in metas] + [b"x" * 32])
    assert sorted(payloads) == sorted(m.key for m in metas)
    for i, meta in enumerate(metas):
        block = decode_block(payloads[meta.key], layout, b"S" * 32, meta.key)
        for (k, v), (gk, gv) in zip(block, layers):
            assert torch.equal(k.view(torch.uint8), gk[i].view(torch.uint8))
            assert torch.equal(v.view(torch.uint8), gv[i].view(torch.uint8))


def _purge_case(url):
    """Two daemons' tiers on one server: the first writes 3 blocks of acme and 2 of globex (and a
    stray value sits under the space's prefix); the second purges acme."""
    from kvctl.bench_tiers import _group, _layout
    from kvctl.daemon.cache.tiers import BlockMeta, RemoteTier, encode_parts

    layout = _layout(2, 2, 64, 16, "float16")
    metas, layers = _group(layout, 5, 1)
    owned = [BlockMeta(m.key, m.root, m.depth, m.parent, "acme" if i < 3 else "globex") for i, m in enumerate(metas)]
    writer, other = (RemoteTier(url, 1 << 30, b"S" * 32) for _ in range(2))
    writer.write_group(list(zip(owned, encode_parts(layout, b"S" * 32, owned, layers))))
    writer.client.set(writer.prefix + b"not-a-payload", b"hello")
    report = other.purge(lambda meta: meta.tenant == "acme", batch=2)
    left = writer.read_many([m.key for m in owned])
    return report, sorted(left) == sorted(m.key for m in owned[3:]), writer.client.get(writer.prefix + b"not-a-payload")


def test_purging_a_tenant_from_redis_takes_every_daemon_s_entries_of_it_and_nothing_else(redis_server):
    report, only_globex_left, stray = _purge_case(redis_server.url)
    assert report == {"dropped": 3, "seen": 6, "complete": True} and only_globex_left and stray == b"hello"


@pytest.mark.parametrize("with_shares", [False, True])
def test_a_tenant_over_its_share_of_the_redis_budget_loses_its_own_oldest_entries_first(redis_server, with_shares):
    """This daemon's Redis bytes hold 8 payloads. quiet writes 3, then noisy writes 8 in two groups:
    under LRU quiet's go; with noisy=0.5, noisy (over its 4) loses its own oldest instead."""
    from kvctl.bench_tiers import _group, _layout
    from kvctl.daemon.cache.events import EventLog
    from kvctl.daemon.cache.tiers import BlockMeta, RemoteTier, encode_parts

    layout = _layout(2, 2, 64, 16, "float16")
    space = b"Q" * 32
    metas, layers = _group(layout, 11, 3)
    owned = [BlockMeta(m.key, m.root, m.depth, m.parent, "quiet" if i < 3 else "noisy") for i, m in enumerate(metas)]
    payloads = encode_parts(layout, space, owned, layers)
    remote = RemoteTier(redis_server.url, 8 * layout.payload_bytes, space)
    remote.events = EventLog()
    remote.set_tenant_shares((("noisy", 0.5),) if with_shares else ())
    for group in (range(0, 3), range(3, 7), range(7, 11)):
        remote.write_group([(owned[i], payloads[i]) for i in group])
    quiet, noisy = [m.key for m in owned[:3]], [m.key for m in owned[3:]]
    on_server = set(remote.read_many(quiet + noisy))
    if with_shares:  # noisy, over its share of 4, gave up its own 3 oldest; room is lent, so it keeps 5
        assert list(remote.written) == quiet + noisy[3:] and on_server == set(quiet + noisy[3:])
        assert remote.share_evictions == 3 and dict(remote.tenant_bytes) == {
            "quiet": 3 * layout.payload_bytes, "noisy": 5 * layout.payload_bytes}
        reasons = {e.reason for e in remote.events.since(0, kinds=("removed",)).events}
        assert reasons == {"tenant_share"}
    else:
        assert list(remote.written) == noisy and on_server == set(noisy) and remote.share_evictions == 0
    assert remote.used_bytes == 8 * layout.payload_bytes


def test_dropping_blocks_from_redis_deletes_them_and_takes_them_off_the_books(redis_server):
    from kvctl.bench_tiers import _group, _layout
    from kvctl.daemon.cache.tiers import RemoteTier, encode_parts

    layout = _layout(2, 2, 64, 16, "float16")
    metas, layers = _group(layout, 4, 1)
    tier = RemoteTier(redis_server.url, 1 << 30, b"S" * 32)
    tier.events = EventLog()
    tier.write_group(list(zip(metas, encode_parts(layout, b"S" * 32, metas, layers))))
    one = tier.used_bytes // 4
    tier.client.delete(tier.redis_key(metas[2].key))  # another daemon's purge took this one first
    assert tier.drop_many([m.key for m in metas[1:3]]) == {metas[1].key}  # what this call deleted
    assert list(tier.index) == [metas[0].key, metas[3].key] and tier.used_bytes == 2 * one
    assert sorted(tier.read_many([m.key for m in metas])) == sorted([metas[0].key, metas[3].key])
    assert set(tier.meta) == {metas[0].key, metas[3].key}
    # an entry deleted on the server (its memory policy, another daemon's purge) leaves the books
    # the first time a read misses it
    tier.client.delete(tier.redis_key(metas[0].key))
    assert list(tier.read_many([metas[0].key, metas[3].key])) == [metas[3].key]
    assert list(tier.index) == [metas[3].key] and tier.used_bytes == one
    # each change of the books is an event, with why
    events = tier.events.since(0).events
    assert {k for e in events if e.kind == "stored" for k in e.keys} == {m.key for m in metas}
    assert [(e.kind, e.tier, e.keys, e.reason) for e in events if e.kind == "removed"] == [
        ("removed", "remote", (metas[1].key, metas[2].key), "operator"),
        ("removed", "remote", (metas[0].key,), "gone")]


def test_after_a_change_of_space_blocks_are_shared_under_the_new_one_and_the_old_go_first(redis_server):
    """New scales (a calibration applied) change a daemon's block space live. What it writes then is
    found by a daemon that started under the new space; what it wrote before leaves its books of
    held blocks (a `space` removal) but counts against its bytes until it goes, first, for room."""
    from kvctl.bench_tiers import _group, _layout
    from kvctl.daemon.cache.tiers import RemoteTier, encode_parts

    layout = _layout(2, 2, 64, 16, "float16")
    metas, layers = _group(layout, 4, 1)
    old, new = b"S" * 32, b"T" * 32
    payloads = encode_parts(layout, old, metas[:2], [(k[:2], v[:2]) for k, v in layers])
    one = sum(memoryview(b).nbytes for b in payloads[0])
    tier = RemoteTier(redis_server.url, 3 * one, old)
    tier.events = EventLog()
    tier.write_group(list(zip(metas[:2], payloads)))
    tier.space = new
    assert not tier.index and not tier.meta and tier.used_bytes == 2 * one and len(tier.retired) == 2
    assert [(e.kind, e.keys, e.reason) for e in tier.events.since(0).events if e.kind == "removed"] == [
        ("removed", (metas[0].key, metas[1].key), "space")]
    fresh = encode_parts(layout, new, metas[2:], [(k[2:], v[2:]) for k, v in layers])
    tier.write_group(list(zip(metas[2:], fresh)))
    # room for three: the oldest entry of the old space went, not one of the new
    assert list(tier.index) == [metas[2].key, metas[3].key] and tier.used_bytes == 3 * one
    assert [k for k, _ in tier.retired.values()] == [metas[1].key]
    started_under_new = RemoteTier(redis_server.url, 1 << 30, new)
    assert sorted(started_under_new.read_many([m.key for m in metas])) == sorted([metas[2].key, metas[3].key])
    old_prefix = RemoteTier.space_prefix(old)
    assert sorted(tier.client.keys(old_prefix + b"*")) == [old_prefix + metas[1].key.hex().encode()]


def test_blocks_read_from_redis_are_remembered_as_held_up_to_a_bound(redis_server, monkeypatch):
    """So that write-through does not write another daemon's block back; bounded, so that a
    long life of reads does not grow the daemon."""
    import kvctl.daemon.cache.tiers.remote as remote_module
    from kvctl.daemon.cache.tiers import RemoteTier

    monkeypatch.setattr(remote_module, "SEEN_LIMIT", 2)
    tier = RemoteTier(redis_server.url, 1 << 30, b"S" * 32)
    for key in (b"a" * 32, b"b" * 32, b"c" * 32):
        tier.note_read(key)
    assert [tier.holds(k * 32) for k in (b"a", b"b", b"c")] == [False, True, True] and not tier.meta
    assert tier.purge_keys([b"c" * 32]) == {"dropped": 0, "seen": 1, "complete": True}  # nothing there to drop
    assert not tier.holds(b"c" * 32)


def test_purging_a_tenant_from_a_redis_cluster_scans_every_node(redis_cluster):
    report, only_globex_left, stray = _purge_case(redis_cluster)
    assert report == {"dropped": 3, "seen": 6, "complete": True} and only_globex_left and stray == b"hello"


def test_a_redis_cluster_url_shares_prefixes_across_engines(demo, redis_cluster):
    first, _ = engine_with(demo, remote_url=redis_cluster, write_policy="write_through")
    cold = generate(first, TEXT_A, demo)
    first.tiers.flush()
    assert len(first.tiers.remote.index) == (len(demo.tokenizer.encode(TEXT_A)) + 8 - 1) // 16
    second, tiered = engine_with(demo, remote_url=redis_cluster)
    warm = generate(second, TEXT_A, demo)
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids
    assert warm.metrics.restored_tokens == (len(demo.tokenizer.encode(TEXT_A)) - 1) // 16 * 16


def test_corrupted_and_foreign_redis_payloads_are_misses(demo, redis_server):
    import redis

    first, _ = engine_with(demo, remote_url=redis_server.url, write_policy="write_through")
    cold = generate(first, TEXT_A, demo)
    first.tiers.flush()
    client = redis.Redis.from_url(redis_server.url)
    keys = sorted(client.keys("kvctl:blk:*"))
    assert keys
    remote = first.tiers.remote
    from kvctl.daemon.cache.keys import PrefixHasher

    chain = PrefixHasher(first.namespace("default")).feed(demo.tokenizer.encode(TEXT_A))
    victim = remote.redis_key(chain[1])
    value = bytearray(client.get(victim))
    value[-10] ^= 0xFF
    client.set(victim, bytes(value))
    second, tiered = engine_with(demo, remote_url=redis_server.url)
    warm = generate(second, TEXT_A, demo)
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids
    assert warm.metrics.restored_tokens == 16  # only block 0; block 1 failed its checksum
    assert tiered.stats["remote"].checksum_failures == 1
    assert client.get(victim) is None  # deleted


# ---- the daemon ------------------------------------------------------------------------------
def _complete(app, text):
    response = call(app, "POST", "/v1/completions", json={"prompt": text, "max_tokens": 6,
                                                           "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def test_prefixes_warmed_before_a_restart_hit_after_it(tmp_path):
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB", tiering="always")
    app = create_app(service, service.metrics, front="unix")
    before = _complete(app, TEXT_A)
    service.shutdown(deadline=5)  # the cached device blocks are saved to disk
    segments = list((tmp_path / "kvcache" / "segments").glob("*.kvseg"))
    assert segments
    again = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB", tiering="always")
    try:
        app = create_app(again, again.metrics, front="unix")
        tiers = call(app, "GET", "/admin/tiers").json()
        assert tiers["disk_scan"]["blocks"] > 0 and tiers["disk_scan"]["corrupt"] == 0
        # the prefix tree and its tenant come back from the payload headers: one run, on disk
        [row] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        assert (row["blocks"], row["start_token"], row["parent_id"], row["tiers"], row["tenant"], row["hits"]) == \
            (tiers["disk_scan"]["blocks"], 0, None, {"disk": tiers["disk_scan"]["blocks"]}, "default", None)
        after = _complete(app, TEXT_A)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        tiers = call(app, "GET", "/admin/tiers").json()
        assert tiers["tokens"]["restored"] == after["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert tiers["tiers"]["disk"]["hit_tokens"] == tiers["tokens"]["restored"]
        metrics = call(app, "GET", "/metrics").text
        assert 'kvd_tier_bytes{tier="disk"}' in metrics
        assert 'kvd_tier_moved_bytes_total{dst="device",src="disk"}' in metrics
        assert "kvd_restored_tokens_total" in metrics and "kvd_tier_restore_seconds_bucket" in metrics
    finally:
        again.shutdown(deadline=2)


def test_a_block_size_change_sets_the_disk_aside_within_its_bytes_and_a_rollback_brings_it_back(tmp_path):
    """kvd restarted with another block size cannot use the disk's blocks: it sets them aside
    (shown, and counted against the tier's bytes). Restarted with the old block size again, it finds
    them, and the prefix hits as before the change."""
    from rich.console import Console

    from kvctl.daemon.server.app import create_app
    from kvctl.tiers_cmd import render_tiers

    settings = dict(num_blocks=64, disk_cache_bytes="16MiB", tiering="always")
    service = start_service(tmp_path, **settings)
    before = _complete(create_app(service, service.metrics, front="unix"), TEXT_A)
    service.shutdown(deadline=5)
    saved = sum(p.stat().st_size for p in (tmp_path / "kvcache" / "segments").glob("*.kvseg"))
    assert saved > 0

    changed = start_service(tmp_path, **settings, block_size=32)
    try:
        report = call(create_app(changed, changed.metrics, front="unix"), "GET", "/admin/tiers").json()
        assert (report["disk_scan"]["blocks"], report["disk_scan"]["readmitted"]) == (0, 0)
        assert report["disk_scan"]["foreign"] >= 1 and report["tiers"]["disk"]["set_aside_bytes"] == saved
        console = Console(record=True, width=100)
        render_tiers(report, console)
        [row] = [line for line in console.export_text().splitlines() if line.startswith("set aside")]
        assert row.split()[-2:] == [f"{saved / 1024:.1f}", "KiB"]
    finally:
        changed.shutdown(deadline=5)

    rolled_back = start_service(tmp_path, **settings)
    try:
        app = create_app(rolled_back, rolled_back.metrics, front="unix")
        report = call(app, "GET", "/admin/tiers").json()
        assert report["disk_scan"]["readmitted"] >= 1 and report["disk_scan"]["blocks"] > 0
        assert report["tiers"]["disk"]["set_aside_bytes"] == 0
        after = _complete(app, TEXT_A)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        rolled_back.shutdown(deadline=2)


def _upgraded_checkpoint(tmp_path):
    """The demo checkpoint with another config.json (a new model revision, the same tokenizer)."""
    import json
    import shutil

    from kvctl.daemon.model.demo import ensure_demo_checkpoint

    source = ensure_demo_checkpoint(tmp_path / "models-src")
    target = tmp_path / "upgraded"
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "kvctl_release": "2"}))
    return target


def test_after_an_upgrade_the_old_revision_s_blocks_are_shown_and_evicted_from_disk_and_the_shared_redis(
        tmp_path, redis_server):
    """A daemon moves to a new model revision: the old revision's disk segments are set aside, and
    its entries stay on the shared Redis (other daemons may have written them too). `kvctl tiers`
    names the revision the set-aside bytes belong to; evicting that revision, which this daemon no
    longer serves, deletes exactly those segments and every daemon's Redis entries of it, and
    nothing of the revision it serves."""
    from rich.console import Console

    from kvctl.daemon.cache.tiers import RemoteTier
    from kvctl.daemon.server.app import create_app
    from kvctl.tiers_cmd import render_tiers

    settings = dict(num_blocks=64, disk_cache_bytes="16MiB", tiering="always", remote_url=redis_server.url,
                    write_policy="write_through")
    old = start_service(tmp_path, **settings)
    _complete(create_app(old, old.metrics, front="unix"), TEXT_A)
    old_revision, old_space = old.loaded.revision, old.tiers.space
    old.tiers.remote.client.delete(b"kvctl:spaces")  # Redis lost the record (its memory policy): it is made again
    assert list(old.tiers.remote.spaces()) == [old_space.hex()]
    old.shutdown(deadline=5)
    client = RemoteTier(redis_server.url, 1 << 30, old_space).client
    old_prefix = RemoteTier.space_prefix(old_space)
    old_entries = len(client.keys(old_prefix + b"*"))
    assert old_entries > 0
    client.set(old_prefix + b"not-a-block", b"left alone")
    saved = sum(p.stat().st_size for p in (tmp_path / "kvcache" / "segments").glob("*.kvseg"))

    new = start_service(tmp_path, **settings, model=str(_upgraded_checkpoint(tmp_path)))
    try:
        assert new.loaded.revision != old_revision
        app = create_app(new, new.metrics, front="unix")
        _complete(app, TEXT_B)
        new.tiers.flush()
        new_entries = len(client.keys(RemoteTier.space_prefix(new.tiers.space) + b"*"))
        assert new_entries > 0
        disk = call(app, "GET", "/admin/tiers").json()["tiers"]["disk"]
        [aside] = disk["set_aside"]
        assert aside["model_revision"] == old_revision and aside["space"] == old_space.hex()[:16]
        assert (aside["kind"], aside["bytes"], disk["set_aside_bytes"]) == ("foreign", saved, saved)
        console = Console(record=True, width=200)
        render_tiers(call(app, "GET", "/admin/tiers").json(), console)
        [line] = [x for x in console.export_text().splitlines() if x.startswith("disk set aside:")]
        assert f"in {aside['segments']} segment" in line and f"of model {old_revision[:16]} (float32" in line

        preview = call(app, "POST", "/admin/evict/preview", json={"model_revision": old_revision[:8]}).json()
        assert preview == {"dry_run": True, "evicted_blocks": 0, "skipped": {}, "result": "ok",
                           "target": f"model_revision={old_revision[:16]}", "lower_tier_blocks_dropped": 0,
                           "spaces": preview["spaces"], "not_counted": [
                               "the disk segments of those spaces (counted when they are purged)",
                               "other daemons' entries on the shared Redis (searched for by the eviction itself)"]}
        assert [s["model_revision"] for s in preview["spaces"]] == [old_revision]
        assert len(client.keys(old_prefix + b"*")) == old_entries + 1  # nothing went, nothing claimed
        gone = call(app, "POST", "/admin/evict", json={"model_revision": old_revision[:8]}).json()
        assert gone["result"] == "ok" and gone["target"] == f"model_revision={old_revision[:16]}"
        assert gone["spaces"] == preview["spaces"]
        assert gone["evicted_blocks"] == 0 and gone["disk_purge"] == {"segments": aside["segments"], "blocks": 0,
                                                                       "bytes": saved}
        assert gone["remote_purge"] == {"dropped": old_entries, "seen": old_entries + 1, "complete": True}
        assert [s["model_revision"] for s in gone["spaces"]] == [old_revision]
        assert client.keys(old_prefix + b"*") == [old_prefix + b"not-a-block"]
        assert len(client.keys(RemoteTier.space_prefix(new.tiers.space) + b"*")) == new_entries
        after = call(app, "GET", "/admin/tiers").json()["tiers"]["disk"]
        assert after["set_aside_bytes"] == 0 and "set_aside" not in after and after["blocks"] == disk["blocks"]
        [audit] = new.store.audit_since(action="evict")
        assert audit["target"] == f"model_revision={old_revision[:16]}"
        # a fleet eviction (kvd router's token): the first replica to claim it on the Redis searches it,
        # the next one on the same Redis leaves the search to it
        token = {"model_revision": old_revision[:8], "purge_once": "0123456789abcdef"}
        first = call(app, "POST", "/admin/evict", json=token).json()
        second = call(app, "POST", "/admin/evict", json=token).json()
        assert first["remote_purge"] == {"dropped": 0, "seen": 1, "complete": True}  # the stray value
        assert (second["result"], second["remote_purge"]) == ("ok", {"by_another_replica": True})
        bad = call(app, "POST", "/admin/evict", json={**token, "purge_once": "not hex"})
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "purge_once")

        unknown = call(app, "POST", "/admin/evict", json={"model_revision": "abcdef12"})
        error = unknown.json()["error"]
        assert unknown.status_code == 404 and error["param"] == "model_revision"
        assert error["message"] == (f"model_revision: no tier here holds blocks of 'abcdef12' (this daemon serves "
                                    f"{new.loaded.revision[:16]}; the tiers have held blocks of {old_revision[:16]})")
    finally:
        new.shutdown(deadline=2)


def test_evicting_the_served_revision_takes_its_older_scales_from_disk_and_leaves_them_on_the_shared_redis(
        tmp_path, redis_server):
    """New scales applied live put the daemon in a new block space of the same model revision.
    Evicting that revision takes what its own disk still holds under the older scales; the shared
    Redis keeps the older scales' entries, which daemons still serving them (a rollout's baseline)
    read."""
    from kvctl.daemon.cache.tiers import RemoteTier
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB", tiering="always",
                            remote_url=redis_server.url, write_policy="write_through")
    try:
        app = create_app(service, service.metrics, front="unix")
        _complete(app, TEXT_A)
        service.tiers.flush()
        before = service.tiers.space
        on_disk = len(service.tiers.disk.index)
        client = service.tiers.remote.client
        shared = len(client.keys(RemoteTier.space_prefix(before) + b"*"))
        assert on_disk > 0 and shared > 0
        with service.lock:
            service._load_scales({"scales": {}, "id": 99})  # what applying a calibration does
        assert service.tiers.space != before
        assert sorted(service.tiers.disk.spaces.load()) == sorted([before.hex(), service.tiers.space.hex()])
        gone = call(app, "POST", "/admin/evict", json={"model_revision": service.loaded.revision[:8]}).json()
        assert gone["result"] == "ok" and gone["target"] == "model_revision=current"
        # its own lower tiers' blocks go as before (the old scales' with them), the older space's
        # set-aside or indexed segments too (none left here), and nothing on the shared Redis
        assert gone["lower_tier_blocks_dropped"] == on_disk and "remote_purge" not in gone
        assert [s["space"] for s in gone["spaces"]] == [before.hex()[:16]]
        assert not service.tiers.disk.index
        assert len(client.keys(RemoteTier.space_prefix(before) + b"*")) == shared
    finally:
        service.shutdown(deadline=2)


def test_evicting_a_tenant_after_a_restart_reaches_its_blocks_on_disk(tmp_path):
    """Each payload records its tenant: after a restart (nothing of the tenant in memory) an
    operator's `evict --tenant` still removes exactly that tenant's blocks from disk."""
    from kvctl.daemon.server.app import create_app

    settings = dict(num_blocks=64, disk_cache_bytes="16MiB", tiering="always")
    service = start_service(tmp_path, **settings)
    app = create_app(service, service.metrics, front="unix")
    for tenant, text in (("acme", TEXT_A), ("globex", TEXT_B)):
        response = call(app, "POST", "/v1/completions", headers={"X-KVD-Tenant": tenant},
                        json={"prompt": text, "max_tokens": 1, "temperature": 0})
        assert response.status_code == 200, response.text
    service.shutdown(deadline=5)
    again = start_service(tmp_path, **settings)
    try:
        app = create_app(again, again.metrics, front="unix")
        rows = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        blocks = {r["tenant"]: r["blocks"] for r in rows}
        assert set(blocks) == {"acme", "globex"} and all(r["tiers"] == {"disk": r["blocks"]} for r in rows)
        gone = call(app, "POST", "/admin/evict", json={"tenant": "acme"}).json()
        assert (gone["evicted_blocks"], gone["lower_tier_blocks_dropped"]) == (0, blocks["acme"])
        assert [r["tenant"] for r in call(app, "GET", "/admin/prefixes").json()["prefixes"]] == ["globex"]
        for tenant, text, cached in (("acme", TEXT_A, 0), ("globex", TEXT_B, blocks["globex"] * 16)):
            usage = call(app, "POST", "/v1/completions", headers={"X-KVD-Tenant": tenant},
                         json={"prompt": text, "max_tokens": 1, "temperature": 0}).json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == cached
        # a prefix an operator brings back up keeps its tenant: its eviction takes it
        call(app, "POST", "/admin/evict", json={"tenant": "globex"})
        again.shutdown(deadline=5)
        again = start_service(tmp_path, **settings)
        app = create_app(again, again.metrics, front="unix")
        [row] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        assert row["tenant"] == "acme"  # what acme's request above left, saved at the shutdown
        back = call(app, "POST", "/admin/swap", json={"prefix": row["prefix_id"], "to": "device", "copy": True}).json()
        assert back["verified_blocks"] == row["blocks"]
        gone = call(app, "POST", "/admin/evict", json={"tenant": "acme"}).json()
        assert (gone["evicted_blocks"], gone["lower_tier_blocks_dropped"]) == (row["blocks"], row["blocks"])
    finally:
        again.shutdown(deadline=2)


def test_the_host_tier_is_saved_to_disk_at_shutdown_too(tmp_path):
    """Host memory goes with the process: at shutdown its blocks that disk lacks are written
    there, after the device's, so a restart still hits them."""
    from kvctl.daemon.server.app import create_app

    settings = dict(num_blocks=64, host_cache_bytes="4MiB", disk_cache_bytes="16MiB", tiering="always")
    service = start_service(tmp_path, **settings)
    app = create_app(service, service.metrics, front="unix")
    before = _complete(app, TEXT_B)
    [row] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
    moved = call(app, "POST", "/admin/swap", json={"prefix": row["prefix_id"], "to": "host"}).json()
    assert moved["verified_blocks"] == moved["evicted_from_device"] == row["blocks"]
    assert call(app, "GET", "/admin/tiers").json()["tiers"]["disk"]["blocks"] == 0  # host only, for now
    service.shutdown(deadline=5)
    again = start_service(tmp_path, **settings)
    try:
        app = create_app(again, again.metrics, front="unix")
        [row_again] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        assert (row_again["prefix_id"], row_again["tiers"]) == (row["prefix_id"], {"disk": row["blocks"]})
        after = _complete(app, TEXT_B)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == row["blocks"] * 16
    finally:
        again.shutdown(deadline=2)


def test_a_pinned_prefix_is_back_on_the_device_after_a_restart_before_any_request(tmp_path):
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB", tiering="always")
    app = create_app(service, service.metrics, front="unix")
    pin = call(app, "POST", "/admin/pins", json={"text": TEXT_A, "note": "system prompt"}).json()
    assert pin["cached_blocks"] == pin["blocks"] > 0
    service.shutdown(deadline=5)  # the device blocks are saved to disk; the pin is in the store
    again = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB", tiering="always")
    try:
        again.pin_warmer.join(30)
        app = create_app(again, again.metrics, front="unix")
        [listed] = call(app, "GET", "/admin/pins").json()["pins"]
        assert (listed["pin_id"], listed["cached_blocks"]) == (pin["pin_id"], pin["blocks"])
        status = call(app, "GET", "/admin/status").json()
        assert status["blocks"]["device"]["pinned"] == pin["blocks"]
        after = _complete(app, TEXT_A)  # a device hit: nothing left to restore
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == pin["blocks"] * 16
        assert call(app, "GET", "/admin/tiers").json()["tokens"]["restored"] == 0
        evicted = call(app, "POST", "/admin/evict", json={"all_unpinned": True}).json()
        assert evicted["skipped"]["pinned"] == pin["blocks"]  # pinned as they landed
    finally:
        again.shutdown(deadline=2)


def test_tier_report_says_a_remote_has_no_budget_and_break_evens_are_assumed_until_measured(tmp_path):
    from rich.console import Console

    from kvctl.daemon.server.app import create_app
    from kvctl.tiers_cmd import render_tiers

    # nothing listens on port 1: the remote tier is down from the start, and kvd serves on
    service = start_service(tmp_path, num_blocks=64, host_cache_bytes="1MiB",
                            remote_url="redis://:s3cret@127.0.0.1:1/0")
    try:
        app = create_app(service, service.metrics, front="unix")
        shown = call(app, "GET", "/admin/config").json()["config"]["remote_url"]
        assert shown == "redis://:***@127.0.0.1:1/0"  # config show never prints the password
        report = call(app, "GET", "/admin/tiers").json()
        assert report["tiers"]["remote"]["capacity_bytes"] is None
        assert report["tiers"]["host"]["capacity_bytes"] == 2**20
        assert report["break_even_measured"] == {"host": False, "remote": False}
        metrics = call(app, "GET", "/metrics").text
        assert 'kvd_tier_capacity_bytes{tier="host"}' in metrics and 'capacity_bytes{tier="remote"}' not in metrics
        console = Console(record=True, width=80)
        render_tiers(report, console)
        text = console.export_text()
        capacity = next(line for line in text.splitlines() if line.startswith("capacity"))
        assert capacity.split()[-4:] == ["1.0", "MiB", "no", "budget"]  # device, host, remote columns
        assert "(assumed rates: nothing measured yet)" in " ".join(text.split())
    finally:
        service.shutdown(deadline=2)


def test_evicting_a_tenant_after_listing_prefixes_also_empties_the_lower_tiers(tmp_path):
    """Listing prefixes used to forget whose a prefix on disk was; a later `evict --tenant` then
    left its blocks on disk."""
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB", tiering="always")
    try:
        app = create_app(service, service.metrics, front="unix")
        _complete(app, TEXT_A)
        [prefix] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        call(app, "POST", "/admin/swap", json={"prefix": prefix["prefix_id"], "to": "disk"})
        call(app, "GET", "/admin/prefixes")  # an operator looks
        evicted = call(app, "POST", "/admin/evict", json={"tenant": "default"}).json()
        assert evicted["lower_tier_blocks_dropped"] == prefix["blocks"]
        assert call(app, "GET", "/admin/prefixes").json()["prefixes"] == []
        assert call(app, "GET", "/admin/tiers").json()["tiers"]["disk"]["blocks"] == 0
    finally:
        service.shutdown(deadline=2)


def test_kvd_s_eviction_drops_blocks_still_being_written_and_says_so_when_it_cannot(tmp_path, monkeypatch):
    """`kvctl evict --tenant` while the prompt's blocks are on their way to disk: kvd waits for the
    writes and drops those blocks too, so the disk holds none afterwards. Writes that do not land
    within the wait are counted, and the eviction is partial with a message saying what to do."""
    import threading

    from kvctl.daemon.server import evict_ops
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB", tiering="always",
                            write_policy="write_through")
    try:
        app = create_app(service, service.metrics, front="unix")
        disk = service.tiers.disk
        for wait, released_after in ((30.0, 0.2), (0.1, None)):
            monkeypatch.setattr(evict_ops, "EVICT_WRITE_WAIT_S", wait)
            gate = hold_disk_writes(disk)
            _complete(app, TEXT_A)
            moving = sum(1 for _, tier in service.tiers.known_metas().values() if tier == "moving")
            assert moving > 0 and not disk.index
            if released_after is not None:
                threading.Timer(released_after, gate.set).start()
            evicted = call(app, "POST", "/admin/evict", json={"tenant": "default"}).json()
            gate.set()
            assert service.tiers.flush(timeout=10)
            if released_after is not None:  # the writes landed during the wait and went with the rest
                assert (evicted["result"], evicted["lower_tier_blocks_dropped"]) == ("ok", moving)
                assert "lower_tier_blocks_still_moving" not in evicted and not disk.index
            else:
                assert (evicted["result"], evicted["lower_tier_blocks_still_moving"]) == ("partial", moving)
                assert evicted["message"] == (f"{moving} blocks were still being written to disk or Redis after "
                                              f"0.1 s and were not dropped; run the eviction again")
                assert len(disk.index) == moving  # as it said: the next eviction takes them
                again = call(app, "POST", "/admin/evict", json={"tenant": "default"}).json()
                assert (again["result"], again["lower_tier_blocks_dropped"]) == ("ok", moving) and not disk.index
    finally:
        service.shutdown(deadline=2)


def test_a_move_to_host_waits_for_the_prefix_s_writes_to_disk_and_leaves_no_copy_there(tmp_path):
    """Written through, a prompt's blocks are on their way to disk when `kvctl swap --to host` moves
    the prefix: the move dropped the copies the disk held then, and the write put them there after
    it. It now waits for those writes, so that the prefix is in host memory alone, as it said."""
    import threading

    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=64, host_cache_bytes="4MiB", disk_cache_bytes="16MiB",
                            tiering="always", write_policy="write_through")
    try:
        app = create_app(service, service.metrics, front="unix")
        disk = service.tiers.disk
        gate = hold_disk_writes(disk)
        _complete(app, TEXT_A)
        [prefix] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        assert not disk.index  # its blocks are on their way to disk
        threading.Timer(0.2, gate.set).start()
        moved = call(app, "POST", "/admin/swap", json={"prefix": prefix["prefix_id"], "to": "host"}).json()
        assert moved["verified_blocks"] == moved["blocks"] == prefix["blocks"]
        assert service.tiers.flush(timeout=10) and not disk.index  # no copy landed on disk after the move
        [row] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        assert (row["tier"], row["tiers"]) == ("host", {"host": prefix["blocks"]})
    finally:
        service.shutdown(deadline=2)


def test_swap_moves_a_prefix_down_and_back_and_prefixes_show_its_tier(tmp_path):
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=64, host_cache_bytes="4MiB", disk_cache_bytes="16MiB",
                            tiering="always")
    try:
        app = create_app(service, service.metrics, front="unix")
        before = _complete(app, TEXT_A)
        [prefix] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        assert prefix["tier"] == "device"
        moved = call(app, "POST", "/admin/swap", json={"prefix": prefix["prefix_id"], "to": "disk"}).json()
        assert moved["verified_blocks"] == moved["blocks"] == prefix["blocks"]
        assert moved["evicted_from_device"] == prefix["blocks"]
        for _ in range(2):  # listing it does not forget whose it is, and it stays known while on disk
            [row] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
            assert (row["prefix_id"], row["tier"], row["blocks"]) == (prefix["prefix_id"], "disk", prefix["blocks"])
            assert (row["tenant"], row["hits"]) == (prefix["tenant"], prefix["hits"]) == ("default", 0)
            assert row["idle_seconds"] >= prefix["idle_seconds"]
        back = call(app, "POST", "/admin/swap", json={"prefix": prefix["prefix_id"], "to": "device"}).json()
        assert back["verified_blocks"] == back["blocks"] == prefix["blocks"]
        assert call(app, "GET", "/admin/prefixes").json()["prefixes"][0]["tier"] == "device"
        after = _complete(app, TEXT_A)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == prefix["blocks"] * 16
        bad = call(app, "POST", "/admin/swap", json={"prefix": prefix["prefix_id"], "to": "tape"})
        assert bad.status_code == 400 and "to: invalid value 'tape'" in bad.json()["error"]["message"]
        gone = call(app, "POST", "/admin/swap", json={"prefix": "ffffffff", "to": "disk"})
        assert gone.status_code == 404
        evicted = call(app, "POST", "/admin/evict", json={"prefix": prefix["prefix_id"]}).json()
        assert evicted["evicted_blocks"] == prefix["blocks"] and evicted["lower_tier_blocks_dropped"] == prefix["blocks"]
        assert call(app, "GET", "/admin/prefixes").json()["prefixes"] == []
    finally:
        service.shutdown(deadline=2)


@pytest.mark.parametrize("to", ["host", "disk"])
def test_a_swap_writes_each_block_as_it_was_when_listed_even_if_the_engine_reuses_it_meanwhile(
        tmp_path, to, monkeypatch):
    """A swap listed the prefix's device blocks under the engine's lock and read their contents under
    it again later: between the two, a step could evict an idle block and fill it with another
    sequence's rows, and the swap wrote those rows under the old key, where a later restore would
    serve them. It now reads the contents in the same hold of the lock that lists the blocks."""
    from kvctl.daemon.cache.tiers import decode_block
    from kvctl.daemon.server import tier_ops
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=64, host_cache_bytes="4MiB", disk_cache_bytes="16MiB",
                            tiering="always", write_policy="write_back")  # the swap alone writes them down
    try:
        app = create_app(service, service.metrics, front="unix")
        _tokens(app, SYSTEM_A + [1] * 16 + [99])
        tiers, engine = service.tiers, service.engine
        keys = service.engine.prefix_keys("default", SYSTEM_A + [1] * 16 + [99])[2]
        with service.lock:
            ids = [engine.cache.pool.block_of(k) for k in keys]
            before = tiers.gather(ids)
        listed, resolve, resolved = tiers.known_metas, tier_ops.resolve_prefix, []

        def resolved_first(*args):
            resolved.append(True)
            return resolve(*args)

        def reused_meanwhile():  # once the swap has its prefix, a step reuses the blocks for other rows
            if resolved:
                with service.lock:
                    for cache in tiers.kv_caches:
                        for block_id in ids:
                            cache.k[block_id] = 7.0
                            cache.v[block_id] = -7.0
            return listed()

        monkeypatch.setattr(tier_ops, "resolve_prefix", resolved_first)
        tiers.known_metas = reused_meanwhile
        moved = call(app, "POST", "/admin/swap", json={"prefix": keys[0].hex()[:16], "to": to, "copy": True}).json()
        monkeypatch.undo()
        tiers.known_metas = listed
        assert resolved  # the blocks were reused after the swap found its prefix
        assert moved["verified_blocks"] == moved["blocks"] == len(keys)
        for i, key in enumerate(keys):
            if to == "host":
                with tiers.lock:
                    stored = [(k[0], v[0]) for k, v in tiers.host.read_slots([tiers.host.index[key]])]
            else:
                stored = decode_block(tiers.disk.read(key), tiers.layout, tiers.space, key).layers()
            assert all(torch.equal(s_k, b_k[i]) and torch.equal(s_v, b_v[i])
                       for (s_k, s_v), (b_k, b_v) in zip(stored, before)), f"block {i} written as reused"
    finally:
        service.shutdown(deadline=2)


SHARED = [5] * 16  # one block every prompt below starts with (as a chat template is)
SYSTEM_A, SYSTEM_B = SHARED + [10] * 32, SHARED + [20] * 32


def _tokens(app, tokens):
    response = call(app, "POST", "/v1/completions", json={"prompt": tokens, "max_tokens": 1, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def _ids(service, tokens):
    """The prefix ids (16 hex digits) of each full block of `tokens`."""
    return [key.hex()[:16] for key in service.engine.prefix_keys("default", tokens)[2]]


def test_prefixes_branch_where_prompts_part_and_evict_and_swap_take_one_branch(tmp_path):
    """Prompts that share their first block are not one prefix: the listing splits at each
    branch, and an id evicts or moves its branch and what extends it, never its siblings."""
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=64, host_cache_bytes="4MiB", disk_cache_bytes="16MiB",
                            tiering="always")
    try:
        app = create_app(service, service.metrics, front="unix")
        q1, q2, q3 = (SYSTEM_A + [1] * 16 + [99], SYSTEM_A + [2] * 16 + [99], SYSTEM_B + [3] * 16 + [99])
        for prompt in (q1, q2, q3):
            _tokens(app, prompt)
        a, b, c = _ids(service, q1), _ids(service, q2), _ids(service, q3)  # 4 full blocks each
        rows = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        got = {r["prefix_id"]: (r["parent_id"], r["start_token"], r["tokens"], r["blocks"], r["tier"], r["children"])
               for r in rows}
        assert got == {a[0]: (None, 0, 16, 1, "device", 2),  # the shared block
                       a[1]: (a[0], 16, 48, 2, "device", 2),  # system prompt A
                       a[3]: (a[1], 48, 64, 1, "device", 0), b[3]: (a[1], 48, 64, 1, "device", 0),
                       c[1]: (a[0], 16, 64, 3, "device", 0)}  # system prompt B and its one question
        assert [r["prefix_id"] for r in rows][0] == a[0]  # parents before children
        assert {r["tenant"] for r in rows} == {"default"} and not any(r["detached"] for r in rows)
        assert {r["root_id"] for r in rows} == {a[0]}  # one tree
        assert next(r for r in rows if r["prefix_id"] == a[1])["hits"] == 1  # q2 reused it

        # kvd sorts and cuts the list and says how many rows there are
        by_size = call(app, "GET", "/admin/prefixes", params={"sort": "size", "limit": 2}).json()
        assert (by_size["total"], [r["prefix_id"] for r in by_size["prefixes"]]) == (5, [c[1], a[1]])
        by_hits = call(app, "GET", "/admin/prefixes", params={"sort": "hits"}).json()["prefixes"]
        assert [r["hits"] for r in by_hits] == sorted((r["hits"] for r in by_hits), reverse=True)
        under = call(app, "GET", "/admin/prefixes", params={"under": a[1][:8]}).json()
        assert (under["total"], [r["prefix_id"] for r in under["prefixes"]][0]) == (3, a[1])  # A, then its two
        assert {r["prefix_id"] for r in under["prefixes"]} == {a[1], a[3], b[3]}
        nowhere = call(app, "GET", "/admin/prefixes", params={"under": "ffffffff"})
        assert (nowhere.status_code, nowhere.json()["error"]["message"], nowhere.json()["error"]["param"]) == \
            (404, "under: no cached prefix 'ffffffff'", "under")
        bad = call(app, "GET", "/admin/prefixes", params={"sort": "age"})
        assert bad.status_code == 400 and bad.json()["error"]["message"] == \
            "sort: unknown value 'age'; use recent, hits, size"

        # a block that went down keeps what the device knew of its use
        call(app, "POST", "/admin/swap", json={"prefix": b[3], "to": "host"})
        row = next(r for r in call(app, "GET", "/admin/prefixes").json()["prefixes"] if r["prefix_id"] == b[3])
        assert (row["tiers"], row["hits"]) == ({"host": 1}, 0) and 0 <= row["idle_seconds"] < 60

        evicted = call(app, "POST", "/admin/evict", json={"prefix": a[1][:8]}).json()
        assert (evicted["target"], evicted["evicted_blocks"], evicted["lower_tier_blocks_dropped"]) == \
            (f"prefix={a[1]}", 3, 1)  # A and both questions, one of them from the host tier
        [left] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        # the shared block stays for B; with one way on from it, it and B are one run now
        assert (left["prefix_id"], left["tokens"], left["blocks"], left["children"]) == (a[0], 64, 4, 0)
        assert _tokens(app, q3)["usage"]["prompt_tokens_details"]["cached_tokens"] == 64

        # B's id, listed before the merge, still names B: from its first block on
        moved = call(app, "POST", "/admin/swap", json={"prefix": c[1], "to": "disk"}).json()
        assert (moved["prefix_id"], moved["blocks"], moved["verified_blocks"], moved["evicted_from_device"]) == \
            (c[1], 3, 3, 3)
        [row] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        assert (row["prefix_id"], row["tiers"], row["tier"]) == (a[0], {"device": 1, "disk": 3}, "device")
        # the shared block's id takes everything that extends it; bringing B back up then
        # brings up the block it extends too
        call(app, "POST", "/admin/swap", json={"prefix": a[0], "to": "host"})
        [row] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        assert row["tiers"] == {"host": 4}
        back = call(app, "POST", "/admin/swap", json={"prefix": c[1], "to": "device", "copy": True}).json()
        assert (back["blocks"], back["verified_blocks"]) == (3, 3)
        assert (back["extended_blocks"], back["extended_on_device"], back["moved_blocks"]) == (1, 1, 4)
        assert _tokens(app, q3)["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        gone = call(app, "POST", "/admin/evict", json={"prefix": "ffffffff"})
        assert gone.status_code == 404
    finally:
        service.shutdown(deadline=2)


def test_a_cached_prefix_is_pinned_by_its_id_without_its_text(tmp_path):
    """An operator sees a hot row in `kvctl prefixes` and pins it by id: the prefix from its first
    token to the row's end, paid by its tenant; a part in a lower tier comes back up pinned."""
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=64, host_cache_bytes="4MiB", tiering="always")
    try:
        app = create_app(service, service.metrics, front="unix")
        q1, q2, q3 = (SYSTEM_A + [1] * 16 + [99], SYSTEM_A + [2] * 16 + [99], SYSTEM_B + [3] * 16 + [99])
        for prompt in (q1, q2, q3):
            _tokens(app, prompt)
        a, c = _ids(service, q1), _ids(service, q3)
        pinned = call(app, "POST", "/admin/pins", json={"prefix": a[1][:8], "ttl": "1h", "note": "system A"}).json()
        assert (pinned["prefix_id"], pinned["blocks"], pinned["cached_blocks"], pinned["tenant"]) == (a[1], 3, 3, "default")
        rows = {r["prefix_id"]: r for r in call(app, "GET", "/admin/prefixes").json()["prefixes"]}
        assert [rows[k]["pinned_blocks"] for k in (a[0], a[1], a[3], c[1])] == [1, 2, 0, 0]
        moved = call(app, "POST", "/admin/swap", json={"prefix": a[1], "to": "host"}).json()
        assert (moved["verified_blocks"], moved["evicted_from_device"], moved["kept_on_device"]) == (4, 2, {"pinned": 2})
        evicted = call(app, "POST", "/admin/evict", json={"all_unpinned": True}).json()
        assert evicted["skipped"]["pinned"] == 3
        # the pinned blocks' copies in host memory stay too; only the two questions' go
        assert evicted["lower_tier_blocks_dropped"] == 2
        assert call(app, "GET", "/admin/tiers").json()["tiers"]["host"]["blocks"] == 2
        assert _tokens(app, SYSTEM_A + [7] * 17)["usage"]["prompt_tokens_details"]["cached_tokens"] == 48

        _tokens(app, q3)  # B again, then down to the host tier, then pinned from there
        call(app, "POST", "/admin/swap", json={"prefix": c[1], "to": "host"})
        up = call(app, "POST", "/admin/pins", json={"prefix": c[1]}).json()
        assert (up["blocks"], up["cached_blocks"]) == (4, 4)  # the shared block and B's three, on the device
        assert call(app, "GET", "/admin/status").json()["blocks"]["device"]["pinned"] == 6  # shared once

        wrong = call(app, "POST", "/admin/pins", json={"prefix": c[1], "tenant": "acme"})
        assert wrong.status_code == 400 and wrong.json()["error"]["message"] == \
            f"tenant: prefix {c[1]} is tenant 'default''s, not 'acme''s"
        zero = call(app, "POST", "/admin/pins", json={"prefix": c[1], "ttl": 0})
        assert (zero.status_code, zero.json()["error"]["message"], zero.json()["error"]["param"]) == \
            (400, "ttl: must be a finite number of seconds > 0 (or 30m, 1h, 2d), got 0.0", "ttl")
        both = call(app, "POST", "/admin/pins", json={"prefix": c[1], "text": "hello"})
        assert both.status_code == 400 and both.json()["error"]["param"] == "prefix"
        for pin in call(app, "GET", "/admin/pins").json()["pins"]:
            call(app, "DELETE", f"/admin/pins/{pin['pin_id']}")
        with service.lock:  # the shared first block goes; B's blocks stay, reachable by nothing
            service.engine.cache.evict_prefix([service.engine.prefix_keys("default", q3)[2][0]])
        lost = call(app, "POST", "/admin/pins", json={"prefix": c[1]})
        assert lost.status_code == 409 and "is unreachable (the blocks before it are cached nowhere)" in \
            lost.json()["error"]["message"]
    finally:
        service.shutdown(deadline=2)


def test_tier_settings_come_from_the_yaml_tiers_mapping(tmp_path):
    from kvctl.daemon.config import ConfigError, resolve

    path = tmp_path / "kvd.yaml"
    path.write_text("tiers:\n  host: {bytes: 1GiB}\n  disk: {bytes: 10GiB, path: /var/lib/kvd/kv}\n"
                    "  remote: {url: 'redis://10.0.0.5:6379/0', bytes: 2GiB}\nwrite_policy: write_through\n")
    cfg = resolve({}, env={}, config_file=path)
    assert (cfg.host_cache_bytes, cfg.disk_cache_bytes, cfg.disk_cache_path, cfg.remote_url,
            cfg.remote_cache_bytes, cfg.write_policy) == (2**30, 10 * 2**30, "/var/lib/kvd/kv",
                                                          "redis://10.0.0.5:6379/0", 2 * 2**30, "write_through")
    assert resolve({"host_cache_bytes": "2GiB"}, env={}, config_file=path).host_cache_bytes == 2 * 2**30
    path.write_text("tiers:\n  tape: {bytes: 1}\n")
    with pytest.raises(ConfigError, match="tiers: unknown tier 'tape'"):
        resolve({}, env={}, config_file=path)
    with pytest.raises(ConfigError, match="write_policy: invalid value 'sometimes'"):
        resolve({"write_policy": "sometimes"}, env={})
    with pytest.raises(ConfigError, match="remote_url: invalid value 'http://x'"):
        resolve({}, env={"KVD_REMOTE_URL": "http://x"})


def test_every_metric_the_grafana_dashboard_charts_is_exported(tmp_path):
    import json
    import re
    from pathlib import Path

    from .daemon_fixtures import scrape_every_family

    dashboard = json.loads((Path(__file__).parent.parent / "examples" / "grafana" / "kvd.json").read_text())
    wanted = {name for panel in dashboard["panels"] for target in panel["targets"]
              for name in re.findall(r"kvd_[a-z_]+", target["expr"])}
    assert {"kvd_tier_bytes", "kvd_tier_moved_bytes_total", "kvd_tier_restore_seconds_bucket",
            "kvd_rollout_ttft_seconds_bucket", "kvd_gc_pause_seconds_bucket", "kvd_tenant_evicted_blocks_total",
            "kvd_stranded_pins", "kvd_build_info", "kvd_model_info"} <= wanted
    text = scrape_every_family(tmp_path)
    exported = set(re.findall(r"^(kvd_[a-z_]+)", text, re.MULTILINE))  # families with samples
    suffixes = {"histogram": ("_bucket", "_sum", "_count")}  # a counter's TYPE line names it with _total
    for name, kind in re.findall(r"^# TYPE (kvd_[a-z_]+) (\w+)", text, re.MULTILINE):  # and without
        exported.update(name + suffix for suffix in suffixes.get(kind, ("",)))
    assert sorted(wanted - exported) == []


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_device_to_host_slots_and_back_is_bit_exact(device):
    """Demotion copies device blocks straight into host slots (on CUDA: pinned, asynchronously;
    reading a slot on the CPU waits for its copy); a restore brings the same bytes back, with
    slots and blocks in any order (runs become slice copies, the rest index copies)."""
    from kvctl.bench_tiers import _group, _layout
    from kvctl.daemon.cache.tiers import HostTier
    from kvctl.daemon.model.llama import LayerCache

    layout = _layout(4, 2, 128, 16, "bfloat16")
    _, layers = _group(layout, 6, 0)
    cuda = device == "cuda"
    device = [LayerCache(k.to(device), v.to(device)) for k, v in layers]
    host = HostTier(layout.block_bytes * 8, layout, pin_memory=cuda)
    assert host.layers[0][0].is_pinned() == cuda
    metas = _group(layout, 6, 0)[0]
    host.fill_from([7, 1, 2, 3, 0, 5], metas, device, [0, 1, 2, 3, 4, 5])  # one scattered, runs otherwise
    copies = host.read_slots([7, 1, 2, 3, 0, 5])  # waits for the asynchronous copies
    for (hk, hv), (k, v) in zip(copies, layers):
        assert torch.equal(hk, k) and torch.equal(hv, v)
    target = [LayerCache(torch.zeros_like(c.k), torch.zeros_like(c.v)) for c in device]
    host.copy_out([7, 1, 2, 3, 0, 5], target, [5, 4, 3, 2, 1, 0])
    if cuda:
        torch.cuda.synchronize()
    for t, (k, v) in zip(target, layers):
        assert torch.equal(t.k.cpu(), k.flip(0)) and torch.equal(t.v.cpu(), v.flip(0))


def test_a_slow_redis_costs_a_bounded_wait_then_serving_recovers(demo, redis_server):
    """Redis stalls (DEBUG SLEEP) longer than the call timeout: the fetch gives up within the
    bound, the request recomputes, the breaker counts it; once Redis answers, restores resume."""
    import redis

    first, _ = engine_with(demo, remote_url=redis_server.url, write_policy="write_through")
    cold = generate(first, TEXT_A, demo)
    first.tiers.flush()
    engine = Engine(demo, EngineSettings(num_blocks=12, block_size=16))
    from kvctl.daemon.cache.tiers import RemoteTier, TieredCache, engine_layout, space_digest
    from kvctl.policies.tiering import CircuitBreaker, TieringPolicy

    remote = RemoteTier(redis_server.url, 1 << 30, space_digest(engine), timeout=0.2,
                        breaker=CircuitBreaker(threshold=1, cooldown=0.3))
    tiered = TieredCache(engine.kv_caches, engine_layout(engine), space_digest(engine), remote=remote,
                         policy=TieringPolicy(mode="always"))
    engine.attach_tiers(tiered)
    staller = threading.Thread(target=lambda: redis.Redis.from_url(redis_server.url).execute_command(
        "DEBUG", "SLEEP", "1.5"))
    staller.start()
    asleep = redis.Redis.from_url(redis_server.url, socket_timeout=0.05)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until Redis sleeps (a ping unanswered), not a guess at when it will
        try:
            asleep.ping()
            time.sleep(0.01)
        except redis.exceptions.TimeoutError:
            break
    slow = generate(engine, TEXT_A, demo)
    assert staller.is_alive()  # served while Redis still sleeps: the fetch gave up at its timeout
    assert slow.metrics.restored_tokens == 0 and slow.sequences[0].output_ids == cold.sequences[0].output_ids
    assert tiered.stats["remote"].errors >= 1 and remote.breaker.trips >= 1
    staller.join()
    time.sleep(0.4)  # past the cooldown: the next call probes and closes the breaker
    engine.cache.evict_prefix(PrefixHasher(engine.namespace("default")).feed(demo.tokenizer.encode(TEXT_A)))
    warm = generate(engine, TEXT_A, demo)
    assert warm.metrics.restored_tokens > 0 and warm.sequences[0].output_ids == cold.sequences[0].output_ids
    assert remote.health() == "ok"


def test_a_disk_read_error_is_a_miss_and_marks_the_tier_degraded(demo, tmp_path):
    import errno

    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d")
    cold = generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()

    def broken(*where):
        raise OSError(errno.EIO, "Input/output error")

    tiered.disk._read_range = broken
    warm = generate(engine, TEXT_A, demo)
    assert warm.metrics.restored_tokens == 0 and warm.sequences[0].output_ids == cold.sequences[0].output_ids
    report = tiered.report()["tiers"]["disk"]
    assert report["health"] == "degraded" and report["errors"] >= 1


def test_a_prefix_evicted_from_disk_while_its_fetch_reads_it_is_a_miss_not_a_degraded_disk(demo, tmp_path):
    """An operator's eviction drops the blocks between the fetch finding them on disk and reading
    them: the read finds none, which is a miss. It was taken for a failed read: the disk tier was
    marked degraded for 30 s (a warning, and no restore from it meanwhile), seen in
    scripts/operator-stress. A read that fails while the blocks are still there degrades it as before."""
    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d")
    cold = generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()
    disk, read_many = tiered.disk, tiered.disk.read_many

    def evicted_first(keys):
        tiered.drop(keys)
        return read_many(keys)

    disk.read_many = evicted_first
    warm = generate(engine, TEXT_A, demo)
    assert warm.metrics.restored_tokens == 0 and warm.sequences[0].output_ids == cold.sequences[0].output_ids
    report = tiered.report()["tiers"]["disk"]
    assert (report["health"], report["errors"]) == ("ok", 0)
    assert engine.stats.prefetch_outcomes == {"miss": 1}


def test_a_segment_deleted_from_the_folder_is_forgotten_as_gone_not_a_degraded_disk(demo, tmp_path, caplog):
    """A cleanup job (or an operator's rm) deletes segment files under kvd. Each read of those
    blocks failed and marked the whole disk tier degraded for 30 s, again every time, while the
    index kept blocks that no longer existed. Now the missing segment leaves the index as `gone`
    (one warning, counted), the request is a miss, and the tier stays healthy."""
    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d")
    cold = generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()
    disk = tiered.disk
    segments, blocks = len(disk.segments), len(disk.index)
    assert segments >= 1 and blocks >= 1
    for path in disk.segment_dir.glob("*.kvseg"):
        path.unlink()
    with caplog.at_level("WARNING", logger="kvd.tiers"):
        warm = generate(engine, TEXT_A, demo)
    assert warm.metrics.restored_tokens == 0 and warm.sequences[0].output_ids == cold.sequences[0].output_ids
    report = tiered.report()["tiers"]["disk"]
    assert (report["health"], report["errors"], report["vanished_segments"]) == ("ok", 0, segments)
    assert engine.stats.prefetch_outcomes == {"miss": 1}
    assert sum("is gone from" in r.getMessage() and "deleted outside kvd?" in r.getMessage()
               for r in caplog.records) == segments
    push_out(engine, demo)  # the recomputed prefix goes down to the disk again
    tiered.flush()
    assert disk.segments and all((disk.segment_dir / name).is_file() for name in disk.segments)
    assert tiered.report()["tiers"]["disk"]["used_bytes"] == sum(
        (disk.segment_dir / name).stat().st_size for name in disk.segments)
    gone = engine.events.since(0, limit=10_000, kinds=["removed"], tiers=["disk"]).events
    assert {e.reason for e in gone} == {"gone"} and sum(len(e.keys) for e in gone) == blocks


def test_a_segment_cut_short_under_kvd_is_set_aside_as_corrupt_not_a_degraded_disk(demo, tmp_path, caplog):
    """A segment file shorter than kvd wrote it: each read failed ("shorter than its index says")
    and marked the whole tier degraded for 30 s, again every time. Now it is set aside as corrupt
    (as the start scan does), its blocks leave the index, and the request is a miss."""
    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d")
    cold = generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()
    disk = tiered.disk
    names = list(disk.segments)
    for name in names:
        path = disk.segment_dir / name
        path.write_bytes(path.read_bytes()[:100])  # cut short
    with caplog.at_level("WARNING", logger="kvd.tiers"):
        warm = generate(engine, TEXT_A, demo)
    assert warm.metrics.restored_tokens == 0 and warm.sequences[0].output_ids == cold.sequences[0].output_ids
    report = tiered.report()["tiers"]["disk"]
    assert (report["health"], report["errors"], report["set_aside_bytes"]) == ("ok", 0, 100 * len(names))
    assert sorted(p.name for p in (tmp_path / "d" / "quarantine" / "corrupt").iterdir()) == sorted(names)
    assert not set(names) & set(disk.segments)
    assert sum("is shorter than kvd wrote it" in r.getMessage() for r in caplog.records) == len(names)
    removed = engine.events.since(0, limit=10_000, kinds=["removed"], tiers=["disk"]).events
    assert {e.reason for e in removed} == {"corrupt"}


def test_a_disk_tier_whose_folder_was_deleted_makes_it_again_and_goes_on_writing(demo, tmp_path, caplog):
    """`rm -rf` of the tier's folder under kvd: every write failed (No such file or directory)
    and marked the tier degraded, for as long as kvd ran. Now the first write makes the folder,
    its lock and its book of spaces again, forgets the segments that went with it, and writes."""
    import os
    import shutil

    from kvctl.daemon.cache.tiers.disk import DiskTier

    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d")
    generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()
    disk = tiered.disk
    before = len(disk.segments)
    shutil.rmtree(tmp_path / "d")
    with caplog.at_level("WARNING", logger="kvd.tiers"):
        cold_b = generate(engine, TEXT_B, demo)
    push_out(engine, demo)
    tiered.flush()
    report = tiered.report()["tiers"]["disk"]
    assert (report["health"], report["errors"], report["vanished_segments"]) == ("ok", 0, before)
    assert disk.segments and all((disk.segment_dir / name).is_file() for name in disk.segments)
    assert (tmp_path / "d" / "kvd.lock").read_text() == f"pid {os.getpid()}\n"
    # the folder in one line (a read that met a missing segment first names that one on its own)
    said = [r.getMessage() for r in caplog.records]
    [folder] = [m for m in said if "making it again" in m]
    assert folder.startswith(f"disk: {tmp_path / 'd' / 'segments'} is gone (deleted outside kvd?); making it again, "
                             "and forgetting the ")
    assert len(said) <= 1 + before
    with pytest.raises(ValueError, match="is in use by another kvd"):  # the folder is this tier's again
        DiskTier(tmp_path / "d", 1 << 22, disk.layout, disk.space)
    warm_b = generate(engine, TEXT_B, demo)  # B's blocks come back from the new segments
    assert warm_b.metrics.restored_tokens > 0 and warm_b.sequences[0].output_ids == cold_b.sequences[0].output_ids


def test_swap_to_remote_and_back_through_the_daemon(tmp_path, redis_server):
    from kvctl.daemon.server.app import create_app

    service = start_service(tmp_path, num_blocks=64, remote_url=redis_server.url, tiering="always")
    try:
        app = create_app(service, service.metrics, front="unix")
        before = _complete(app, TEXT_A)
        [prefix] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        moved = call(app, "POST", "/admin/swap", json={"prefix": prefix["prefix_id"], "to": "remote"}).json()
        assert moved["verified_blocks"] == moved["blocks"] == prefix["blocks"]
        assert call(app, "GET", "/admin/prefixes").json()["prefixes"][0]["tier"] == "remote"
        host = call(app, "POST", "/admin/swap", json={"prefix": prefix["prefix_id"], "to": "host"})
        assert host.status_code == 400 and "to: the host tier is not configured" in host.json()["error"]["message"]
        back = call(app, "POST", "/admin/swap", json={"prefix": prefix["prefix_id"], "to": "device"}).json()
        assert back["verified_blocks"] == prefix["blocks"]
        after = _complete(app, TEXT_A)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == prefix["blocks"] * 16
    finally:
        service.shutdown(deadline=2)


def test_without_lower_tiers_the_report_says_so_and_swap_refuses(tmp_path):
    from rich.console import Console

    from kvctl.daemon.server.app import create_app
    from kvctl.tiers_cmd import render_tiers

    service = start_service(tmp_path, num_blocks=64)
    try:
        app = create_app(service, service.metrics, front="unix")
        _complete(app, TEXT_A)
        report = call(app, "GET", "/admin/tiers").json()
        assert report["configured"] is False and report["tiers"] == {} and report["device"]["blocks"] > 0
        console = Console(record=True, width=160)
        render_tiers(report, console)
        text = console.export_text()
        assert "no lower tier configured" in text and "device" in text
        [prefix] = call(app, "GET", "/admin/prefixes").json()["prefixes"]
        refused = call(app, "POST", "/admin/swap", json={"prefix": prefix["prefix_id"], "to": "disk"})
        assert refused.status_code == 409 and "no lower tier is configured" in refused.json()["error"]["message"]
    finally:
        service.shutdown(deadline=2)


def test_kvctl_tiers_watch_redraws_until_stopped_with_the_latest_report():
    from rich.console import Console

    from kvctl.tiers_cmd import render_tiers, tiers_view

    from .watch_frames import watch_frames

    def report(hit: int) -> dict:
        return {"configured": True, "write_policy": "write_back", "tiers": {}, "moved_bytes": {},
                "device": {"used_bytes": 1 << 20, "capacity_bytes": 1 << 24, "blocks": 64},
                "tokens": {"prompt": 1000, "hit": hit, "restored": 0, "recomputed": 0}}

    fetched, shown = watch_frames([report(10), report(640)], tiers_view, width=100)
    assert fetched == 2 and "prompt tokens 1,000: 640 from cache" in shown
    once = Console(record=True, width=100)
    render_tiers(report(640), once)  # `kvctl tiers` prints the same picture once
    assert once.export_text().strip() == shown.strip()


def test_kvctl_tiers_answers_when_restoring_from_a_tier_never_beats_recomputing(tmp_path):
    """A disk slower per token than the prefill (a big model on a GPU, a slow disk) has no
    break-even: /admin/tiers said so with an infinity, which JSON cannot carry (a 500)."""
    from rich.console import Console

    from kvctl.daemon.server.app import create_app
    from kvctl.tiers_cmd import render_tiers

    service = start_service(tmp_path, disk_cache_bytes="16MiB")
    try:
        service.tiers.stats["disk"].read.rate = 10.0  # bytes a second
        response = call(create_app(service, service.metrics, front="unix"), "GET", "/admin/tiers")
        assert response.status_code == 200, response.text
        assert response.json()["break_even_tokens"] == {"disk": None}
        console = Console(record=True, width=120)
        render_tiers(response.json(), console)
        assert "restore beats recompute from: disk never" in console.export_text()
    finally:
        service.shutdown(deadline=2)


def test_kvctl_tiers_json_turns_an_older_kvd_s_infinite_break_even_into_null():
    import json

    from .test_router import _kvctl_prints

    def report() -> dict:
        return {"configured": True, "write_policy": "write_back", "tiers": {}, "moved_bytes": {},
                "device": {"used_bytes": 0, "capacity_bytes": 1 << 24, "blocks": 0},
                "tokens": {"prompt": 0, "hit": 0, "restored": 0, "recomputed": 0},
                "break_even_tokens": {"host": 12.5, "disk": float("inf")}}

    printed = json.loads(_kvctl_prints(["tiers", "--json"], report()))
    assert printed["break_even_tokens"] == {"host": 12.5, "disk": None}
    fleet = {"replicas": [{"replica": "r0", "status": 200, "report": report()}]}
    printed = json.loads(_kvctl_prints(["tiers", "--json"], fleet))
    assert printed["replicas"][0]["report"]["break_even_tokens"] == {"host": 12.5, "disk": None}


def test_a_disk_tier_larger_than_its_filesystem_says_so_at_start_in_its_report_and_in_kvctl_tiers(
        tmp_path, monkeypatch, caplog):
    from rich.console import Console

    from kvctl.daemon.cache.tiers import disk as disk_module
    from kvctl.daemon.server.app import create_app
    from kvctl.tiers_cmd import tiers_view

    monkeypatch.setattr(disk_module, "filesystem_room", lambda path: 3 << 20)  # 3 MiB left for the tier
    with caplog.at_level("WARNING", logger="kvd"):
        service = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB", tiering="always")
    try:
        assert [r.getMessage() for r in caplog.records if "filesystem" in r.getMessage()] == [
            f"disk tier: tiers.disk.bytes is 16.0 MiB but its filesystem ({tmp_path / 'kvcache'}) has room for "
            "3.0 MiB more, keeping some free for other files: the tier holds at most 3.0 MiB"]
        app = create_app(service, service.metrics, front="unix")
        report = call(app, "GET", "/admin/tiers").json()
        disk = report["tiers"]["disk"]
        assert disk["filesystem_bound"] == {"room_bytes": 3 << 20, "holds_at_most_bytes": 3 << 20}
        assert disk["filesystem_evictions"] == 0
        console = Console(width=100, record=True)
        console.print(tiers_view(report))
        text = " ".join(console.export_text().split())
        assert ("disk: its filesystem has room for 3.0 MiB more (some is kept free for other files), so the tier "
                "holds at most 3.0 MiB of its 16.0 MiB") in text
        checks = {c["check"]: c for c in call(app, "GET", "/admin/checks").json()["checks"]}  # kvctl check
        assert checks["tiers"] == {"check": "tiers", "status": "warning", "detail": (
            "disk: its filesystem holds it to 3.0 MiB of its 16.0 MiB (room for 3.0 MiB more); `kvctl tiers` says "
            "more")}
    finally:
        service.shutdown(deadline=5)


def test_the_filesystem_line_of_kvctl_tiers():
    from kvctl.tiers_cmd import filesystem_line

    assert filesystem_line({"capacity_bytes": 1 << 30, "filesystem_bound": None, "filesystem_evictions": 0}) is None
    assert filesystem_line({"capacity_bytes": 1 << 30}) is None  # an older kvd's report
    assert filesystem_line({"capacity_bytes": 1 << 30, "filesystem_bound": None, "filesystem_evictions": 1200}) == (
        "disk: its filesystem ran short of space; 1,200 blocks evicted for the filesystem")
    assert filesystem_line({"capacity_bytes": 1 << 30, "filesystem_evictions": 3,
                            "filesystem_bound": {"room_bytes": 0, "holds_at_most_bytes": 512 << 20}}) == (
        "disk: its filesystem has room for 0 B more (some is kept free for other files), so the tier holds at "
        "most 512.0 MiB of its 1.0 GiB; 3 blocks evicted for the filesystem")


def test_a_prefetch_wait_counts_the_time_held_for_the_fetch_not_the_queue_for_room_after_it(demo, tmp_path):
    """The fetch ends at once, but the request then waits behind a long one for room on the device.
    Its wait for the prefix is the fetch's time; it was counted until admission (`kvctl tiers`
    showed waits of 4.6 s at the p50 under a 2 s timeout)."""
    from kvctl.daemon.engine.sampling import SamplingParams

    now = [0.0]
    engine, tiered = engine_with(demo, clock=lambda: now[0], disk_bytes=1 << 22, disk_path=tmp_path / "d")
    generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()
    long = engine.add_request(demo.tokenizer.encode(TEXT_C * 2)[:130], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()  # it runs, holding most of the 12 blocks until its 40 tokens are out
    warm = engine.add_request(demo.tokenizer.encode(TEXT_A), GREEDY)
    tiered.wait_prefetch(warm.request_id, 10)  # its fetch has ended
    fetched = tiered.prefetches[warm.request_id].seconds()
    steps = 0
    while engine.has_work():
        engine.step()
        now[0] += 1.0  # a second a step
        steps += 1
    engine.cache.audit()
    assert long.metrics.admitted == 0.0 and warm.metrics.admitted >= 30.0  # it waited for room, 30 s and more
    assert warm.metrics.prefetch_outcome == "complete" and warm.metrics.restored_tokens > 0
    assert list(engine.stats.prefetch_waits) == [fetched]  # the fetch's own time, not the 30 s and more queued


def test_a_prefix_evicted_while_its_request_queued_is_fetched_at_its_turn_not_recomputed(demo, tmp_path):
    """When it came, the device held its prefix, so nothing was fetched; a long request admitted
    before it then took the device. At its turn the prefix is fetched from disk (written through)
    and restored: it was recomputed, and under more prefixes than the device holds, every one was
    (hit tokens 0 of 101,376 in-process at 8 prefixes of 1,024 tokens on 128 blocks; now 90,112)."""
    from kvctl.daemon.engine.sampling import SamplingParams

    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d", write_policy="write_through")
    cold = generate(engine, TEXT_A, demo)
    tiered.flush()
    prompt = demo.tokenizer.encode(TEXT_A)
    blocks = (len(prompt) - 1) // 16
    keys = engine.prefix_keys("default", prompt)[2]
    assert len(engine.cache.pool.match(keys, blocks)) == blocks and all(k in tiered.disk.index for k in keys[:blocks])
    long = engine.add_request(demo.tokenizer.encode(TEXT_C * 2)[:130], SamplingParams(max_tokens=40, ignore_eos=True))
    warm = engine.add_request(prompt, GREEDY)
    assert warm.metrics.prefetch_started is None  # all on the device as it came
    engine.step()  # the long one is admitted and takes the device: most of the prefix is evicted
    left = len(engine.cache.pool.match(keys, blocks))
    assert long.metrics.admitted is not None and left < blocks - 2
    engine.run_until_done()
    engine.cache.audit()
    assert warm.metrics.prefetch_outcome == "complete" and warm.metrics.cached_tokens == blocks * 16
    assert (blocks - left) * 16 <= warm.metrics.restored_tokens <= blocks * 16
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids
    assert tiered.staged == {} and tiered.prefetches == {}


def test_a_second_fetch_for_a_request_keeps_what_its_first_staged_and_waits_for_it_to_end(demo, tmp_path):
    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d")
    generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    tiered.flush()
    keys = engine.prefix_keys("default", demo.tokenizer.encode(TEXT_A))[2][:6]
    assert all(k in tiered.disk.index for k in keys)
    entered, release = threading.Event(), threading.Event()
    real_read = tiered.disk._read_range

    def held_read(*where):
        entered.set()
        release.wait(10)
        return real_read(*where)

    tiered.disk._read_range = held_read
    assert tiered.start_prefetch("r", keys[3:])
    assert entered.wait(10)
    assert not tiered.start_prefetch("r", keys[:3])  # one fetch at a time for a request
    release.set()
    tiered.wait_prefetch("r", 10)
    tiered.disk._read_range = real_read
    assert sorted(tiered.prefetches["r"].staged) == sorted(keys[3:])
    assert tiered.start_prefetch("r", keys[:3])  # the front, lost from the device meanwhile
    tiered.wait_prefetch("r", 10)
    assert sorted(tiered.prefetches["r"].staged) == sorted(keys) and sorted(tiered.staged) == sorted(keys)
    assert tiered.available_run(keys) == (6, 6 * tiered.layout.block_bytes)
    tiered.finish_prefetch("r")
    assert tiered.staged == {} and tiered.prefetches == {}


def test_redis_lookups_that_find_nothing_measure_its_latency_and_reads_its_bandwidth_net_of_it(demo, redis_server):
    engine, tiered = engine_with(demo, remote_url=redis_server.url, write_policy="write_through")
    meter = tiered.stats["remote"].read
    cold = generate(engine, TEXT_A, demo)  # a new prompt: Redis is asked and has nothing
    assert cold.metrics.prefetch_outcome == "miss"
    assert (meter.latency_samples, meter.samples) == (1, 0) and meter.latency > 0
    tiered.flush()
    push_out(engine, demo)
    latency = meter.latency
    warm = generate(engine, TEXT_A, demo)
    assert warm.metrics.prefetch_outcome == "complete" and warm.metrics.restored_tokens > 0
    assert warm.metrics.restored_tokens <= warm.metrics.cached_tokens
    assert meter.samples == 1 and meter.latency == latency  # the read that brought blocks: bandwidth only


def test_a_lost_prefix_judged_not_worth_fetching_is_judged_once_not_at_every_pass_while_it_waits(demo, tmp_path):
    """A fetch of it is judged when it reaches its turn; judging again at every engine step while it
    waits at the head of the queue would redo the work of a decision already made."""
    from kvctl.daemon.engine.sampling import SamplingParams

    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d", write_policy="write_through")
    generate(engine, TEXT_A, demo)
    tiered.flush()
    judged = []
    tiered.policy.should_fetch = lambda tokens, nbytes, read, now: judged.append(tokens) or False
    engine.add_request(demo.tokenizer.encode(TEXT_C * 2)[:130], SamplingParams(max_tokens=40, ignore_eos=True))
    warm = engine.add_request(demo.tokenizer.encode(TEXT_A), GREEDY)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    engine.cache.audit()
    assert steps > 30 and judged == [80]  # at its first pass after the long request took the device
    assert warm.metrics.prefetch_started is None and warm.metrics.restored_tokens == 0


def test_a_prefix_only_redis_holds_is_judged_at_redis_s_rate_even_beside_a_disk(demo, tmp_path, redis_server):
    """Another daemon wrote it to the shared Redis; this one's disk is empty and slow. The fetch was
    judged at the disk's rate whenever a disk existed, so it was never made."""
    from kvctl.daemon.cache.tiers import build_tiers
    from kvctl.daemon.engine.engine import Engine, EngineSettings
    from kvctl.policies.tiering import MEASURED_READS, RateMeter

    writer, written = engine_with(demo, remote_url=redis_server.url, write_policy="write_through")
    cold = generate(writer, TEXT_A, demo)
    written.flush()
    engine = Engine(demo, EngineSettings(num_blocks=12, block_size=16))
    tiered, _ = build_tiers(engine, remote_url=redis_server.url, disk_bytes=1 << 22, disk_path=tmp_path / "d",
                            tiering="measured")
    tiered.stats["disk"].read = RateMeter(rate=1.0, samples=MEASURED_READS)  # a byte a second
    tiered.stats["remote"].read = RateMeter(rate=1e12, samples=MEASURED_READS)
    warm = generate(engine, TEXT_A, demo)
    assert warm.metrics.prefetch_outcome == "complete" and warm.metrics.restored_tokens > 0
    assert tiered.stats["remote"].restored_blocks == warm.metrics.restored_tokens // 16
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids


def test_evictions_refused_at_a_write_rate_measured_once_are_still_written_while_it_learns(demo, tmp_path):
    """A first write of two blocks measured the disk at 78 MB/s (mostly the write's own overhead),
    `worth_keeping` then refused every eviction, and nothing was written again to correct it: a kvd
    with a pin under load kept 2 blocks on disk of 1,612 evicted. Now a refused eviction is written
    down while the write rate has fewer than MEASURED_READS readings, and once that rate is
    PROBE_AFTER_S old; in between the judgement stands."""
    from kvctl.policies.tiering import MEASURED_READS, PROBE_AFTER_S

    engine, tiered = engine_with(demo, disk_bytes=1 << 22, disk_path=tmp_path / "d")
    tiered.policy.mode = "measured"
    now = [100.0]
    tiered.clock = lambda: now[0]
    write = tiered.stats["disk"].write

    def slow_disk(samples: int) -> None:  # a byte a second: no block is worth keeping at this rate
        write.rate, write.samples, write.measured_at = 1.0, samples, now[0]

    def on_disk_after(*texts) -> int:
        for text in texts:
            generate(engine, text, demo)
        tiered.flush()
        return len(tiered.disk.index)

    slow_disk(samples=0)
    learnt = on_disk_after(TEXT_A, TEXT_B, TEXT_C)
    assert learnt > 0 and write.samples >= 1  # refused by the judgement, written to measure the disk
    slow_disk(samples=MEASURED_READS)
    # new prompts (new keys all through), so that what is evicted is nowhere on disk yet
    assert on_disk_after("Second round. " + TEXT_A, "Second round. " + TEXT_B) == learnt  # measured, fresh: it stands
    now[0] += PROBE_AFTER_S
    probed = on_disk_after("Third round. " + TEXT_C, "Third round. " + TEXT_A)
    # the probe measured the disk again, at its real rate; once the writer thread has landed it
    # (before the second prompt's evictions or after: thread timing), those are judged by that
    # rate and written too, a reading each
    assert probed > learnt and write.samples >= MEASURED_READS + 1 and write.rate > 1.0
    assert write.measured_at == now[0]


def test_a_shutdown_saves_every_cached_block_whatever_the_write_rate_says(tmp_path):
    """At shutdown nothing is judged against serving: the device's cached blocks all go to disk
    (before, the eviction-time judgement applied, and a kvd whose disk rate was measured low saved
    0 of its 95 cached blocks)."""
    from kvctl.daemon.server.app import create_app
    from kvctl.daemon.server.tier_ops import save_on_shutdown

    service = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB")
    app = create_app(service, service.metrics, front="unix")
    _complete(app, TEXT_A)
    _complete(app, TEXT_B)
    write = service.tiers.stats["disk"].write
    write.rate, write.samples, write.measured_at = 1.0, 10, service.tiers.clock()  # far too slow to be worth it
    cached = sum(1 for b in service.engine.cache.pool.blocks if b.key is not None)
    saved = save_on_shutdown(service, deadline=time.monotonic() + 30)
    assert cached > 0 and saved["saved_blocks"] == saved["candidates"] == cached
    assert len(service.tiers.disk.index) == cached
    service.shutdown(deadline=2)


def test_a_shutdowns_save_waits_for_the_engines_lock_until_its_deadline_only(tmp_path, caplog):
    """A step that holds the engine's lock past the stop's deadline (or never ends) held the save,
    and the stop, until it ended: the save now gives the device's blocks up at its deadline."""
    from kvctl.daemon.server.app import create_app
    from kvctl.daemon.server.tier_ops import save_on_shutdown

    service = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB")
    app = create_app(service, service.metrics, front="unix")
    _complete(app, TEXT_A)
    with a_long_step(service), caplog.at_level(logging.WARNING, logger="kvd"):
        began = time.monotonic()
        saved = save_on_shutdown(service, deadline=time.monotonic() + 0.5)
        took = time.monotonic() - began
    assert 0.5 <= took < 2 and (saved["saved_blocks"], saved["candidates"]) == (0, 0)
    assert len(service.tiers.disk.index) == 0
    assert ("the device's cached blocks are not saved to disk: the engine held its lock past the stop's deadline "
            "(a step still running)") in caplog.messages
    service.tiers = None  # (closed by the save, as a stop's own closes them: the stop below saves nothing again)
    service.shutdown(deadline=2)


def test_tier_settings_that_cannot_be_met_are_named(demo, tmp_path):
    """A host tier larger than the host, a disk folder that cannot be made: the error names the
    setting (it was torch's allocator message, or a bare errno)."""
    from kvctl.daemon.cache.tiers import build_tiers

    engine, _ = engine_with(demo)
    with pytest.raises(ValueError, match=r"^tiers\.host\.bytes: 1,125,899,906,842,624 bytes cannot be allocated "
                                         r"on this host \("):
        build_tiers(engine, host_bytes=2**50)
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(ValueError) as refused:
        build_tiers(engine, disk_bytes=1 << 22, disk_path=tmp_path / "a-file" / "kvcache")
    assert str(refused.value) == (f"tiers.disk.path: cannot use {str(tmp_path / 'a-file' / 'kvcache')!r} for the "
                                  "disk tier (Not a directory)")


@pytest.mark.parametrize("lands", ["before_the_restore", "before_the_copy"])
def test_a_prefix_an_operator_evicts_while_a_restore_of_it_is_planned_is_recomputed_not_a_failed_step(
        demo, monkeypatch, lands):
    """kvd's eviction drops lower-tier copies outside the engine's lock (it must not stall serving),
    so it can land between the engine finding a prefix in host memory and copying it back. That
    step raised KeyError and cancelled every request in flight (found by scripts/fleet-soak). Now
    the restore takes what is still there: the blocks before the first one evicted (its tail
    evicted as the restore starts), or nothing (all of it evicted as the copy starts, after the
    device blocks were allocated: they go back). The request computes the rest, tokens unchanged."""
    from kvctl.daemon.cache.keys import PrefixHasher

    engine, tiered = engine_with(demo, host_bytes=1 << 20)
    cold = generate(engine, TEXT_A, demo)
    push_out(engine, demo)
    keys = PrefixHasher(engine.namespace("default")).feed(demo.tokenizer.encode(TEXT_A))
    blocks = (len(demo.tokenizer.encode(TEXT_A)) - 1) // 16
    assert engine.cache.lookup(keys) == 0 and all(k in tiered.host.index for k in keys[:blocks])
    evicted = keys[blocks - 2:blocks] if lands == "before_the_restore" else keys[:blocks]
    name = "restore_into" if lands == "before_the_restore" else "load_into"
    step = getattr(tiered, name)

    def evicted_first(*args):  # the operator's eviction, from another thread, lands here
        assert tiered.drop(evicted) == len(evicted)
        monkeypatch.setattr(tiered, name, step)  # once
        return step(*args)

    monkeypatch.setattr(tiered, name, evicted_first)
    free_before = engine.cache.pool.available()
    warm = generate(engine, TEXT_A, demo)  # audits the cache: no block leaked or left half-installed
    restored = (blocks - 2) * 16 if lands == "before_the_restore" else 0
    assert warm.sequences[0].output_ids == cold.sequences[0].output_ids
    assert (warm.metrics.cached_tokens, warm.metrics.restored_tokens) == (restored, restored)
    assert tiered.report()["tiers"]["host"]["restored_blocks"] == restored // 16
    assert engine.cache.pool.available() == free_before  # A's blocks are cached again, as after a cold run


def test_a_request_asking_24h_retention_is_written_to_disk_as_it_finishes(tmp_path):
    """OpenAI's `prompt_cache_retention: "24h"`: under write_back (nothing goes down until evicted)
    such a request's blocks, its prompt's and its reply's, are written to the disk tier as it
    finishes, so the conversation outlives the device cache; "in_memory" (the default) leaves them
    to the write policy. A bad value is a 400 naming the field."""
    from dataclasses import replace

    from kvctl.daemon.server.app import create_app

    # (tiering "always": the next turn restores from disk whatever the rates measured say)
    service = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB", tiering="always")
    try:
        app = create_app(service, service.metrics, front="unix")
        disk = service.tiers.disk

        def chat(topic: str, **extra):
            answer = call(app, "POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"Tell me about {topic}, at length. " * 6}],
                "max_tokens": 20, "ignore_eos": True, "temperature": 0, **extra})
            assert answer.status_code == 200, answer.text
            assert service.tiers.flush(10)
            return answer.json()

        chat("the host tier", prompt_cache_retention="in_memory")
        chat("the device tier")
        assert len(disk.index) == 0 and call(app, "GET", "/admin/tiers").json()["retained_blocks"] == 0
        kept = chat("the disk tier", prompt_cache_retention="24h")
        written = (kept["usage"]["prompt_tokens"] + 20 - 1) // 16  # every whole block: prompt and reply
        assert len(disk.index) == written and call(app, "GET", "/admin/tiers").json()["retained_blocks"] == written
        assert f"kvd_tier_retained_blocks_total {float(written)}" in call(app, "GET", "/metrics").text
        # the device lets it go; the next turn finds its prompt and its reply on disk
        with service.engine_lock():
            service.engine.cache.release_all()
        assert service.tiers.flush(10)
        again = call(app, "POST", "/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "Tell me about the disk tier, at length. " * 6},
            {"role": "assistant", "content": kept["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And then?"}], "max_tokens": 1}).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == written * 16
        # through /v1/responses too, echoed back in the response
        answer = call(app, "POST", "/v1/responses", json={"input": "Tell me about Redis, at length. " * 6,
                                                          "max_output_tokens": 4, "prompt_cache_retention": "24h"})
        assert answer.json()["prompt_cache_retention"] == "24h" and service.tiers.flush(10)
        assert len(disk.index) > written
        refused = call(app, "POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "prompt_cache_retention": "forever"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_cache_retention"
        assert refused.json()["error"]["message"] == "prompt_cache_retention: must be in_memory or 24h, got 'forever'"
        # the operator's `prompt_cache_retention: ignore` (live on a reload): "24h" is served as "in_memory"
        service.config = replace(service.config, prompt_cache_retention="ignore")
        held = len(disk.index)
        chat("the remote tier", prompt_cache_retention="24h")
        assert len(disk.index) == held and call(app, "GET", "/admin/tiers").json()["retained_blocks"] > written
    finally:
        service.shutdown(deadline=2)


def test_a_tenant_s_own_prompt_cache_retention_decides_whether_its_24h_is_written_down(tmp_path):
    """`tenant_prompt_cache_retention` over `prompt_cache_retention: ignore`: only the tenant named
    `honour` has its "24h" requests written to disk; `kvctl tenants` and the metrics say whose
    requests wrote how many blocks; a reload that names it `ignore` stops its writes."""
    from dataclasses import replace

    from rich.console import Console

    from kvctl.daemon.engine.tenant_book import RETAINED
    from kvctl.daemon.server.app import create_app
    from kvctl.requests_cmd import render_tenants

    service = start_service(tmp_path, num_blocks=64, disk_cache_bytes="16MiB", prompt_cache_retention="ignore",
                            tenant_prompt_cache_retention="agents=honour")
    try:
        app = create_app(service, service.metrics, front="unix")
        disk = service.tiers.disk

        def chat(tenant: str, topic: str) -> dict:
            answer = call(app, "POST", "/v1/chat/completions", headers={"X-KVD-Tenant": tenant}, json={
                "messages": [{"role": "user", "content": f"Tell me about {topic}, at length. " * 6}],
                "max_tokens": 20, "ignore_eos": True, "temperature": 0, "prompt_cache_retention": "24h"})
            assert answer.status_code == 200, answer.text
            assert service.tiers.flush(10)
            return answer.json()

        chat("acme", "the host tier")
        assert len(disk.index) == 0  # kvd's own setting: ignore
        kept = chat("agents", "the disk tier")
        written = (kept["usage"]["prompt_tokens"] + 20 - 1) // 16  # every whole block: prompt and reply
        assert written > 0 and len(disk.index) == written
        rows = {row["tenant"]: row for row in call(app, "GET", "/admin/tenants").json()["tenants"]}
        assert (rows["agents"]["retained_blocks"], rows["acme"]["retained_blocks"]) == (written, 0)
        metrics = call(app, "GET", "/metrics").text
        assert f'kvd_tenant_retained_blocks_total{{tenant="agents"}} {float(written)}' in metrics
        assert 'kvd_tenant_retained_blocks_total{tenant="acme"} 0.0' in metrics
        shown = Console(width=200, record=True)
        shown.print(render_tenants(call(app, "GET", "/admin/tenants").json()))
        assert f"written to disk and Redis for prompt_cache_retention 24h: agents {written:,} blocks" in \
            shown.export_text()
        # live on a reload: named ignore, its "24h" is served as "in_memory"
        service.reload(replace(service.config, tenant_prompt_cache_retention=(("agents", "ignore"),)), actor="test")
        chat("agents", "the remote tier")
        assert len(disk.index) == written
        assert service.engine.stats.tenants.totals()[RETAINED] == written  # (kvd's every tenant)
    finally:
        service.shutdown(deadline=2)
