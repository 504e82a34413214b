"""kvctl bench tiers: each tier's write and read throughput next to its raw medium, and the
prompt length from which restoring a prefix beats recomputing it.

Side by side in one process, on the same bytes, in groups of realistic size:

    host    HostTier.fill + read_slots     vs  a plain tensor copy into a preallocated buffer
    disk    DiskTier.write_group + read + verify  vs  plain file write + fsync / read
    start   (--start-scan SIZE) kvd's start scan of a tier that size (headers)  vs  every byte read
            and verified (kvctl tiers verify; what the start did before it read headers only);
            --drop-caches drops the host's page cache before each pass (root: cold figures)
    remote  RemoteTier SET/GET + verify    vs  plain pipelined SET / GET of the same bytes

Break-even: the demo model prefills L tokens (recompute) against reading L/block_size blocks
from each tier, verifying them and copying them into the device cache (restore).

`--compress int8|fp8_e4m3` also measures disk (and Redis) storing the same blocks compressed
(`tier_compress`), beside the same tier storing them whole: GB/s counts the device's bytes of the
blocks moved, so the rows compare; compression's time (on write) and decompression's (on read)
are inside them. And what compression costs in accuracy on these blocks: the largest error as a
fraction of its row's largest value, and the mean error as a fraction of the values' RMS.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import UserError
from .sizes import positive_size

DTYPES = ("float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2")


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def _layout(layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: str):
    import torch

    from kvctl.daemon.cache.tiers import BlockLayout
    from kvctl.kernels import cache_dtype

    storage = getattr(torch, dtype) if dtype in ("float32", "float16", "bfloat16") else cache_dtype(dtype)
    return BlockLayout((storage,) * layers, block_size, kv_heads, head_dim, "bench")


def _group(layout, n: int, seed: int):
    import hashlib

    import torch

    from kvctl.daemon.cache.tiers import BlockMeta

    keys = [hashlib.sha256(f"bench-{seed}-{i}".encode()).digest() for i in range(n)]
    metas = [BlockMeta(k, keys[0], d, keys[d - 1] if d else None) for d, k in enumerate(keys)]
    shape = (n, layout.block_size, layout.num_kv_heads, layout.head_dim)
    layers = [(torch.randint(-100, 100, shape, dtype=torch.int8).view(torch.uint8).view(d) if d.itemsize == 1
               else torch.randn(shape).to(d),
               torch.randint(-100, 100, shape, dtype=torch.int8).view(torch.uint8).view(d) if d.itemsize == 1
               else torch.randn(shape).to(d)) for d in layout.layer_dtypes]
    return metas, layers


def measure_host(layout, group: int, repeats: int) -> dict:
    """Device blocks -> host slots and back, as demotion and restore do, against plain copies
    of the same bytes between preallocated buffers (on a CPU-only machine "device" is CPU memory)."""
    import torch

    from kvctl.daemon.cache.tiers import HostTier
    from kvctl.daemon.model.llama import LayerCache

    metas, layers = _group(layout, group, 0)
    device = [LayerCache(k.clone(), v.clone()) for k, v in layers]
    host = HostTier(layout.block_bytes * group, layout)
    slots = block_ids = list(range(group))

    def ours_write():
        host.fill_from(slots, metas, device, block_ids)

    def ours_read():
        host.copy_out(slots, device, block_ids)

    buffers = [(torch.empty_like(k), torch.empty_like(v)) for k, v in layers]

    def raw_write():
        for (bk, bv), cache in zip(buffers, device):
            bk.copy_(cache.k)
            bv.copy_(cache.v)

    def raw_read():
        for (bk, bv), cache in zip(buffers, device):
            cache.k.copy_(bk)
            cache.v.copy_(bv)

    return _figures(layout.block_bytes * group, repeats, ours_write, ours_read, raw_write, raw_read)


def measure_disk(layout, group: int, repeats: int, path: Path, codec: str = "none") -> dict:
    from kvctl.daemon.cache.tiers import DiskTier, decode_block, encode_parts

    space = b"B" * 32
    writes = repeats + 1  # every timed write is a new segment of blocks the tier does not hold
    rounds = [_group(layout, group, seed) for seed in range(writes)]
    stored = layout.stored_bytes(codec)
    tier = DiskTier(path / "tier", stored * group * (writes + 1), layout, space)
    state = {"i": 0}

    def ours_write():
        metas, layers = rounds[state["i"]]
        state["i"] += 1
        written = tier.write_group(list(zip(metas, encode_parts(layout, space, metas, layers, codec))))
        assert written == stored * group, "bench tiers: a disk write published nothing"

    def ours_read():
        metas, _ = rounds[0]
        payloads = tier.read_many([m.key for m in metas])
        for meta in metas:
            decode_block(payloads[meta.key], layout, space, meta.key).stacked()  # decompressed, if it is

    raw_dir = path / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    metas, layers = rounds[0]
    blob = b"".join(b"".join(parts) for parts in encode_parts(layout, space, metas, layers, codec))
    names = iter(range(10**9))

    def raw_write():
        fd = os.open(raw_dir / f"blob-{next(names)}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)

    def raw_read():
        (raw_dir / "blob-0").read_bytes()

    return _figures(layout.block_bytes * group, repeats, ours_write, ours_read, raw_write, raw_read)


def drop_page_cache() -> bool:
    """Write dirty pages out and drop the page cache (root, Linux): a read after it comes from the
    disk, as after a reboot. False where that is not allowed (the reads then come from memory)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def measure_start_scan(layout, group: int, total_bytes: int, repeats: int, path: Path, cold: bool = False) -> dict:
    """kvd's start on a disk tier holding `total_bytes`: the scan as it is (each payload's header)
    beside reading and verifying every byte (`kvctl tiers verify`; what the start did before),
    on the same folder; with `cold`, the page cache dropped before each where allowed. Best of
    `repeats`."""
    from kvctl.daemon.cache.tiers import DiskTier, encode_parts

    space = b"S" * 32
    folder = path / "scan"
    tier = DiskTier(folder, 2 * total_bytes + layout.payload_bytes * group, layout, space)
    seed = 0
    while tier.used_bytes < total_bytes:
        metas, layers = _group(layout, group, 10_000 + seed)
        tier.write_group(list(zip(metas, encode_parts(layout, space, metas, layers))), fsync=False)
        seed += 1
    written, segments, blocks = tier.used_bytes, len(tier.segments), len(tier.index)
    tier.close()

    def opened() -> DiskTier:
        return DiskTier(folder, tier.capacity_bytes, layout, space)

    def headers() -> None:
        again = opened()
        again.scan()
        again.close()

    def every_byte() -> None:
        again = opened()
        again.scan()
        for name in again.segment_names():
            check = again.check_segment(name)
            assert check is not None and not check.bad, "bench tiers: a segment failed verification"
        again.close()

    times: dict[str, list[float]] = {"headers": [], "every_byte": []}
    gc.collect()
    gc.freeze()  # as kvd serve's start has frozen its imports' heap by its scan (daemon/server/gc_pauses.py)
    try:
        for _ in range(repeats):
            for name, fn in (("headers", headers), ("every_byte", every_byte)):
                cold = cold and drop_page_cache()
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
    finally:
        gc.unfreeze()
    scan, full = min(times["headers"]), min(times["every_byte"])
    return {"bytes": written, "segments": segments, "blocks": blocks, "page_cache_dropped": cold,
            "scan_seconds": scan, "verify_seconds": full, "ratio": full / scan if scan > 0 else None}


def measure_remote(layout, group: int, repeats: int, url: str, codec: str = "none") -> dict:
    from kvctl.daemon.cache.tiers import RemoteTier, decode_block, encode_parts
    from kvctl.daemon.cache.tiers.remote import connect

    space = b"R" * 32
    metas, layers = _group(layout, group, 7 + len(codec))  # other keys for each codec
    tier = RemoteTier(url, 1 << 62, space, timeout=5.0)
    client = connect(url, 5.0)
    payloads = [b"".join(parts) for parts in encode_parts(layout, space, metas, layers, codec)]
    raw_keys = [b"kvctl:bench:raw:%d" % i for i in range(group)]

    def ours_write():
        tier.write_group(list(zip(metas, encode_parts(layout, space, metas, layers, codec))))

    def ours_read():
        payloads = tier.read_many([m.key for m in metas])
        for meta in metas:
            decode_block(payloads[meta.key], layout, space, meta.key).stacked()  # decompressed, if it is

    def raw_write():
        pipe = client.pipeline(transaction=False)
        for key, payload in zip(raw_keys, payloads):
            pipe.set(key, payload)
        pipe.execute()

    def raw_read():
        pipe = client.pipeline(transaction=False)
        for key in raw_keys:
            pipe.get(key)
        pipe.execute()

    try:
        return _figures(layout.block_bytes * group, repeats, ours_write, ours_read, raw_write, raw_read)
    finally:
        client.delete(*raw_keys, *[tier.redis_key(m.key) for m in metas])


def compression_error(layout, group: int, codec: str) -> dict:
    """What `codec` does to these blocks: bytes stored per block against the device's, the largest
    error as a fraction of its row's largest |value|, and the mean |error| as a fraction of the
    values' RMS."""
    import torch

    from kvctl.daemon.cache.tiers import decode_block, encode_parts

    space = b"C" * 32
    metas, layers = _group(layout, group, 99)
    worst = total = power = 0.0
    count = 0
    for meta, parts in zip(metas, encode_parts(layout, space, metas, layers, codec)):
        block = decode_block(b"".join(parts), layout, space, meta.key)
        i = metas.index(meta)
        for layer, (k, v) in enumerate(block):
            for got, want in ((k, layers[layer][0][i]), (v, layers[layer][1][i])):
                want, err = want.float(), (got.float() - want.float()).abs()
                rows = want.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
                worst = max(worst, float((err / rows).max()))
                total, power, count = total + float(err.sum()), power + float((want ** 2).sum()), count + want.numel()
    rms = (power / count) ** 0.5 if count else 1.0
    return {"codec": codec, "stored_block_bytes": layout.stored_bytes(codec),
            "device_block_bytes": layout.payload_bytes, "ratio": layout.stored_bytes(codec) / layout.payload_bytes,
            "max_error_of_row_max": worst, "mean_error_of_rms": (total / count) / rms if count else 0.0,
            "dtype": str(torch.float32 if not layers else layers[0][0].dtype).replace("torch.", "")}


def _figures(nbytes: int, repeats: int, ours_write, ours_read, raw_write, raw_read) -> dict:
    """Best of `repeats`, ours and raw interleaved so that drift on a shared machine hits both."""
    ours_write()  # warm up (and have something to read)
    raw_write()
    best = {"write": [], "read": [], "raw_write": [], "raw_read": []}
    for _ in range(repeats):
        for name, fn in (("write", ours_write), ("raw_write", raw_write), ("read", ours_read), ("raw_read", raw_read)):
            best[name].append(_best(fn, 1))
    out = {"bytes": nbytes}
    for name, times in best.items():
        out[f"{name}_bytes_per_second"] = nbytes / min(times)
    out["write_ratio"] = out["write_bytes_per_second"] / out["raw_write_bytes_per_second"]
    out["read_ratio"] = out["read_bytes_per_second"] / out["raw_read_bytes_per_second"]
    return out


def break_even(state_dir: Path, tiers: list[str], url: str | None, lengths: list[int], repeats: int) -> dict:
    """Prefill L tokens on the demo model vs restoring L tokens of its blocks from each tier
    (`disk (int8)`: the disk storing them compressed with that codec)."""
    import torch

    from kvctl.daemon.cache.tiers import build_tiers
    from kvctl.daemon.engine.engine import Engine, EngineSettings
    from kvctl.daemon.engine.sampling import SamplingParams
    from kvctl.daemon.model.demo import ensure_demo_checkpoint
    from kvctl.daemon.model.llama import load_model

    loaded = load_model(ensure_demo_checkpoint(state_dir))
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    out: dict = {"lengths": lengths, "recompute_seconds": [], "restore_seconds": {t: [] for t in tiers}}
    g = torch.Generator().manual_seed(0)
    for length in lengths:
        prompt = torch.randint(0, loaded.config.vocab_size, (length + 1,), generator=g).tolist()
        blocks = length // 16

        def recompute():
            engine = Engine(loaded, EngineSettings(num_blocks=blocks + 8, block_size=16,
                                                   max_batch_tokens=max(256, length + 1)))
            engine.add_request(prompt, params)
            engine.run_until_done()

        out["recompute_seconds"].append(_best(recompute, repeats))
        for tier in tiers:
            base, _, codec = tier.partition(" ")
            codec = codec.strip("()") or "none"
            kwargs = {"host": dict(host_bytes=(blocks + 8) * 2**16),
                      "disk": dict(disk_bytes=1 << 30, disk_path=state_dir / f"be-{base}-{codec}-{length}"),
                      "remote": dict(remote_url=url)}[base]
            engine = Engine(loaded, EngineSettings(num_blocks=blocks + 8, block_size=16,
                                                   max_batch_tokens=max(256, length + 1)))
            tiered, _ = build_tiers(engine, tiering="always", write_policy="write_through" if base != "host"
                                    else "write_back", compress=codec, **kwargs)
            engine.add_request(prompt, params)
            engine.run_until_done()
            tiered.flush()
            from kvctl.daemon.cache.keys import PrefixHasher

            keys = PrefixHasher(engine.namespace("default")).feed(prompt)[:blocks]
            if base == "host":
                tiered._put_host([_meta(engine, k) for k in keys], src="device",
                                 block_ids=[engine.cache.pool.block_of(k) for k in keys])

            def restore():
                engine.cache.evict_prefix(keys)
                job = tiered.fetch_now(keys) if base != "host" else None
                tiered.restore_into(engine.cache, keys, 0, len(keys), "default")
                if job is not None:
                    tiered.finish_prefetch(job)

            out["restore_seconds"][tier].append(_best(restore, repeats))
            tiered.close()
    out["break_even_tokens"] = {
        t: next((L for L, r, c in zip(lengths, out["restore_seconds"][t], out["recompute_seconds"]) if r < c), None)
        for t in tiers}
    return out


def _meta(engine, key):
    from kvctl.daemon.cache.tiers import BlockMeta

    block = engine.cache.pool.blocks[engine.cache.pool.block_of(key)]
    return BlockMeta.of(block)


def tiers_command(
    ctx: typer.Context,
    layers: int = typer.Option(32, help="Layers of the block layout (default: Llama-3-8B's shape)."),
    kv_heads: int = typer.Option(8, "--kv-heads", help="KV heads."),
    head_dim: int = typer.Option(128, "--head-dim", help="Head dim."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per block."),
    dtype: str = typer.Option("bfloat16", help=f"Cache dtype: {', '.join(DTYPES)}."),
    group_blocks: int = typer.Option(8, "--group-blocks", help="Blocks per transfer group."),
    repeats: int = typer.Option(7, help="Runs per figure, ours and raw interleaved (the best is kept)."),
    redis_url: Optional[str] = typer.Option(None, "--redis-url", help="Also measure this Redis."),
    disk_path: Optional[Path] = typer.Option(None, "--disk-path", help="Folder on the disk to measure."),
    lengths: str = typer.Option("16,64,256,1024", help="Prompt lengths for the break-even search."),
    skip_break_even: bool = typer.Option(False, "--skip-break-even", help="Only the throughput table."),
    compress: Optional[str] = typer.Option(
        None, "--compress", help="Also measure disk (and Redis) storing blocks compressed: int8 or fp8_e4m3 "
                                 "(tier_compress), beside storing them whole."),
    start_scan: Optional[str] = typer.Option(
        None, "--start-scan", help="Also time kvd's start on a disk tier holding this much (2GiB): its scan of "
        "the headers beside reading and verifying every byte."),
    drop_caches: bool = typer.Option(False, "--drop-caches", help="With --start-scan: drop the page cache before "
                                     "each pass (root), for figures as after a reboot. It drops it for every "
                                     "process on the host: not on a serving machine."),
    save: bool = typer.Option(False, "--save", help="Store the result so an ADR can cite it (run:ID)."),
    state_dir: Optional[str] = typer.Option(None, "--state-dir", help="Where the store lives (KVD_STATE_DIR)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Write/read throughput of each tier beside its raw medium, and restore-vs-recompute break-even.

    Example: kvctl bench tiers --group-blocks 8 --redis-url redis://127.0.0.1:6379/0
    """
    if dtype not in DTYPES:
        raise typer.BadParameter(f"dtype: invalid value {dtype!r}; use {', '.join(DTYPES)}")
    for name, value in (("layers", layers), ("kv-heads", kv_heads), ("head-dim", head_dim),
                        ("group-blocks", group_blocks), ("repeats", repeats)):
        if value < 1:
            raise typer.BadParameter(f"{name}: must be >= 1, got {value}")
    if compress is not None and compress not in ("int8", "fp8_e4m3"):
        raise typer.BadParameter(f"compress: invalid value {compress!r}; use int8 or fp8_e4m3")
    if disk_path is not None and not disk_path.is_dir():
        raise UserError(f"disk_path: {str(disk_path)!r} is not a folder; give one on the disk to measure")
    scan_bytes = None if start_scan is None else positive_size("start_scan", start_scan, "512MiB, 2GiB")
    layout = _layout(layers, kv_heads, head_dim, block_size, dtype)
    if compress is not None and layout.codec_for(compress) == "none":
        raise UserError(f"compress: {compress} applies to float32, float16 and bfloat16 caches; dtype is {dtype}")
    scratch = Path(tempfile.mkdtemp(prefix="kvctl-bench-tiers-", dir=disk_path))
    try:
        results = {"host": measure_host(layout, group_blocks, repeats),
                   "disk": measure_disk(layout, group_blocks, repeats, scratch)}
        if compress is not None:
            results[f"disk ({compress})"] = measure_disk(layout, group_blocks, repeats, scratch / compress, compress)
        if redis_url:
            results["remote"] = measure_remote(layout, group_blocks, repeats, redis_url)
            if compress is not None:
                results[f"remote ({compress})"] = measure_remote(layout, group_blocks, repeats, redis_url, compress)
        document = {"layout": layout.describe(), "block_bytes": layout.block_bytes, "group_blocks": group_blocks,
                    "tiers": results}
        if compress is not None:
            document["compression"] = compression_error(layout, group_blocks, compress)
        if scan_bytes is not None:
            document["start_scan"] = measure_start_scan(layout, group_blocks, scan_bytes, min(repeats, 3), scratch,
                                                         cold=drop_caches)
        if not skip_break_even:
            names = ["host", "disk"] + ([f"disk ({compress})"] if compress else []) + (["remote"] if redis_url else []) \
                + ([f"remote ({compress})"] if compress and redis_url else [])
            document["break_even"] = break_even(scratch, names, redis_url,
                                                [int(x) for x in lengths.split(",")], repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    from .records_cmd import save_and_show

    save_and_show(ctx, state_dir, "bench_tiers", document, save, as_json, render)


def render(document: dict) -> None:
    console = Console()
    gb = 1e9
    table = Table("tier", "write GB/s", "raw write GB/s", "ratio", "read GB/s", "raw read GB/s", "ratio",
                  title=f"{document['group_blocks']} blocks per group, {document['block_bytes']:,} bytes per block "
                        f"({document['layout']})")
    for name, r in document["tiers"].items():
        table.add_row(name, f"{r['write_bytes_per_second'] / gb:.2f}", f"{r['raw_write_bytes_per_second'] / gb:.2f}",
                      f"{r['write_ratio']:.2f}", f"{r['read_bytes_per_second'] / gb:.2f}",
                      f"{r['raw_read_bytes_per_second'] / gb:.2f}", f"{r['read_ratio']:.2f}")
    console.print(table)
    c = document.get("compression")
    if c:
        console.print(f"{c['codec']}: {c['stored_block_bytes']:,} bytes a block stored against "
                      f"{c['device_block_bytes']:,} ({c['ratio']:.2f}); GB/s above count the device's bytes. "
                      f"Error on these blocks: largest {c['max_error_of_row_max']:.2%} of its row's largest value, "
                      f"mean {c['mean_error_of_rms']:.2%} of their RMS", markup=False)
    scan = document.get("start_scan")
    if scan:
        where = "page cache dropped before each" if scan["page_cache_dropped"] else "from the page cache"
        console.print(f"start on a disk tier of {scan['bytes'] / 2**30:.2f} GiB ({scan['blocks']:,} blocks in "
                      f"{scan['segments']:,} segments, {where}): headers read {scan['scan_seconds']:.3f} s; every "
                      f"byte read and verified {scan['verify_seconds']:.3f} s ({scan['ratio']:.1f}x)", markup=False)
    be = document.get("break_even")
    if be:
        t = Table("prompt tokens", "recompute ms", *[f"restore from {n} ms" for n in be["restore_seconds"]],
                  title="restore versus recompute (demo model, this machine)")
        for i, length in enumerate(be["lengths"]):
            t.add_row(str(length), f"{be['recompute_seconds'][i] * 1000:.2f}",
                      *[f"{v[i] * 1000:.2f}" for v in be["restore_seconds"].values()])
        console.print(t)
        longest = be["lengths"][-1]
        console.print("break-even: " + ", ".join(
            f"{n} from {v} tokens" if v is not None else f"{n} not within {longest} tokens"
            for n, v in be["break_even_tokens"].items()))
    if document.get("run_id"):
        console.print(f"saved as run:{document['run_id']}")
