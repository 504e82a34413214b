"""Compile every kernel configuration for a GPU architecture, on any machine.

A kernel that runs under the CPU interpreter can still fail on a GPU: `tl.dot` shapes, fp8
types the architecture lacks, or more shared memory than a block may have. Triton compiles
ahead of time without a device (its bundled `ptxas` makes the cubin), so this module calls each
launcher with small tensors of the real dtypes, records the launches instead of running them,
and compiles each one for the named architecture exactly as a launch there would (the same
argument specialisation, constexprs and launch options).

Each result gives the shared memory the launch asks for against the architecture's per-block
limit, the registers per thread, and the bytes spilled to local memory (`cuobjdump`).

Run it where `TRITON_INTERPRET` is unset (with it, Triton hands out interpreted functions):

    python -m kvctl.kernels.compile_check --arch sm_90 [--quick] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch

from .checks import SUPPORTED_HEAD_DIMS, format_unsupported
from .formats import CACHE_DTYPES, is_quantised

# Architecture: (compute capability, devices, shared memory one block may use in bytes).
ARCHS: dict[str, tuple[int, str, int]] = {
    "sm_80": (80, "A100", 166_912),
    "sm_86": (86, "A10, RTX 30xx", 101_376),
    "sm_89": (89, "L40S, L4, RTX 40xx", 101_376),
    "sm_90": (90, "H100, H200", 232_448),
    "sm_100": (100, "B200, GB200", 232_448),
}


@dataclass(frozen=True)
class Config:
    """One launcher call: the cache format, the query dtype and the head shape."""

    cache_dtype: str
    query_dtype: str
    head_dim: int
    heads: int
    kv_heads: int

    @property
    def label(self) -> str:
        return (f"{self.cache_dtype} cache, {self.query_dtype} q, head_dim {self.head_dim}, "
                f"{self.heads}/{self.kv_heads} heads")


@dataclass
class CompileResult:
    kernel: str
    config: str
    ok: bool
    shared_bytes: int | None = None
    shared_limit: int | None = None
    registers: int | None = None
    spill_bytes: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    problem: str | None = None
    refused: str | None = None  # not compiled: the launchers refuse this format on this architecture


def configs(quick: bool = False) -> list[Config]:
    """The support matrix: every cache format (quantised ones with bfloat16 and float16
    queries), every supported head_dim, and grouped-query ratios 4 and 64 (query heads sharing
    a KV head are one tl.dot operand, padded to at least 16 rows). `quick`: the two formats
    serving uses most, at the smallest and largest head_dim."""
    pairs = []
    for name, dtype in CACHE_DTYPES.items():
        queries = ("bfloat16", "float16") if is_quantised(dtype) else (name,)
        pairs += [(name, q) for q in queries]
    dims: tuple[int, ...] = SUPPORTED_HEAD_DIMS
    shapes = ((32, 8), (64, 1))
    if quick:
        pairs, dims, shapes = [("bfloat16", "bfloat16"), ("fp8_e4m3", "bfloat16")], (64, 256), ((32, 8),)
    return [Config(c, q, d, h, kv) for (c, q), d, (h, kv) in itertools.product(pairs, dims, shapes)]


@contextlib.contextmanager
def recording_launches():
    """Launches inside this block are recorded, not run: [(kernel, args, kwargs)]. The
    launchers' device check is lifted for the block (its tensors stay on the CPU). It patches
    Triton process-wide: only for a process that launches nothing else meanwhile, as the
    compile check's own."""
    import importlib

    from triton.runtime.jit import JITFunction

    launches: list = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    def any_device(tensors):
        return next(t.device for t in tensors.values() if t is not None)

    # the modules (the package's names of the same spelling are the launchers)
    modules = [importlib.import_module(f"{__package__}.{name}") for name in ("copy_blocks", "decode", "moe",
                                                                              "prefill", "write_kv")]
    saved_run, saved_checks = JITFunction.run, [m.check_device for m in modules]
    JITFunction.run = record
    for module in modules:
        module.check_device = any_device
    try:
        yield launches
    finally:
        JITFunction.run = saved_run
        for module, saved in zip(modules, saved_checks):
            module.check_device = saved


def launches_for(config: Config) -> list:
    """Call every launcher once for `config` and return its recorded launches."""
    from . import align_pairs, copy_blocks, grouped_gemm, paged_decode_attention, paged_prefill_attention, write_kv

    cache = CACHE_DTYPES[config.cache_dtype]
    query = CACHE_DTYPES[config.query_dtype]
    blocks, block_size, kv, dim = 8, 16, config.kv_heads, config.head_dim
    k_cache = torch.zeros((blocks, block_size, kv, dim), dtype=cache)
    v_cache = torch.zeros_like(k_cache)
    scales = dict(k_scale=torch.ones(kv), v_scale=torch.ones(kv)) if is_quantised(cache) else {}
    tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    lengths = torch.tensor([20, 40], dtype=torch.int32)
    with recording_launches() as launches:
        new = torch.zeros((3, kv, dim), dtype=query)
        write_kv(new, new.clone(), k_cache, v_cache, torch.tensor([0, 1, 2]), **scales)
        decode_q = torch.zeros((2, config.heads, dim), dtype=query)
        decode_tables = torch.arange(16, dtype=torch.int32).view(2, 8) % blocks
        decode_lengths = torch.tensor([20, 100], dtype=torch.int32)
        for partition in (128, 64):  # one split (the output written directly), then two merged
            paged_decode_attention(decode_q, k_cache, v_cache, decode_tables, decode_lengths, scale=dim ** -0.5,
                                   partition_size=partition, **scales)
        paged_decode_attention(decode_q, k_cache, v_cache, decode_tables, decode_lengths, scale=dim ** -0.5,
                               partition_size=64, window=96, **scales)  # a sliding-window layer
        paged_decode_attention(decode_q, k_cache, v_cache, decode_tables, decode_lengths, scale=dim ** -0.5,
                               partition_size=64, softcap=50.0, **scales)  # scores capped (Gemma 2)
        sinks = torch.zeros(config.heads)
        for partition in (128, 64):  # attention sinks (gpt-oss), on a window's split and merged
            paged_decode_attention(decode_q, k_cache, v_cache, decode_tables, decode_lengths, scale=dim ** -0.5,
                                   partition_size=partition, window=128, sinks=sinks, **scales)
        for window, softcap, sink in ((None, None, None), (24, None, None), (None, 50.0, None), (24, None, sinks)):
            paged_prefill_attention(torch.zeros((5, config.heads, dim), dtype=query), k_cache, v_cache, tables,
                                    torch.tensor([0, 2, 5], dtype=torch.int32), lengths, scale=dim ** -0.5,
                                    window=window, softcap=softcap, sinks=sink, **scales)
        copy_blocks(k_cache, v_cache, torch.tensor([0]), torch.tensor([1]))
        # a mixture of experts' grouped GEMMs in the model's dtype (the same launch for every cache format)
        experts = torch.tensor([[0, 2], [1, 2], [3, 0]])
        tiles = align_pairs(experts, 4, 16)
        weight, bias = torch.zeros((4, 96, 64), dtype=query), torch.zeros((4, 96), dtype=query)
        grouped_gemm(torch.zeros((3, 64), dtype=query), weight, tiles, 2, by_token=True, bias=bias)
        grouped_gemm(torch.zeros((6, 64), dtype=query), weight, tiles, 2, by_token=False, scale=torch.ones(6),
                     out_dtype=torch.float32)
        # the same, the experts' weights kept in MXFP4 (gpt-oss's): blocks and scales, decoded tile by tile
        blocks = torch.zeros((4, 96, 2, 16), dtype=torch.uint8)
        block_scales = torch.zeros((4, 96, 2), dtype=torch.uint8)
        grouped_gemm(torch.zeros((3, 64), dtype=query), blocks, tiles, 2, by_token=True, bias=bias,
                     weight_scales=block_scales)
        grouped_gemm(torch.zeros((6, 64), dtype=query), blocks, tiles, 2, by_token=False, scale=torch.ones(6),
                     out_dtype=torch.float32, weight_scales=block_scales)
    return launches


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers per thread, local-memory bytes per thread) of a cubin, from cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                check=False).stdout
    registers = re.search(r"REG:(\d+)", report)
    local = re.search(r"LOCAL:(\d+)", report)
    return (int(registers.group(1)) if registers else None, int(local.group(1)) if local else None)


def compile_launch(kernel, args, kwargs, arch: str, label: str) -> CompileResult:
    """Compile one recorded launch for `arch` the way Triton's launch path would there (the
    binder and `JITFunction._pack_args` of Triton 3.9; a Triton whose internals differ shows up
    as a failed compile that names the missing piece)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    capability, _, shared_limit = ARCHS[arch]
    name = kernel.fn.__name__.strip("_")
    result = CompileResult(name, label, ok=False, shared_limit=shared_limit)
    target = GPUTarget("cuda", capability, 32)
    try:
        backend = make_backend(target)
        kwargs = dict(kwargs, debug=False)
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    except Exception as exc:  # the compiler's own message says what it refused
        result.problem = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        return result
    result.shared_bytes = int(compiled.metadata.shared)
    result.num_warps, result.num_stages = compiled.metadata.num_warps, compiled.metadata.num_stages
    result.registers, result.spill_bytes = _resources(compiled.asm["cubin"])
    problems = []
    if result.shared_bytes > shared_limit:
        problems.append(f"needs {result.shared_bytes:,} bytes of shared memory; {arch} allows {shared_limit:,}")
    if result.spill_bytes:
        problems.append(f"spills {result.spill_bytes} bytes per thread to local memory")
    result.ok = not problems
    result.problem = "; ".join(problems) or None
    return result


def check_arch(arch: str, matrix: list[Config] | None = None,
               progress=lambda done, total: None) -> list[CompileResult]:
    """Compile every distinct launch of `matrix` (default: the whole support matrix) for
    `arch`. A format the launchers refuse on `arch` (`format_unsupported`) is listed as
    refused, with the launchers' reason, instead of compiled."""
    if arch not in ARCHS:
        raise ValueError(f"arch: unknown value {arch!r}; choose from {', '.join(ARCHS)}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 is set: unset it to compile for a GPU")
    capability = divmod(ARCHS[arch][0], 10)
    pending, seen, results = [], set(), []
    for config in configs() if matrix is None else matrix:
        reason = format_unsupported(CACHE_DTYPES[config.cache_dtype], capability)
        if reason:
            results.append(CompileResult("every kernel", config.label, ok=True, refused=reason))
            continue
        for kernel, args, kwargs in launches_for(config):
            key = (kernel.fn.__name__, repr([(type(a).__name__, getattr(a, "dtype", a)) for a in args]),
                   repr(sorted(kwargs.items())))
            if key not in seen:  # e.g. copy_blocks is the same launch for every head shape
                seen.add(key)
                pending.append((kernel, args, kwargs, config))
    for i, (kernel, args, kwargs, config) in enumerate(pending):
        results.append(compile_launch(kernel, args, kwargs, arch, config.label))
        progress(i + 1, len(pending))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90", help=f"one of {', '.join(ARCHS)}")
    parser.add_argument("--quick", action="store_true", help="bfloat16 and fp8_e4m3 at head_dim 64 and 256 only")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    options = parser.parse_args(argv)

    def progress(done: int, total: int) -> None:  # a counter on a terminal, one line in a log
        if sys.stderr.isatty():
            print(f"\rcompiling for {options.arch}: {done}/{total}", end="\n" if done == total else "",
                  file=sys.stderr, flush=True)
        elif done == total:
            print(f"compiled {total} launches for {options.arch}", file=sys.stderr)

    try:
        results = check_arch(options.arch, configs(options.quick), progress)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if options.json:
        _, devices, limit = ARCHS[options.arch]
        print(json.dumps({"arch": options.arch, "devices": devices, "shared_limit": limit,
                          "results": [asdict(r) for r in results]}, indent=2))
    else:
        for r in results:
            print(f"{'ok ' if r.ok else 'NO '} {r.kernel:24s} {r.config}: "
                  + (f"shared {r.shared_bytes:,} B, {r.registers} regs" if r.shared_bytes is not None else "")
                  + (f"  ({r.problem})" if r.problem else "") + (f"refused: {r.refused}" if r.refused else ""))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
