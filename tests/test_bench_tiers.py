"""kvctl bench tiers: the JSON document, figures side by side with the raw medium, the
restore-versus-recompute search, --save, and bad options naming field and value."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from .test_cli import cli  # noqa: E402
from .tier_fixtures import redis_server  # noqa: E402,F401

SMALL = ["--layers", "2", "--kv-heads", "1", "--head-dim", "64", "--group-blocks", "4", "--repeats", "2"]


def test_bench_tiers_json_has_every_tier_beside_its_raw_medium(capsys, tmp_path, redis_server):
    status, out, _ = cli(capsys, "bench", "tiers", *SMALL, "--redis-url", redis_server.url, "--lengths", "16,32",
                         "--disk-path", str(tmp_path), "--save", "--state-dir", str(tmp_path / "state"), "--json")
    assert status == 0
    doc = json.loads(out)
    assert doc["block_bytes"] == 2 * 2 * 16 * 1 * 64 * 2 and doc["group_blocks"] == 4
    assert sorted(doc["tiers"]) == ["disk", "host", "remote"]
    for figures in doc["tiers"].values():
        assert figures["bytes"] == 4 * doc["block_bytes"]
        for name in ("write", "read", "raw_write", "raw_read"):
            assert figures[f"{name}_bytes_per_second"] > 0
        assert figures["write_ratio"] == pytest.approx(figures["write_bytes_per_second"]
                                                       / figures["raw_write_bytes_per_second"])
    be = doc["break_even"]
    assert be["lengths"] == [16, 32] and len(be["recompute_seconds"]) == 2
    assert sorted(be["restore_seconds"]) == ["disk", "host", "remote"]
    for tier, times in be["restore_seconds"].items():
        first_win = next((L for L, r, c in zip(be["lengths"], times, be["recompute_seconds"]) if r < c), None)
        assert be["break_even_tokens"][tier] == first_win
    assert isinstance(doc["run_id"], int)
    assert list(tmp_path.glob("kvctl-bench-tiers-*")) == []  # its scratch files are gone


def test_bench_tiers_prints_a_table(capsys, tmp_path):
    status, out, _ = cli(capsys, "bench", "tiers", *SMALL, "--skip-break-even", "--disk-path", str(tmp_path))
    assert status == 0
    assert "raw write" in out and "│ host" in out and "│ disk" in out and "│ remote" not in out


def test_bench_tiers_compress_measures_the_compressed_tiers_beside_the_whole_ones(capsys, tmp_path, redis_server):
    status, out, _ = cli(capsys, "bench", "tiers", *SMALL, "--skip-break-even", "--compress", "int8",
                         "--redis-url", redis_server.url, "--disk-path", str(tmp_path), "--json")
    assert status == 0
    doc = json.loads(out)
    assert sorted(doc["tiers"]) == ["disk", "disk (int8)", "host", "remote", "remote (int8)"]
    assert doc["tiers"]["disk (int8)"]["bytes"] == doc["tiers"]["disk"]["bytes"]  # GB/s of the device's bytes
    c = doc["compression"]
    rows = 2 * 2 * 16 * 1  # layers, K and V, tokens, heads
    assert (c["codec"], c["stored_block_bytes"] - c["device_block_bytes"]) == ("int8", rows * 4 + rows * 64 + 1
                                                                               - doc["block_bytes"])
    assert c["ratio"] == pytest.approx(c["stored_block_bytes"] / c["device_block_bytes"]) and c["ratio"] < 0.6
    assert 0 < c["max_error_of_row_max"] <= 1 / 254 + 2**-8  # int8's bound, and bfloat16's rounding
    assert 0 < c["mean_error_of_rms"] < 0.01  # gaussian rows: about a quarter of a step, a step being max/127
    status, out, _ = cli(capsys, "bench", "tiers", *SMALL, "--compress", "int8", "--lengths", "16,32",
                         "--redis-url", redis_server.url, "--disk-path", str(tmp_path), "--json")
    be = json.loads(out)["break_even"]  # restoring from the compressed tiers too, beside recomputing
    assert list(be["restore_seconds"]) == ["host", "disk", "disk (int8)", "remote", "remote (int8)"]
    assert all(len(times) == 2 and min(times) > 0 for times in be["restore_seconds"].values())
    assert set(be["break_even_tokens"]) == set(be["restore_seconds"])


def test_bench_tiers_start_scan_times_the_header_scan_beside_every_byte_verified(capsys, tmp_path):
    status, out, _ = cli(capsys, "bench", "tiers", *SMALL, "--skip-break-even", "--start-scan", "256KiB",
                         "--disk-path", str(tmp_path), "--json")
    assert status == 0
    doc = json.loads(out)
    # a block's bytes; its header: 218 fixed, a dtype byte a layer, the scale version's length and
    # text ("bench"), the body's length; its checksum
    scan, payload = doc["start_scan"], doc["block_bytes"] + 218 + 2 + 2 + len("bench") + 8 + 8
    group = 4 * payload  # --group-blocks 4: one segment a write, until 256 KiB is there
    assert (scan["segments"], scan["blocks"], scan["bytes"]) == (-(-(256 << 10) // group),
                                                                 4 * -(-(256 << 10) // group),
                                                                 group * -(-(256 << 10) // group))
    assert scan["scan_seconds"] > 0 and scan["verify_seconds"] > 0
    assert scan["ratio"] == pytest.approx(scan["verify_seconds"] / scan["scan_seconds"])
    assert scan["page_cache_dropped"] is False  # only with --drop-caches: it drops the whole host's page cache
    status, out, _ = cli(capsys, "bench", "tiers", *SMALL, "--skip-break-even", "--start-scan", "256KiB",
                         "--disk-path", str(tmp_path))
    assert status == 0 and "start on a disk tier of 0.00 GiB (" in out and "every byte read and verified" in out


@pytest.mark.parametrize("args, message", [
    (["--start-scan", "lots"], "start_scan: must be a size > 0 (512MiB, 2GiB), got 'lots'"),
    (["--start-scan", "0"], "start_scan: must be a size > 0 (512MiB, 2GiB), got '0'"),
    (["--dtype", "fp4"], "dtype: invalid value 'fp4'"),
    (["--compress", "zstd"], "compress: invalid value 'zstd'; use int8 or fp8_e4m3"),
    (["--compress", "int8", "--dtype", "fp8_e4m3"],
     "compress: int8 applies to float32, float16 and bfloat16 caches; dtype is fp8_e4m3"),
    (["--group-blocks", "0"], "group-blocks: must be >= 1, got 0"),
    (["--disk-path", "/nonexistent/kvd-bench"], "disk_path: '/nonexistent/kvd-bench' is not a folder"),
])
def test_bench_tiers_bad_options(capsys, args, message):
    status, out, err = cli(capsys, "bench", "tiers", *args, "--skip-break-even")
    assert status != 0 and message in out + err
