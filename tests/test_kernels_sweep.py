"""The GPU-session scripts on the CPU: scripts/sweep-kernels (how it picks a launch, and a smoke
run whose recommendation `kvctl bench kernels` accepts) and scripts/profile-decode."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sweep-kernels"


def load_sweep():
    loader = importlib.machinery.SourceFileLoader("sweep_kernels", str(SCRIPT))
    spec = importlib.util.spec_from_loader("sweep_kernels", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_recommendation_is_the_launch_with_the_best_geometric_mean_against_each_cases_best():
    sweep = load_sweep()
    table = {"small": {"x": 1.0, "y": 2.0, "z": None},  # z failed to build in one case: never chosen
             "large": {"x": 3.0, "y": 2.0, "z": 1.0}}
    choice = sweep.recommend(table, default="y")
    # x: ratios 1/1 and 3/1 -> geomean 1.73, worst 3; y: 2/1 and 2/1 -> geomean 2, worst 2.
    assert choice["recommended"] == "x"
    assert choice["geomean_vs_best"] == pytest.approx(3 ** 0.5)
    assert choice["worst_vs_best"] == pytest.approx(3.0)
    assert (choice["default_geomean_vs_best"], choice["default_worst_vs_best"]) == (pytest.approx(2.0), 2.0)
    assert choice["per_case"]["large"] == {"best_ms": 1.0, "recommended_ms": 3.0, "default_ms": 2.0}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the full sweep (scripts/gpu-check)")
def test_a_smoke_sweep_writes_flags_that_bench_kernels_accepts(tmp_path):
    from kvctl.bench_kernels import parse_launch
    from kvctl.kernels import DecodeLaunch, PrefillLaunch

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "llama3-8b", "--json", str(tmp_path / "s.json"),
                           "--best", str(tmp_path / "best.txt")], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["device"] == "cpu" and list(result["decode"]) == ["llama3-8b b=2 ctx=40"]
    assert all(ms is not None and ms > 0 for ms in result["decode"]["llama3-8b b=2 ctx=40"].values())
    flags = (tmp_path / "best.txt").read_text().split()
    assert flags[0] == "--decode-launch" and flags[2] == "--prefill-launch"
    assert flags[1] == result["decode_choice"]["recommended"]
    assert isinstance(parse_launch("decode_launch", flags[1], DecodeLaunch), DecodeLaunch)
    assert isinstance(parse_launch("prefill_launch", flags[3], PrefillLaunch), PrefillLaunch)


def test_the_profiling_target_runs_one_decode_case_with_the_launch_it_is_given():
    script = SCRIPT.parent / "profile-decode"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script), "--dtype", "int8", "--calls", "2", "--launch", "tile=32"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    case = "batch 128 context 4096: 2 calls, output (128, 32, 128)" if torch.cuda.is_available() else \
        "batch 2 context 40: 2 calls, output (2, 32, 128)"
    assert done.stdout.startswith(f"int8 llama3-8b {case}, launch DecodeLaunch(tile=32,")
