"""The kernels compiled for real GPU architectures, on a machine without one (Triton's
ahead-of-time path and bundled ptxas): every launch fits the architecture's shared memory and
spills nothing; formats an architecture lacks are refused with the launchers' reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
triton = pytest.importorskip("triton")

KERNELS = {"write_kv_kernel", "decode_partial_kernel", "decode_merge_kernel", "prefill_kernel",
           "copy_blocks_kernel", "grouped_gemm_kernel"}


def compile_in_subprocess(script: str) -> dict:
    """Run `script` where TRITON_INTERPRET is unset (this process holds interpreted kernels);
    it prints one JSON document."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


PRELUDE = """
import json
from dataclasses import asdict
from kvctl.kernels import compile_check as cc
def run(arch, matrix):
    return [asdict(r) for r in cc.check_arch(arch, matrix)]
"""


@pytest.fixture(scope="module")
def quick_reports():
    return compile_in_subprocess(PRELUDE + """
print(json.dumps({arch: run(arch, cc.configs(quick=True)) for arch in ("sm_90", "sm_80")}))
""")


def test_every_kernel_compiles_for_the_h200_within_its_shared_memory_and_without_spills(quick_reports):
    results = quick_reports["sm_90"]
    assert {r["kernel"] for r in results} == KERNELS
    assert {r["config"].split(" cache")[0] for r in results} == {"bfloat16", "fp8_e4m3"}
    for r in results:
        assert r["ok"] and r["problem"] is None and r["refused"] is None, r
        assert 0 <= r["shared_bytes"] <= r["shared_limit"] == 232_448
        assert r["spill_bytes"] == 0 and 0 < r["registers"] <= 255
    # Attention at head_dim 256 stages K/V tiles in shared memory; the byte copies do not.
    widest = [r for r in results if r["kernel"] == "decode_partial_kernel" and "head_dim 256" in r["config"]]
    assert widest and all(r["shared_bytes"] > 0 for r in widest)
    assert all(r["shared_bytes"] == 0 for r in results if r["kernel"] == "copy_blocks_kernel")


def test_an_a100_refuses_fp8_e4m3_with_the_launchers_reason_and_compiles_the_rest(quick_reports):
    results = quick_reports["sm_80"]
    refused = [r for r in results if r["refused"]]
    assert [r["config"] for r in refused] == [
        "fp8_e4m3 cache, bfloat16 q, head_dim 64, 32/8 heads", "fp8_e4m3 cache, bfloat16 q, head_dim 256, 32/8 heads"]
    assert all(r["refused"].endswith("this one is 8.0: use fp8_e5m2 or int8") for r in refused)
    compiled = [r for r in results if not r["refused"]]
    assert {r["kernel"] for r in compiled} == KERNELS
    assert all(r["ok"] and r["shared_bytes"] <= 166_912 for r in compiled)


def test_a_wide_float32_query_group_fits_an_sm_89_block_once_split_and_not_before():
    """64 query heads on one KV head, float32, head_dim 256: as one program the decode asked
    for more shared memory than an sm_89 block has; the launcher now splits the group."""
    reports = compile_in_subprocess(PRELUDE + """
from kvctl.kernels import decode
wide = [cc.Config("float32", "float32", 256, 64, 1)]
split = run("sm_89", wide)
decode.QUERY_TILE_BYTES = 1 << 20  # one program for the whole group, as before the split
whole = run("sm_89", wide)
print(json.dumps({"split": split, "whole": whole}))
""")
    split = {r["kernel"]: r for r in reports["split"]}
    whole = {r["kernel"]: r for r in reports["whole"]}
    assert split["decode_partial_kernel"]["ok"] and split["decode_partial_kernel"]["shared_bytes"] <= 101_376
    too_big = whole["decode_partial_kernel"]
    assert not too_big["ok"] and too_big["shared_bytes"] > 101_376
    assert too_big["problem"] == (f"needs {too_big['shared_bytes']:,} bytes of shared memory; "
                                  f"sm_89 allows 101,376")


def test_an_unknown_architecture_is_refused_by_name():
    from kvctl.kernels.compile_check import check_arch

    with pytest.raises(ValueError,
                       match=r"arch: unknown value 'sm_70'; choose from sm_80, sm_86, sm_89, sm_90, sm_100"):
        check_arch("sm_70")


def test_the_compile_check_refuses_to_run_under_the_interpreter(monkeypatch):
    from kvctl.kernels.compile_check import check_arch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 is set: unset it to compile for a GPU"):
        check_arch("sm_90")
