"""Block payloads and the disk tier: round trips for every cache dtype, every way a payload can be
wrong, durable publication, re-indexing at start, kill -9 during writes, disk full."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from kvctl.daemon.cache.tiers import BlockLayout, BlockMeta, DiskTier, PayloadError, decode_block, encode_blocks  # noqa: E402

from .tier_fixtures import block_key, content, group, same  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
SPACE = b"S" * 32


def layout(dtype=torch.float16, scales="cal-1") -> BlockLayout:
    return BlockLayout((dtype, torch.float16), block_size=16, num_kv_heads=2, head_dim=8, scale_version=scales)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_payload_round_trip_is_bit_exact_for_every_cache_dtype(dtype):
    lay = layout(dtype)
    keys = [block_key(i) for i in range(3)]
    metas, layers = group(lay, keys)
    payloads = encode_blocks(lay, SPACE, metas, layers)
    assert [len(p) for p in payloads] == [lay.payload_bytes] * 3
    for key, payload in zip(keys, payloads):
        decoded = decode_block(payload, lay, SPACE, key)
        assert [(k.dtype, tuple(k.shape)) for k, _ in decoded] == [(dtype, (16, 2, 8)), (torch.float16, (16, 2, 8))]
        assert same(decoded, content(lay, key))


def _one(lay=None):
    lay = lay or layout()
    metas, layers = group(lay, [block_key(0)])
    return lay, encode_blocks(lay, SPACE, metas, layers)[0]


@pytest.mark.parametrize("mutate, reason", [
    (lambda p: p[:100] + bytes([p[100] ^ 1]) + p[101:], "checksum"),  # a flipped bit in the tensors
    (lambda p: p[:-1] + bytes([p[-1] ^ 0xFF]), "checksum"),  # the checksum itself
    (lambda p: p[:len(p) // 2], "length"),  # truncated
    (lambda p: b"XXXX" + p[4:], "magic"),
    (lambda p: p[:4] + (9).to_bytes(2, "little") + p[6:], "version"),
])
def test_damaged_payloads_are_refused_with_the_failed_check(mutate, reason):
    lay, payload = _one()
    with pytest.raises(PayloadError) as err:
        decode_block(mutate(payload), lay, SPACE, block_key(0))
    assert err.value.reason == reason


def test_a_payload_header_carries_the_block_s_place_in_its_chain():
    """Root, depth and parent come back from the header alone: a lower tier can rebuild the
    prefix tree (what `kvctl prefixes` shows) after a restart without reading any K/V."""
    from kvctl.daemon.cache.tiers.payload import read_header

    lay = layout()
    keys = [block_key(i) for i in range(3)]
    metas, layers = group(lay, keys)
    for meta, payload in zip(metas, encode_blocks(lay, SPACE, metas, layers)):
        got, space, total = read_header(payload)
        assert (got, space, total) == (meta, SPACE, len(payload))
    assert [m.parent for m in metas] == [None, keys[0], keys[1]]
    owned = [BlockMeta(m.key, m.root, m.depth, m.parent, "acme.prod-1") for m in metas]
    payload = encode_blocks(lay, SPACE, owned, layers)[2]
    assert read_header(payload)[0].tenant == "acme.prod-1" and len(payload) == lay.payload_bytes
    assert same(decode_block(payload, lay, SPACE, keys[2]), content(lay, keys[2]))
    with pytest.raises(ValueError, match="tenant: expected 1 to 64 ASCII characters"):
        BlockMeta(keys[0], keys[0], 0, None, "x" * 65)


def test_a_payload_of_the_previous_format_is_refused_as_another_version():
    """Formats 2 and 3 had no tenant (2 no parent key either); their payloads are refused (a
    counted miss, set aside on disk), never misread."""
    import struct

    lay, payload = _one()
    for version in (2, 3):
        old = payload[:4] + struct.pack("<H", version) + payload[6:]
        with pytest.raises(PayloadError) as err:
            decode_block(old, lay, SPACE, block_key(0))
        assert (err.value.reason, str(err.value)) == ("version", f"version: format version {version}, this kvd reads 4 and 5")


def test_payloads_of_another_block_space_or_layout_are_refused():
    lay, payload = _one()
    with pytest.raises(PayloadError) as err:
        decode_block(payload, lay, SPACE, block_key(1))
    assert err.value.reason == "key"
    with pytest.raises(PayloadError) as err:
        decode_block(payload, lay, b"T" * 32, block_key(0))
    assert err.value.reason == "space"
    for other in (layout(torch.int8), layout(scales="cal-2"),
                  BlockLayout((torch.float16, torch.float16), 16, 1, 16, "cal-1")):
        with pytest.raises(PayloadError) as err:
            decode_block(payload, other, SPACE, block_key(0))
        assert err.value.reason == "layout"


def disk(tmp_path, lay=None, capacity=1 << 20, space=SPACE) -> DiskTier:
    return DiskTier(tmp_path / "kvcache", capacity, lay or layout(), space)


def write_chain(tier: DiskTier, start: int, count: int) -> list[bytes]:
    keys = [block_key(i) for i in range(start, start + count)]
    metas, layers = group(tier.layout, keys)
    tier.write_group(list(zip(metas, encode_blocks(tier.layout, tier.space, metas, layers))))
    return keys


def test_disk_segments_are_published_whole_and_reindexed_after_a_restart(tmp_path):
    first = disk(tmp_path)
    keys = write_chain(first, 0, 4) + write_chain(first, 10, 2)
    assert sorted(first.index) == sorted(keys)
    assert not list(first.segment_dir.glob("*.tmp"))
    with pytest.raises(ValueError) as busy:  # one daemon per disk folder
        disk(tmp_path)
    assert str(busy.value) == (f"tiers.disk.path: {str(tmp_path / 'kvcache')!r} is in use by another kvd "
                               f"(pid {os.getpid()}); give each daemon a disk tier of its own (daemons share "
                               "blocks through a remote tier)")
    first.close()  # the daemon stops
    again = disk(tmp_path)
    report = again.scan()
    assert (report.segments, report.blocks, report.corrupt, report.foreign, report.torn) == (2, 6, 0, 0, 0)
    for key in keys:
        assert same(decode_block(again.read(key), again.layout, SPACE, key), content(again.layout, key))
    assert again.meta[keys[3]].depth == 3 and again.meta[keys[3]].root == keys[0]


def test_damaged_truncated_foreign_and_unfinished_files_are_set_aside_and_counted(tmp_path):
    tier = disk(tmp_path)
    good = write_chain(tier, 0, 2)
    write_chain(tier, 10, 2)
    write_chain(tier, 20, 2)
    names = sorted(p.name for p in tier.segment_dir.glob("*.kvseg"))
    seg_of = {key: tier.index[key][0] for key in tier.index}
    damaged = tier.segment_dir / seg_of[block_key(10)]
    data = bytearray(damaged.read_bytes())
    data[tier.index[block_key(11)][1]] ^= 0x40  # the second payload's magic
    damaged.write_bytes(bytes(data))
    truncated = tier.segment_dir / seg_of[block_key(20)]
    truncated.write_bytes(truncated.read_bytes()[:-7])
    foreign = disk(tmp_path / "other", space=b"F" * 32)
    write_chain(foreign, 30, 1)
    for path in foreign.segment_dir.glob("*.kvseg"):
        os.replace(path, tier.segment_dir / path.name)
    (tier.segment_dir / "half-written.tmp").write_bytes(b"KVB1 torn")
    tier.close()
    again = disk(tmp_path)
    report = again.scan()
    assert (report.segments, report.blocks, report.corrupt, report.foreign, report.torn) == (1, 2, 2, 1, 1)
    assert sorted(again.index) == sorted(good)
    assert len(list((again.quarantine / "corrupt").iterdir())) == 2
    assert len(list((again.quarantine / "foreign").iterdir())) == 1
    assert len(names) == 3


def test_the_start_scan_reads_headers_only_and_a_damaged_body_fails_its_checksum_when_read(tmp_path):
    """A flipped bit in a body is not looked for at start (that read every byte of the tier before
    kvd served); the block is indexed, and the checksum refuses it when it is read."""
    tier = disk(tmp_path)
    keys = write_chain(tier, 0, 3)
    name, offset, length = tier.index[keys[1]]
    path = tier.segment_dir / name
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x01
    path.write_bytes(bytes(data))
    tier.close()
    again = disk(tmp_path)
    report = again.scan()
    assert (report.segments, report.blocks, report.corrupt, report.foreign) == (1, 3, 0, 0)
    for key in (keys[0], keys[2]):
        assert same(decode_block(again.read(key), again.layout, SPACE, key), content(again.layout, key))
    with pytest.raises(PayloadError) as err:
        decode_block(again.read(keys[1]), again.layout, SPACE, keys[1])
    assert err.value.reason == "checksum"


def test_small_payloads_segments_are_checked_in_order_reading_ahead_and_leave_no_file_open(tmp_path, monkeypatch):
    """The start scan of small payloads reads one segment after another while the next ones are
    opened and asked of the disk; each result lands with its own path, one that cannot be read
    says why, and a scan stopped early closes what it had opened ahead."""
    import kvctl.daemon.cache.tiers.disk as disk_module

    monkeypatch.setattr(disk_module, "READ_AHEAD", 2)
    tier = disk(tmp_path)
    chains = [write_chain(tier, 10 * i, i + 1) for i in range(5)]
    paths = [tier.segment_dir / tier.index[chain[0]][0] for chain in chains]
    unreadable = tier.segment_dir / "not-a-file.kvseg"
    unreadable.mkdir()
    paths.insert(2, unreadable)
    open_fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    before = open_fds()
    results = list(tier._check_segments(paths))
    assert open_fds() == before
    assert isinstance(results[2], OSError)
    found = [r for i, r in enumerate(results) if i != 2]
    for chain, (size, metas) in zip(chains, found):
        assert [meta.key for meta, _, _ in metas] == chain and size == len(chain) * tier.layout.payload_bytes
    walk = tier._check_segments(paths)
    next(walk)
    assert open_fds() == before + 2  # the two read ahead
    walk.close()
    assert open_fds() == before


def test_a_tier_s_index_of_chain_positions_is_not_walked_by_python_s_collector(tmp_path):
    """MetaBook holds each BlockMeta as a plain tuple: the collector untracks it once seen, so a
    tier of a million blocks adds nothing to a whole-heap collection (a BlockMeta added 133 ns)."""
    import gc

    from kvctl.daemon.cache.tiers.payload import MetaBook

    book = MetaBook()
    metas = [BlockMeta(block_key(0), block_key(0), 0, None, "acme", hits=3, last_use=12.5),
             BlockMeta(block_key(1), block_key(0), 1, block_key(0), None)]
    for meta in metas:
        book[meta.key] = meta
    assert len(book) == 2 and block_key(1) in book and list(book) == [block_key(0), block_key(1)]
    assert book[block_key(0)] == metas[0] and book[block_key(0)].hits == 3 and book[block_key(0)].last_use == 12.5
    assert book.get(block_key(1)) == metas[1] and book.get(block_key(2)) is None
    gc.collect()
    assert not any(gc.is_tracked(row) for row in book._rows.values())
    assert book.pop(block_key(0)) == metas[0] and book.pop(block_key(0), None) is None and len(book) == 1
    with pytest.raises(KeyError):
        book[block_key(0)]
    tier = disk(tmp_path)  # a disk tier's index and its segments' keys: one tracked object a segment
    keys = write_chain(tier, 0, 3)
    gc.collect()
    [segment] = tier.segments.values()
    assert segment.keys == tuple(keys) and not gc.is_tracked(segment.keys)
    assert not any(gc.is_tracked(row) for row in tier.meta._rows.values())


def _header_offsets(lay):
    """Offsets in a header of this layout: (dtype codes, scale version length, body length)."""
    codes = 218
    scale_len = codes + lay.num_layers
    return codes, scale_len, scale_len + 2 + len(lay.scale_version.encode())


@pytest.mark.parametrize("dtype, codec", [(torch.float16, "none"), (torch.float16, "int8"),
                                          (torch.bfloat16, "fp8_e4m3"), (torch.int8, "none")], ids=str)
def test_the_scan_s_fast_header_check_accepts_what_check_header_accepts_and_no_more(dtype, codec):
    """The start scan compares a layout's fixed header bytes whole (HeaderScanner); it must agree
    with check_header on every good payload, and hand every damaged one to check_header, which
    names the failed check."""
    from kvctl.daemon.cache.tiers.payload import HeaderScanner, check_header, encode_parts

    lay = BlockLayout((dtype, dtype), block_size=16, num_kv_heads=2, head_dim=8, scale_version="cal-1")
    keys = [block_key(i) for i in range(3)]
    metas, layers = group(lay, keys)
    metas = [BlockMeta(m.key, m.root, m.depth, m.parent, "acme" if m.depth == 1 else None) for m in metas]
    payloads = [b"".join(parts) for parts in encode_parts(lay, SPACE, metas, layers, codec)]
    scanner = HeaderScanner(lay, SPACE)
    for meta, payload in zip(metas, payloads):
        expected, _, _, total = check_header(payload, lay, SPACE)
        assert expected == meta and total == len(payload)
        assert scanner.check(payload) == (meta, total)
        assert scanner.check(memoryview(payload)[:4096]) == (meta, total)  # what the scan reads of it

    codes, scale_len, body_len = _header_offsets(lay)
    if codec != "none":
        body_len += 1  # the codec byte

    def at(offset, value):
        return lambda p: p[:offset] + value + p[offset + len(value):]

    root, child = payloads[0], payloads[1]
    damaged = {
        "magic": at(0, b"XXXX")(root), "version": at(4, (9).to_bytes(2, "little"))(root),
        "header length": at(6, (999).to_bytes(2, "little"))(root), "space": at(40, b"T" * 32)(root),
        "block size": at(204, (32).to_bytes(4, "little"))(root), "heads": at(208, (4).to_bytes(4, "little"))(root),
        "head dim": at(212, (16).to_bytes(4, "little"))(root), "layers": at(216, (3).to_bytes(2, "little"))(root),
        "dtype code": at(codes, bytes([6 if dtype != torch.float8_e5m2 else 5]))(root),
        "scale version": at(scale_len + 2, b"X")(root), "body length": at(body_len, (1).to_bytes(8, "little"))(root),
        "a root with a parent": at(104, b"P" * 32)(root), "a tenant not ASCII": at(136, b"\xff")(child),
        "cut inside the header": root[:body_len],
    }
    if codec != "none":
        damaged["codec byte"] = at(body_len - 1, bytes([3]))(root)
    for what, payload in damaged.items():
        assert scanner.check(payload) is None, what
        with pytest.raises(PayloadError):
            check_header(payload, lay, SPACE)


@pytest.mark.parametrize("whole", [True, False], ids=["read-whole", "headers-only"])
def test_the_start_scan_sees_every_header_damage_the_full_check_saw(tmp_path, whole, monkeypatch):
    """Both ways of reading a segment at start (whole, for small payloads; a header at a time, for
    large ones) set aside the same damage: a header cut short, a payload cut short, a wrong layout."""
    import kvctl.daemon.cache.tiers.disk as disk_module

    lay = layout()
    monkeypatch.setattr(disk_module, "READ_WHOLE_BELOW", lay.payload_bytes + (1 if whole else 0))
    tier = disk(tmp_path, lay)
    chains = [write_chain(tier, 10 * i, 2) for i in range(4)]
    path_of = [tier.segment_dir / tier.index[chain[0]][0] for chain in chains]
    second = tier.index[chains[0][1]][1]
    path_of[0].write_bytes(path_of[0].read_bytes()[:second + 100])  # the second header cut short
    path_of[1].write_bytes(path_of[1].read_bytes()[:-1])  # the last payload cut short
    data = bytearray(path_of[2].read_bytes())
    data[204] = 32  # the first payload's block size: another layout's
    path_of[2].write_bytes(bytes(data))
    tier.close()
    again = disk(tmp_path, lay)
    report = again.scan()
    assert (report.segments, report.blocks, report.corrupt, report.foreign) == (1, 2, 2, 1)
    assert sorted(again.index) == sorted(chains[3])


def test_what_an_upgrade_sets_aside_counts_against_the_disk_and_goes_before_live_segments(tmp_path):
    """A new model sets the old one's segments aside; they are kept while there is room (and come
    back on a rollback), go oldest first before any live segment, and the folder stays within
    its bytes throughout."""
    per = layout().payload_bytes
    old_space, new_space = b"O" * 32, b"N" * 32

    def folder_bytes():
        return sum(f.stat().st_size for f in (tmp_path / "kvcache").rglob("*") if f.is_file() and f.suffix != ".lock")

    before = disk(tmp_path, capacity=6 * per, space=old_space)
    a, b = write_chain(before, 0, 2), write_chain(before, 10, 2)
    before.close()

    upgraded = disk(tmp_path, capacity=6 * per, space=new_space)
    report = upgraded.scan()
    assert (report.foreign, report.readmitted, report.quarantine_dropped) == (2, 0, 0)
    assert upgraded.index == {} and upgraded.quarantine_bytes == 4 * per
    upgraded.make_room(2 * per)
    c = write_chain(upgraded, 20, 2)  # fits beside both set-aside segments
    assert upgraded.quarantine_bytes == 4 * per and folder_bytes() == 6 * per
    upgraded.make_room(2 * per)  # the oldest set-aside segment (a's) goes, not c
    d = write_chain(upgraded, 30, 2)
    assert sorted(upgraded.index) == sorted(c + d) and upgraded.quarantine_bytes == 2 * per
    assert folder_bytes() == 6 * per
    upgraded.close()

    rolled_back = disk(tmp_path, capacity=6 * per, space=old_space)
    verified = []
    check = rolled_back._check_headers
    rolled_back._check_headers = lambda read, size: verified.append(size) or check(read, size)
    report = rolled_back.scan()  # b comes back; c and d are now the foreign ones
    assert len(verified) == 3  # b's headers (once, as it comes back), then c's and d's
    assert (report.readmitted, report.foreign, report.segments, report.quarantine_dropped) == (1, 2, 1, 0)
    assert sorted(rolled_back.index) == sorted(b) and not set(a) & set(rolled_back.index)
    for key in b:
        assert same(decode_block(rolled_back.read(key), rolled_back.layout, old_space, key),
                    content(rolled_back.layout, key))
    rolled_back.close()

    smaller = disk(tmp_path, capacity=3 * per, space=old_space)
    report = smaller.scan()  # the tier shrank: what is set aside goes first, oldest first
    assert (report.segments, report.quarantine_dropped) == (1, 2) and smaller.quarantine_bytes == 0
    assert sorted(smaller.index) == sorted(b) and folder_bytes() == 2 * per


def test_purging_spaces_takes_their_set_aside_and_indexed_segments_and_nothing_of_the_served_one(tmp_path):
    """The folder's book names each space it served. Evicting spaces no longer served deletes
    what an upgrade set aside under them and what is still indexed under older scales (applied
    live); the served space's segments, and what other spaces set aside, stay."""
    from kvctl.daemon.cache.events import EventLog

    old, scaled, new, other = b"O" * 32, b"C" * 32, b"N" * 32, b"X" * 32
    record = {"model_revision": "0ld", "cache_dtype": "float16"}
    stranger = disk(tmp_path / "stranger", space=other)
    write_chain(stranger, 40, 1)
    stranger.close()
    before = DiskTier(tmp_path / "kvcache", 1 << 20, layout(), old, record=record)
    write_chain(before, 0, 2)
    before.close()
    for path in (tmp_path / "stranger" / "kvcache" / "segments").glob("*.kvseg"):
        os.replace(path, tmp_path / "kvcache" / "segments" / path.name)

    tier = DiskTier(tmp_path / "kvcache", 1 << 20, layout(), new, record={"model_revision": "n3w"})
    tier.events = EventLog()
    assert tier.scan().foreign == 2
    assert sorted(tier.spaces.load()) == [new.hex(), old.hex()] and tier.spaces.load()[old.hex()] == record
    kept = write_chain(tier, 10, 2)
    tier.space = scaled  # new scales applied live: what follows is written under another space
    tier.spaces.add(scaled, {"model_revision": "n3w", "scale_version": "cal-2"})
    tier.space = new  # (a rollback of those scales)
    tier.space = scaled
    later = write_chain(tier, 20, 3)
    tier.space = new
    aside = {(g["kind"], g["space"]): g["segments"] for g in tier.set_aside()}
    assert aside == {("foreign", old): 1, ("foreign", other): 1}
    per = layout().payload_bytes

    gone = tier.purge_spaces({old, scaled, new})  # the served space is never purged
    assert gone == {"segments": 2, "blocks": 3, "bytes": 5 * per}
    assert sorted(tier.index) == sorted(kept) and not set(later) & set(tier.index)
    assert [(g["kind"], g["space"]) for g in tier.set_aside()] == [("foreign", other)]
    assert tier.quarantine_bytes == per
    assert [(e.kind, e.keys, e.reason) for e in tier.events.since(0).events if e.kind == "removed"] == [
        ("removed", tuple(later), "operator")]


def test_disk_capacity_evicts_whole_least_recently_used_segments(tmp_path):
    lay = layout()
    tier = disk(tmp_path, capacity=5 * lay.payload_bytes)
    a = write_chain(tier, 0, 2)
    b = write_chain(tier, 10, 2)
    tier.read(a[0])  # a is now the most recently used
    tier.make_room(2 * lay.payload_bytes)
    assert sorted(tier.index) == sorted(a)
    assert all(k not in tier.index for k in b)
    assert tier.used_bytes == 2 * lay.payload_bytes


def test_disk_full_publishes_nothing_and_leaves_no_file(tmp_path, monkeypatch):
    tier = disk(tmp_path)
    real_write = os.writev

    def full(fd, buffers):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    with pytest.raises(OSError):
        write_chain(tier, 0, 3)
    monkeypatch.setattr(os, "writev", real_write)
    assert tier.index == {} and tier.used_bytes == 0
    assert list(tier.segment_dir.iterdir()) == []


WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from tests.test_tier_payloads import disk, write_chain
    from pathlib import Path
    tier = disk(Path({path!r}))
    i = 0
    while True:
        write_chain(tier, 1000 * {round} + 10 * i, 5)
        print(i, flush=True)
        i += 1
""")


def test_kill_9_during_disk_writes_never_leaves_a_torn_block_visible(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    seen = 0
    for round_ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", WRITER.format(root=root, path=str(tmp_path), round=round_)],
                                stdout=subprocess.PIPE, text=True)
        for _ in range(1 + round_ * 3):  # kill after a different number of whole writes each round
            proc.stdout.readline()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        tier = disk(tmp_path)
        report = tier.scan()
        assert report.corrupt == 0 and report.foreign == 0
        assert len(tier.index) % 5 == 0 and len(tier.index) >= seen  # whole segments only, none lost
        seen = len(tier.index)
        for key in tier.index:
            assert same(decode_block(tier.read(key), tier.layout, SPACE, key), content(tier.layout, key))
        tier.close()  # the next writer takes the folder
    assert seen >= 5 * sum(1 + r * 3 for r in range(8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_copy_layers_matches_plain_indexing_with_runs_and_scattered_rows(dtype):
    from kvctl.daemon.cache.tiers.host import copy_layers, pair_runs

    src = [torch.randn(20, 4, 2, 8).to(dtype) for _ in range(2)]
    assert pair_runs([4, 5, 6, 0], [10, 11, 12, 3]) == [(4, 10, 3), (0, 3, 1)]
    for dst_rows, src_rows in (([4, 5, 6, 0], [10, 11, 12, 3]),  # runs: slice copies
                               ([19, 3, 7, 1, 15, 9, 11, 0, 5, 13], [0, 2, 4, 6, 8, 10, 12, 14, 16, 18])):  # index path
        dst = [torch.zeros(20, 4, 2, 8).to(dtype) for _ in range(2)]
        copy_layers(dst, dst_rows, src, src_rows)
        for d, s in zip(dst, src):
            want = torch.zeros(20, 4, 2, 8).to(dtype).view(torch.uint8)
            want[dst_rows] = s.view(torch.uint8)[src_rows]
            assert torch.equal(d.view(torch.uint8), want)


def test_the_filesystem_s_room_is_its_free_space_less_a_reserve_of_5_percent_up_to_1_gib(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from kvctl.daemon.cache.tiers.disk import filesystem_room

    def fs(size, free):
        monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_frsize=4096, f_blocks=size // 4096,
                                                                        f_bavail=free // 4096))
    fs(100 << 30, 10 << 30)  # 5 % is 5 GiB: 1 GiB is kept
    assert filesystem_room(tmp_path) == (10 << 30) - (1 << 30)
    fs(4 << 20, 3 << 20)  # 5 % of 4 MiB
    assert filesystem_room(tmp_path) == (3 << 20) - int((4 << 20) * 0.05)

    def gone(path):
        raise FileNotFoundError(path)
    monkeypatch.setattr(os, "statvfs", gone)
    assert filesystem_room(tmp_path) is None


def test_a_filesystem_running_short_evicts_least_recently_used_segments_before_a_write(tmp_path):
    """The tier is within its own bytes, but its filesystem (which other files fill too) has room for
    less than the next segment: segments go, least recently used first, counted as `filesystem`."""
    from kvctl.daemon.cache.events import EventLog

    per = layout().payload_bytes
    tier = disk(tmp_path, capacity=10 * per)
    tier.events = EventLog()
    others = [0]  # bytes other files take on the filesystem
    tier.room = lambda path: 5 * per - tier.used_bytes - others[0]  # a filesystem with room for 5 blocks
    a, b = write_chain(tier, 0, 2), write_chain(tier, 10, 2)
    tier.read(a[0])  # b is now the least recently used
    assert tier.bounded_by_filesystem() == (per, 5 * per)
    tier.make_room(2 * per)
    c = write_chain(tier, 20, 2)
    assert sorted(tier.index) == sorted(a + c) and tier.filesystem_evictions == 2
    others[0] = 2 * per  # another program writes 2 blocks' worth
    tier.make_room(2 * per)  # room -1: a goes (room 1), then c (room 3)
    d = write_chain(tier, 30, 2)
    assert sorted(tier.index) == sorted(d) and tier.filesystem_evictions == 6
    assert [(e.keys, e.reason) for e in tier.events.since(0).events if e.kind == "removed"] == [
        (tuple(b), "filesystem"), (tuple(a), "filesystem"), (tuple(c), "filesystem")]
    tier.room = lambda path: 1 << 40  # room to spare: the tier's own bytes bound it again
    assert tier.bounded_by_filesystem() is None
    tier.make_room(2 * per)
    assert sorted(tier.index) == sorted(d) and tier.filesystem_evictions == 6


def test_what_was_set_aside_goes_first_when_the_filesystem_runs_short(tmp_path):
    per = layout().payload_bytes
    before = disk(tmp_path, capacity=10 * per, space=b"O" * 32)
    write_chain(before, 0, 2)
    before.close()
    tier = disk(tmp_path, capacity=10 * per, space=b"N" * 32)
    assert tier.scan().foreign == 1 and tier.quarantine_bytes == 2 * per
    live = write_chain(tier, 10, 2)
    tier.room = lambda path: 5 * per - tier.used_bytes - tier.quarantine_bytes
    tier.make_room(2 * per)  # room 1: the set-aside segment goes, the live one stays
    assert tier.quarantine_bytes == 0 and sorted(tier.index) == sorted(live) and tier.filesystem_evictions == 0
