"""`kvctl bench kernels`: paged attention kernels against torch's contiguous attention.

On CUDA it times decode and prefill for the head shapes of Llama-3-8B and -70B, reports
achieved memory bandwidth and its fraction of the device's peak, and the speed ratio against
`scaled_dot_product_attention` on the same K/V stored contiguously, measured in the same run.
Without CUDA it says so and checks correctness only (Triton's CPU interpreter).
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .option_lists import parse_int_list, parse_names
from .errors import UserError

# Peak HBM bandwidth by device name (bytes per second); the first matching substring wins.
PEAK_BANDWIDTH = [
    ("GH200 144G", 4.9e12), ("GH200", 4.0e12), ("H200", 4.8e12), ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("H800", 3.35e12), ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12), ("L4", 0.3e12),
    ("A10", 0.6e12), ("RTX 4090", 1.008e12),
]
SHAPES = {  # name: (query heads, KV heads, head_dim)
    "llama3-8b": (32, 8, 128),
    "llama3-70b": (64, 8, 128),
}
DTYPES = ("bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8")
MOE_SHAPES = {  # name: (experts, experts per token, hidden size, expert intermediate size)
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "gpt-oss-20b": (32, 4, 2880, 2880),
}
MOE_WEIGHTS = ("bf16", "mxfp4")  # the experts' weights as bench kernels holds them


def _save(ctx: typer.Context, document: dict, save: bool, state_dir: str | None) -> None:
    if save:
        from .records_cmd import save_run

        save_run(ctx, state_dir, "bench_kernels", document)


def peak_bandwidth(device_name: str) -> float | None:
    for key, value in PEAK_BANDWIDTH:
        if key.lower() in device_name.lower():
            return value
    return None


@dataclass
class DecodeFigure:
    shape: str
    dtype: str
    batch: int
    context: int
    ms: float  # median of --repeat timings
    bytes_per_second: float
    fraction_of_peak: float | None
    sdpa_ms: float
    speedup_vs_sdpa: float  # sdpa time / kernel time; >= 1 means no slower than the baseline
    max_abs_diff_vs_sdpa: float  # the kernel's output against the baseline's: the same attention
    ms_range: list[float]  # [fastest, slowest] of the --repeat timings
    sdpa_ms_range: list[float]


@dataclass
class MoeFigure:
    """One MoE layer's routed experts (bfloat16 rows) for `tokens` rows: the grouped-GEMM kernels
    against kvd's expert-by-expert torch path, on the same rows, routing and weights, the weights
    in bfloat16 or kept in MXFP4 (`weights`; the loop then dequantises each chosen expert)."""

    shape: str
    weights: str  # bf16 or mxfp4
    tokens: int
    experts_run: int  # distinct experts the rows chose
    ms: float
    weight_bytes_per_second: float  # the chosen experts' weights (as stored), read once, per second
    fraction_of_peak: float | None
    loop_ms: float
    speedup_vs_loop: float
    max_abs_diff_vs_loop: float
    ms_range: list[float]
    loop_ms_range: list[float]


@dataclass
class PrefillFigure:
    shape: str
    dtype: str
    batch: int
    new_tokens: int
    prefix: int
    ms: float
    tflops: float
    sdpa_ms: float
    speedup_vs_sdpa: float
    max_abs_diff_vs_sdpa: float
    ms_range: list[float]
    sdpa_ms_range: list[float]


def kernels_command(
    ctx: typer.Context,
    batches: list[str] = typer.Option(["1,8,32,64,128,256"], "--batch", help="Decode batch sizes."),
    contexts: list[str] = typer.Option(["512,2048,4096,8192,16384,32768"], "--context",
                                       help="Decode context lengths."),
    shapes: list[str] = typer.Option(["llama3-8b,llama3-70b"], "--shape", help="Head shapes."),
    moe_shapes: list[str] = typer.Option(["mixtral-8x7b,qwen3-30b-a3b,gpt-oss-20b"], "--moe-shape",
                                         help="Mixture-of-experts layer shapes (none: skip the MoE figures)."),
    moe_tokens: list[str] = typer.Option(["1,8,64,512"], "--moe-tokens", help="Rows through a MoE layer."),
    moe_weights: list[str] = typer.Option(["bf16,mxfp4"], "--moe-weights",
                                          help="The experts' weights: bf16, and mxfp4 (kept so, as gpt-oss's)."),
    dtype: str = typer.Option("bfloat16", help=f"Cache dtype: {', '.join(DTYPES)}."),
    block_size: int = typer.Option(16, help="Tokens per cache block."),
    max_tokens: int = typer.Option(1 << 21, help="Skip decode cases with more cached tokens than this."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document."),
    save: bool = typer.Option(False, "--save", help="Store the result so an ADR can cite it (run:ID)."),
    state_dir: Optional[str] = typer.Option(None, "--state-dir", help="Where the store lives (KVD_STATE_DIR)."),
    repeat: int = typer.Option(1, "--repeat", help="Time each case N times; report the median and the "
                                                   "range."),
    decode_launch: Optional[str] = typer.Option(
        None, "--decode-launch", help="Decode launch to time, e.g. 'tile=64,num_warps=8,num_stages=3,"
                                      "programs_per_sm=4' (unnamed fields keep their defaults)."),
    prefill_launch: Optional[str] = typer.Option(
        None, "--prefill-launch", help="Prefill launch to time, e.g. 'rows=64,tile=64,num_warps=8'."),
    timer: str = typer.Option(
        "calls", "--timer", help="calls: each call launched from Python, as a caller sees it (where the GPU "
                                 "is faster, the host's launch cost is the time); graph: GPU time alone, the "
                                 "calls replayed from a CUDA graph. SDPA is timed the same way."),
    window: Optional[int] = typer.Option(
        None, "--window", help="Decode as a sliding-window layer: each query attends to its last W tokens "
                               "(SDPA to the same tokens)."),
    compile_for: list[str] = typer.Option(
        [], "--compile-for", help="Also compile every kernel configuration for these GPU architectures "
                                  "(sm_80, sm_86, sm_89, sm_90, sm_100; no GPU needed): shared memory, "
                                  "registers, spills."),
) -> None:
    """Time the paged attention kernels beside torch's contiguous attention (needs CUDA for figures).

    Example: kvctl bench kernels --batch 32 --context 4096 --shape llama3-8b --json
    Without a GPU: kvctl bench kernels --compile-for sm_90,sm_80
    """
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (next line)
    from kvctl.kernels.compile_check import ARCHS

    archs = parse_names("compile_for", compile_for) if compile_for else []
    for arch in archs:
        if arch not in ARCHS:
            raise UserError(f"compile_for: unknown value {arch!r}; choose from {', '.join(ARCHS)}")
    batch_list = parse_int_list("batch", batches)
    context_list = parse_int_list("context", contexts)
    shape_list = parse_names("shape", shapes)
    for name in shape_list:
        if name not in SHAPES:
            raise UserError(f"shape: unknown value {name!r}; choose from {', '.join(SHAPES)}")
    moe_shape_list = [] if moe_shapes in (["none"], [""]) else parse_names("moe_shape", moe_shapes)
    for name in moe_shape_list:
        if name not in MOE_SHAPES:
            raise UserError(f"moe_shape: unknown value {name!r}; choose none or from {', '.join(MOE_SHAPES)}")
    moe_token_list = parse_int_list("moe_tokens", moe_tokens)
    moe_weight_list = parse_names("moe_weights", moe_weights)
    for name in moe_weight_list:
        if name not in MOE_WEIGHTS:
            raise UserError(f"moe_weights: unknown value {name!r}; choose from {', '.join(MOE_WEIGHTS)}")
    from kvctl.daemon.config import cache_dtype_name

    dtype = cache_dtype_name(dtype)
    if dtype not in DTYPES:
        raise UserError(f"dtype: unknown value {dtype!r}; choose from {', '.join(DTYPES)}")
    if repeat < 1:
        raise UserError(f"repeat: must be at least 1, got {repeat}")
    if window is not None and window < 1:
        raise UserError(f"window: must be at least 1, got {window}")
    if timer not in TIMERS:
        raise UserError(f"timer: unknown value {timer!r}; choose from {', '.join(TIMERS)}")
    from kvctl.kernels import DecodeLaunch, PrefillLaunch

    decode_config = parse_launch("decode_launch", decode_launch, DecodeLaunch)
    prefill_config = parse_launch("prefill_launch", prefill_launch, PrefillLaunch)
    console = Console(stderr=as_json)
    compiled = {arch: compile_for_arch(arch) for arch in archs}
    if not as_json:
        for arch, report in compiled.items():
            print_compile_report(console, arch, report)
    compile_failed = any(not r["ok"] for report in compiled.values() for r in report["results"])
    if not torch.cuda.is_available():
        checks = correctness_checks()
        document = {"device": "cpu", "figures": None, "note": "figures need CUDA; correctness only",
                    "checks": checks}
        if compiled:
            document["compile"] = compiled
        _save(ctx, document, save, state_dir)
        if as_json:
            typer.echo(json.dumps(document, indent=2))
        else:
            console.print("[bold]Figures need CUDA[/bold]: this machine has none. "
                          "Checked the kernels against their references on the CPU instead.")
            table = Table("check", "max abs diff", "tolerance", "ok")
            for c in checks:
                table.add_row(c["check"], f"{c['max_abs_diff']:.2e}", f"{c['tolerance']:.0e}",
                              "yes" if c["ok"] else "NO")
            console.print(table)
        if compile_failed or not all(c["ok"] for c in checks):
            raise typer.Exit(1)
        return

    device_name = torch.cuda.get_device_name()
    from kvctl.kernels import cache_dtype, format_unsupported_on

    problem = format_unsupported_on("cuda", cache_dtype(dtype))
    if problem:
        raise UserError(f"dtype: {problem}")
    peak = peak_bandwidth(device_name)
    decode = [asdict(f) for f in run_decode(shape_list, batch_list, context_list, dtype, block_size,
                                            max_tokens, peak, launch=decode_config, repeat=repeat,
                                            timer=TIMERS[timer], window=window)]
    prefill = [asdict(f) for f in run_prefill(shape_list, dtype, block_size, launch=prefill_config,
                                              repeat=repeat, timer=TIMERS[timer])]
    moe = [asdict(f) for f in run_moe(moe_shape_list, moe_token_list, peak, repeat=repeat,
                                      weight_formats=moe_weight_list)]
    import triton

    document = {"device": device_name, "peak_bytes_per_second": peak, "block_size": block_size,
                "repeat": repeat, "timer": timer, "window": window,
                "decode_launch": asdict(decode_config), "prefill_launch": asdict(prefill_config),
                "decode": decode, "prefill": prefill, "moe": moe, "torch": torch.__version__,
                "triton": triton.__version__}
    if compiled:
        document["compile"] = compiled
    _save(ctx, document, save, state_dir)
    if as_json:
        typer.echo(json.dumps(document, indent=2))
        return
    timed = "GPU time, CUDA graph" if timer == "graph" else "time per call"
    attends = "" if window is None else f", the last {window:,} tokens of each context"
    table = Table(title=f"paged decode on {device_name} ({dtype} cache, block {block_size}{attends}; {timed})")
    for column in ("shape", "batch", "context", "ms", "GB/s", "% of peak", "SDPA ms", "vs SDPA", "max diff"):
        table.add_column(column, justify="right")
    for f in decode:
        table.add_row(f["shape"], str(f["batch"]), str(f["context"]), _ms_cell(f["ms"], f["ms_range"]),
                      f"{f['bytes_per_second'] / 1e9:,.0f}",
                      "-" if f["fraction_of_peak"] is None else f"{f['fraction_of_peak']:.0%}",
                      f"{f['sdpa_ms']:.3f}", f"{f['speedup_vs_sdpa']:.2f}x",
                      f"{f['max_abs_diff_vs_sdpa']:.1e}")
    console.print(table)
    table = Table(title=f"paged prefill ({timed})")
    for column in ("shape", "batch", "new", "prefix", "ms", "TFLOP/s", "SDPA ms", "vs SDPA", "max diff"):
        table.add_column(column, justify="right")
    for f in prefill:
        table.add_row(f["shape"], str(f["batch"]), str(f["new_tokens"]), str(f["prefix"]),
                      _ms_cell(f["ms"], f["ms_range"]), f"{f['tflops']:.1f}", f"{f['sdpa_ms']:.3f}",
                      f"{f['speedup_vs_sdpa']:.2f}x", f"{f['max_abs_diff_vs_sdpa']:.1e}")
    console.print(table)
    if moe:
        table = Table(title="a MoE layer's experts, bfloat16 rows (time per call): grouped GEMMs vs expert by expert")
        for column in ("shape", "weights", "tokens", "experts run", "ms", "weights GB/s", "% of peak", "loop ms",
                       "vs loop", "max diff"):
            table.add_column(column, justify="right")
        for f in moe:
            table.add_row(f["shape"], f["weights"], str(f["tokens"]), str(f["experts_run"]),
                          _ms_cell(f["ms"], f["ms_range"]),
                          f"{f['weight_bytes_per_second'] / 1e9:,.0f}",
                          "-" if f["fraction_of_peak"] is None else f"{f['fraction_of_peak']:.0%}",
                          f"{f['loop_ms']:.3f}", f"{f['speedup_vs_loop']:.2f}x", f"{f['max_abs_diff_vs_loop']:.1e}")
        console.print(table)


def _ms_cell(ms: float, spread: list[float]) -> str:
    """'0.140', or '0.140 (0.138-0.182)' when repeated timings differ."""
    low, high = spread
    return f"{ms:.3f}" if low == high else f"{ms:.3f} ({low:.3f}-{high:.3f})"


def parse_launch(option: str, text: str | None, launch_class):
    """'tile=64,num_warps=8' -> launch_class(tile=64, num_warps=8); errors name the option and field."""
    from dataclasses import fields

    from kvctl.kernels import KernelArgumentError

    if text is None:
        return launch_class()
    names = [f.name for f in fields(launch_class)]
    values: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in names:
            raise UserError(f"{option}: unknown field {name!r} in {text!r}; choose from {', '.join(names)} "
                            "as name=value")
        try:
            values[name] = int(value)
        except ValueError:
            raise UserError(f"{option}: {name} must be an integer, got {value.strip()!r}") from None
    try:
        return launch_class(**values)
    except KernelArgumentError as exc:
        raise UserError(f"{option}: {exc}") from None


def _random_tables(batch: int, blocks_per_seq: int, device):
    import torch

    order = torch.randperm(batch * blocks_per_seq, device=device).int()
    return order.view(batch, blocks_per_seq).contiguous()


def _cache(dtype_name: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device):
    import torch

    from kvctl.kernels import cache_dtype, is_quantised

    dtype = cache_dtype(dtype_name)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, device=device, dtype=torch.bfloat16).to(dtype)
    v = torch.randn(shape, device=device, dtype=torch.bfloat16).to(dtype)
    scales = (None, None)
    if is_quantised(dtype):
        scales = (torch.full((kv_heads,), 0.01, device=device), torch.full((kv_heads,), 0.01, device=device))
    return k, v, scales


@dataclass
class PagedCase:
    """A benchmark case on the paged cache: random K/V (and scales of 0.01 for quantised
    formats) for `batch` sequences of `context` tokens, their blocks scattered at random."""

    k: object
    v: object
    k_scale: object
    v_scale: object
    tables: object  # [batch, blocks per sequence] int32
    lens: object  # [batch] int32, all `context`


def paged_case(shape: str, dtype_name: str, block_size: int, batch: int, context: int, device) -> PagedCase:
    """The cache side of a case for the head shape `shape` (`SHAPES`); queries are the caller's."""
    import torch

    _, kv_heads, head_dim = SHAPES[shape]
    blocks_per_seq = -(-context // block_size)
    k, v, (k_scale, v_scale) = _cache(dtype_name, batch * blocks_per_seq, block_size, kv_heads, head_dim, device)
    tables = _random_tables(batch, blocks_per_seq, device)
    return PagedCase(k, v, k_scale, v_scale, tables, torch.full((batch,), context, dtype=torch.int32, device=device))


def _do_bench(fn) -> float:
    """Milliseconds per call of `fn` launched from Python, as a caller sees it: Triton's
    CUDA-event timer with L2 flushed. Where the GPU finishes before the host has launched the
    next call, this is the host's time per call (the launcher's Python and the launches)."""
    from triton.testing import do_bench

    return do_bench(fn)


def capture_calls(fn, calls: int, before=None):
    """A CUDA graph of `calls` calls of `fn` (each after `before()`, if given) and what the last
    call returned. `fn` must not synchronise with the host (pass `max_context` and
    `max_new_tokens` to the kernels); its outputs live in the graph's memory pool, and each
    replay rewrites them from the inputs' current values."""
    import gc

    import torch

    graph = torch.cuda.CUDAGraph()
    gc.collect()
    gc.disable()  # a collection during capture may free memory another stream still uses
    try:
        with torch.cuda.graph(graph):
            result = None
            for _ in range(calls):
                if before is not None:
                    before()
                result = fn()
    finally:
        gc.enable()
    return graph, result


GRAPH_FLOOR_MS = 1e-4


def _graph_bench(fn, target_ms: float = 10.0, replays: int = 5) -> float:
    """Milliseconds of GPU time per call of `fn`, without the host's cost of launching it (as
    an engine that replays CUDA graphs sees it): `fn` is captured N times in one graph, each
    call after an L2 flush, and a graph of the flushes alone, replayed alternately with it, is
    taken off."""
    import statistics

    import torch

    l2_bytes = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
    flush = torch.empty(max(2 * l2_bytes, 64 << 20), dtype=torch.int8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (and compile) off the default stream, as capture asks
        for _ in range(3):
            flush.zero_()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    end.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    calls = max(1, min(1000, int(target_ms / estimate_ms)))
    with_fn, _ = capture_calls(fn, calls, before=flush.zero_)
    flushes, _ = capture_calls(lambda: None, calls, before=flush.zero_)

    def replay(graph) -> float:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    replay(with_fn), replay(flushes)
    timed, alone = [], []
    for _ in range(replays):
        timed.append(replay(with_fn))
        alone.append(replay(flushes))
    # a kernel within the replays' noise of nothing still gets a time (0.1 us), never 0: figures divide by it
    return max((statistics.median(timed) - statistics.median(alone)) / calls, GRAPH_FLOOR_MS)


# --timer: how a case is timed (both kernels and SDPA the same way)
TIMERS = {"calls": _do_bench, "graph": _graph_bench}


def _timed(timer, fn, repeat: int) -> tuple[float, list[float]]:
    """Median and [fastest, slowest] of `repeat` timings of `fn`."""
    import statistics

    times = [timer(fn) for _ in range(repeat)]
    return statistics.median(times), [min(times), max(times)]


def run_decode(shape_list, batch_list, context_list, dtype_name, block_size, max_tokens, peak, *,
               device: str = "cuda", timer=_do_bench, launch=None, repeat: int = 1, window: int | None = None):
    """Decode figures for every (shape, context, batch) with batch x context <= max_tokens.

    Each case also runs torch's SDPA on the same K/V (dequantised, stored contiguously) and
    records how far its output lies from the kernel's, so the baseline is the same attention.
    `timer(fn) -> ms`, taken `repeat` times (the median is reported, with the range);
    `launch` is a `DecodeLaunch` (None: the kernel's defaults). With a sliding `window` the
    kernel attends to each sequence's last `window` tokens, SDPA to those same tokens, and the
    bytes counted are theirs.
    """
    import torch
    import torch.nn.functional as F

    from kvctl.kernels import DecodeLaunch, paged_decode_attention

    launch = launch or DecodeLaunch()
    figures = []
    for shape in shape_list:
        heads, kv_heads, head_dim = SHAPES[shape]
        for context in context_list:
            for batch in batch_list:
                if batch * context > max_tokens:
                    continue
                case = paged_case(shape, dtype_name, block_size, batch, context, device)
                k, v, k_scale, v_scale, tables, lens = (case.k, case.v, case.k_scale, case.v_scale, case.tables,
                                                        case.lens)
                q = torch.randn((batch, heads, head_dim), device=device, dtype=torch.bfloat16)
                scale = head_dim ** -0.5

                def kernel():
                    return paged_decode_attention(q, k, v, tables, lens, scale=scale, k_scale=k_scale,
                                                  v_scale=v_scale, max_context=context, launch=launch, window=window)

                ms, ms_range = _timed(timer, kernel, repeat)
                span = context if window is None else min(context, window)  # the tokens each query attends to
                k_contig = _contiguous(k, k_scale, tables, batch, context)[:, :, context - span:]
                v_contig = _contiguous(v, v_scale, tables, batch, context)[:, :, context - span:]
                q4 = q[:, :, None, :]

                def baseline():
                    return F.scaled_dot_product_attention(q4, k_contig, v_contig, scale=scale, enable_gqa=True)

                sdpa_ms, sdpa_range = _timed(timer, baseline, repeat)
                diff = float((kernel().float() - baseline()[:, :, 0].float()).abs().max())
                kv_bytes = 2 * batch * span * kv_heads * head_dim * k.element_size()
                scale_bytes = 0 if k_scale is None else 2 * k_scale.numel() * k_scale.element_size()
                io_bytes = 2 * q.numel() * q.element_size() + tables.numel() * tables.element_size()
                bandwidth = (kv_bytes + scale_bytes + io_bytes) / (ms / 1e3)
                figures.append(DecodeFigure(shape, dtype_name, batch, context, ms, bandwidth,
                                            None if peak is None else bandwidth / peak, sdpa_ms,
                                            sdpa_ms / ms, diff, ms_range, sdpa_range))
                k = v = k_contig = v_contig = case = None  # free before the next case
                if device == "cuda":
                    torch.cuda.empty_cache()
    return figures


def run_moe(shape_list, token_list, peak, *, device: str = "cuda", repeat: int = 1,
            weight_formats=MOE_WEIGHTS) -> list[MoeFigure]:
    """MoE figures for every (shape, weights, tokens): `moe_experts` (two grouped GEMMs, Triton)
    beside kvd's expert-by-expert path (`experts_mlp` unfused: a GEMM pair per chosen expert, after
    a device sync to learn which), one layer, random weights (bfloat16, or MXFP4 blocks and scales,
    which the kernels decode tile by tile and the loop dequantises expert by expert), the router's
    own top k. Both are timed per call from Python (`_do_bench`): the loop's sync cannot be
    replayed from a CUDA graph, and the host time it costs is part of what the kernel saves."""
    import torch
    import torch.nn.functional as F

    from kvctl.daemon.model.moe import experts_mlp, gated, route

    glu = gated(F.silu)
    figures = []
    for shape, kept in itertools.product(shape_list, weight_formats):
        num_experts, top_k, hidden, inter = MOE_SHAPES[shape]
        g = torch.Generator(device=device).manual_seed(0)
        if kept == "mxfp4":  # blocks of random FP4 codes, scales 2^-9..2^-6 (weights of about 0.01)
            gate_up, down = (torch.randint(0, 256, (num_experts, rows, columns // 32, 16), device=device,
                                           generator=g, dtype=torch.uint8) for rows, columns in
                             ((2 * inter, hidden), (hidden, inter)))
            scales = {name: torch.randint(118, 122, tuple(w.shape[:3]), device=device, generator=g,
                                          dtype=torch.uint8) for name, w in (("gate_up_scales", gate_up),
                                                                              ("down_scales", down))}
            bytes_per_weight = 17 / 32
        else:
            gate_up = torch.randn((num_experts, 2 * inter, hidden), device=device, generator=g,
                                  dtype=torch.bfloat16) * 0.02
            down = torch.randn((num_experts, hidden, inter), device=device, generator=g,
                               dtype=torch.bfloat16) * 0.02
            scales, bytes_per_weight = {}, 2
        router = torch.randn((num_experts, hidden), device=device, generator=g, dtype=torch.bfloat16)
        for tokens in token_list:
            x = torch.randn((tokens, hidden), device=device, generator=g, dtype=torch.bfloat16)
            weights, experts = route(x, router, top_k, True)

            def fused():
                return experts_mlp(x, weights, experts, gate_up, down, glu, fused=True, **scales)

            def loop():
                return experts_mlp(x, weights, experts, gate_up, down, glu, **scales)

            ms, ms_range = _timed(_do_bench, fused, repeat)
            loop_ms, loop_range = _timed(_do_bench, loop, repeat)
            diff = float((fused().float() - loop().float()).abs().max())
            run = int(experts.unique().numel())
            bandwidth = run * 3 * hidden * inter * bytes_per_weight / (ms / 1e3)
            figures.append(MoeFigure(shape, kept, tokens, run, ms, bandwidth,
                                     None if peak is None else bandwidth / peak, loop_ms, loop_ms / ms, diff,
                                     ms_range, loop_range))
        gate_up = down = scales = None  # free before the next shape
        if device == "cuda":
            torch.cuda.empty_cache()
    return figures


def _contiguous(cache, scale, tables, batch: int, context: int):
    """One sequence's K or V as bf16 [batch, kv_heads, context, head_dim], dequantised."""
    import torch

    _, _, kv_heads, head_dim = cache.shape
    values = cache[tables.long()].float()
    if scale is not None:
        values = values * scale[None, None, None, :, None]
    values = values.to(torch.bfloat16).view(batch, -1, kv_heads, head_dim)[:, :context]
    return values.transpose(1, 2).contiguous()


def run_prefill(shape_list, dtype_name, block_size, batch: int = 4, new_tokens: int = 2048, *,
                prefixes=(0, 4096), device: str = "cuda", timer=_do_bench, launch=None, repeat: int = 1):
    """Prefill figures: `batch` sequences of `new_tokens` new tokens after each prefix length,
    beside SDPA (causal; past a prefix, causal from the bottom right) on the same K/V stored
    contiguously."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from kvctl.kernels import PrefillLaunch, paged_prefill_attention

    launch = launch or PrefillLaunch()
    figures = []
    for shape in shape_list:
        heads, kv_heads, head_dim = SHAPES[shape]
        for prefix in prefixes:
            context = prefix + new_tokens
            case = paged_case(shape, dtype_name, block_size, batch, context, device)
            k, v, k_scale, v_scale, tables, lens = case.k, case.v, case.k_scale, case.v_scale, case.tables, case.lens
            qsl = torch.arange(0, (batch + 1) * new_tokens, new_tokens, dtype=torch.int32, device=device)
            q = torch.randn((batch * new_tokens, heads, head_dim), device=device, dtype=torch.bfloat16)
            scale = head_dim ** -0.5

            def kernel():
                return paged_prefill_attention(q, k, v, tables, qsl, lens, scale=scale, k_scale=k_scale,
                                               v_scale=v_scale, max_new_tokens=new_tokens, launch=launch)

            ms, ms_range = _timed(timer, kernel, repeat)
            q4 = q.view(batch, new_tokens, heads, head_dim).transpose(1, 2)
            k4 = _contiguous(k, k_scale, tables, batch, context)
            v4 = _contiguous(v, v_scale, tables, batch, context)
            # Causal from the bottom right (new token i sees the prefix and new tokens 0..i) as a
            # bias object, not a boolean mask, so that SDPA may still take its fused kernels.
            visible = causal_lower_right(new_tokens, context) if prefix else None

            def baseline():
                return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=visible, is_causal=not prefix,
                                                      scale=scale, enable_gqa=True)

            sdpa_ms, sdpa_range = _timed(timer, baseline, repeat)
            diff = float((kernel().float() - baseline().transpose(1, 2).reshape(q.shape).float()).abs().max())
            pairs = batch * heads * (new_tokens * prefix + new_tokens * (new_tokens + 1) / 2)
            flops = 4 * pairs * head_dim
            figures.append(PrefillFigure(shape, dtype_name, batch, new_tokens, prefix, ms,
                                         flops / (ms / 1e3) / 1e12, sdpa_ms, sdpa_ms / ms, diff, ms_range,
                                         sdpa_range))
            k = v = k4 = v4 = case = None  # free before the next case
            if device == "cuda":
                torch.cuda.empty_cache()
    return figures


def compile_for_arch(arch: str, quick: bool = False) -> dict:
    """`kvctl.kernels.compile_check` for `arch`, in a process of its own: this one may already
    hold the kernels as interpreted functions (TRITON_INTERPRET=1), which cannot be compiled.
    `quick`: two formats at two head sizes instead of the whole support matrix."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "kvctl.kernels.compile_check", "--arch", arch, "--json"]
    done = subprocess.run(command + (["--quick"] if quick else []), stdout=subprocess.PIPE, env=env, text=True,
                          check=False)
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        raise UserError(f"compile_for: the compile check for {arch} failed (exit {done.returncode}); "
                        f"run python -m kvctl.kernels.compile_check --arch {arch} to see why") from None


def print_compile_report(console: Console, arch: str, report: dict) -> None:
    """One row per kernel: configurations compiled, the most shared memory and registers any of
    them needs, spills; then every failure and every refusal with its reason."""
    results = report["results"]
    table = Table(title=f"kernels compiled for {arch} ({report['devices']}): shared memory limit "
                        f"{report['shared_limit'] / 1024:,.0f} KiB per block")
    for column in ("kernel", "configs", "max shared KiB", "max registers", "spills", "failed"):
        table.add_column(column, justify="right")
    for kernel in dict.fromkeys(r["kernel"] for r in results if not r["refused"]):
        rows = [r for r in results if r["kernel"] == kernel]
        compiled = [r for r in rows if r["shared_bytes"] is not None]
        table.add_row(kernel, str(len(rows)),
                      f"{max((r['shared_bytes'] for r in compiled), default=0) / 1024:,.1f}",
                      str(max((r["registers"] or 0 for r in compiled), default=0)),
                      str(sum(1 for r in compiled if r["spill_bytes"])),
                      str(sum(1 for r in rows if not r["ok"])))
    console.print(table)
    for r in results:
        if not r["ok"]:
            console.print(f"[red]FAILED[/red] {r['kernel']} ({r['config']}): {r['problem']}")
    for reason in dict.fromkeys(r["refused"] for r in results if r["refused"]):
        count = sum(1 for r in results if r["refused"] == reason)
        console.print(f"refused by the launchers on {arch} ({count} configurations): {reason}")


def correctness_checks() -> list[dict]:
    """Small cases of every kernel against its reference, on the CPU interpreter."""
    import torch

    from kvctl.kernels import (copy_blocks, copy_blocks_ref, paged_decode_attention,
                               paged_decode_attention_ref, paged_prefill_attention,
                               paged_prefill_attention_ref, write_kv, write_kv_ref)

    torch.manual_seed(0)
    block_size, kv_heads, heads, head_dim, num_blocks = 16, 2, 8, 64, 24
    lengths = [1, 15, 16, 17, 53]
    tables = torch.randperm(num_blocks).int()[:20].view(5, 4).contiguous()
    lens = torch.tensor(lengths, dtype=torch.int32)
    positions = [torch.arange(n) for n in lengths]
    slots = torch.cat([tables[s, p // block_size].long() * block_size + p % block_size
                       for s, p in enumerate(positions)])
    keys = torch.randn((len(slots), kv_heads, head_dim))
    values = torch.randn_like(keys)
    checks = []

    def record(name, got, want, tolerance):
        diff = float((got.float() - want.float()).abs().max())
        checks.append({"check": name, "max_abs_diff": diff, "tolerance": tolerance, "ok": diff <= tolerance})

    caches = []
    for fn in (write_kv, write_kv_ref):
        k = torch.zeros((num_blocks, block_size, kv_heads, head_dim))
        v = torch.zeros_like(k)
        fn(keys, values, k, v, slots)
        caches.append((k, v))
    record("write_kv float32", caches[0][0], caches[1][0], 0.0)
    k, v = caches[1]
    q = torch.randn((5, heads, head_dim))
    record("paged_decode_attention float32 (GQA 4)",
           paged_decode_attention(q, k, v, tables, lens, scale=0.125),
           paged_decode_attention_ref(q, k, v, tables, lens, scale=0.125), 1e-5)
    qsl = torch.tensor([0, 1, 6, 22, 23, 53], dtype=torch.int32)
    qp = torch.randn((53, heads, head_dim))
    record("paged_prefill_attention float32 (GQA 4)",
           paged_prefill_attention(qp, k, v, tables, qsl, lens, scale=0.125),
           paged_prefill_attention_ref(qp, k, v, tables, qsl, lens, scale=0.125), 1e-5)
    record("paged_decode_attention float32, window 20",
           paged_decode_attention(q, k, v, tables, lens, scale=0.125, window=20),
           paged_decode_attention_ref(q, k, v, tables, lens, scale=0.125, window=20), 1e-5)
    record("paged_prefill_attention float32, window 20",
           paged_prefill_attention(qp, k, v, tables, qsl, lens, scale=0.125, window=20),
           paged_prefill_attention_ref(qp, k, v, tables, qsl, lens, scale=0.125, window=20), 1e-5)
    capped = dict(scale=0.125, softcap=2.0)  # Gemma 2 caps at 50; a low cap bends these random scores
    record("paged_decode_attention float32, softcap 2",
           paged_decode_attention(q * 4, k, v, tables, lens, **capped),
           paged_decode_attention_ref(q * 4, k, v, tables, lens, **capped), 1e-5)
    record("paged_prefill_attention float32, softcap 2",
           paged_prefill_attention(qp * 4, k, v, tables, qsl, lens, **capped),
           paged_prefill_attention_ref(qp * 4, k, v, tables, qsl, lens, **capped), 1e-5)
    sunk = dict(scale=0.125, window=20, sinks=torch.linspace(-2.0, 3.0, heads))  # gpt-oss: sinks on a sliding layer
    record("paged_decode_attention float32, sinks, window 20",
           paged_decode_attention(q, k, v, tables, lens, **sunk),
           paged_decode_attention_ref(q, k, v, tables, lens, **sunk), 1e-5)
    record("paged_prefill_attention float32, sinks, window 20",
           paged_prefill_attention(qp, k, v, tables, qsl, lens, **sunk),
           paged_prefill_attention_ref(qp, k, v, tables, qsl, lens, **sunk), 1e-5)
    k2, v2 = k.clone(), v.clone()
    src, dst = torch.tensor([int(tables[4, 0])]), torch.tensor([int(tables[0, 1])])
    copy_blocks(k, v, src, dst)
    copy_blocks_ref(k2, v2, src, dst)
    record("copy_blocks", k, k2, 0.0)
    from kvctl.daemon.model.moe import experts_mlp, gated, route

    router, x = torch.randn((8, 64)), torch.randn((29, 64))  # 8 experts, 2 for each of 29 rows
    gate_up, down = torch.randn((8, 96, 64)) * 0.2, torch.randn((8, 64, 48)) * 0.2
    weights, experts = route(x, router, 2, True)
    glu = gated(torch.nn.functional.silu)
    record("moe_experts float32 (8 experts, 2 per row)", experts_mlp(x, weights, experts, gate_up, down, glu, fused=True),
           experts_mlp(x, weights, experts, gate_up, down, glu), 1e-4)
    g = torch.Generator().manual_seed(5)  # experts kept in MXFP4 (I 64): the kernel decodes, the loop dequantises
    gate_up_q, down_q = (torch.randint(0, 256, (8, rows, 2, 16), generator=g, dtype=torch.uint8) for rows in (128, 64))
    kept = {name: torch.randint(119, 123, (8, rows, 2), generator=g, dtype=torch.uint8)
            for name, rows in (("gate_up_scales", 128), ("down_scales", 64))}
    record("moe_experts float32, MXFP4 experts", experts_mlp(x, weights, experts, gate_up_q, down_q, glu, fused=True,
                                                               **kept),
           experts_mlp(x, weights, experts, gate_up_q, down_q, glu, **kept), 1e-4)
    return checks
