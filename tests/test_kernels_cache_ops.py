"""write_kv and copy_blocks against their references; 64-bit offsets; GPU-only checks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvctl.kernels import (KernelArgumentError, copy_blocks, copy_blocks_ref,  # noqa: E402
                           paged_decode_attention, paged_decode_attention_ref, write_kv, write_kv_ref)
from kvctl.kernels.formats import QUANT_MAX, dequantise  # noqa: E402

from .kernel_cases import (DEVICE, make_scales, out_tolerance, representable, scattered_tables,  # noqa: E402
                           slots_for)

ALL_CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                    torch.float8_e5m2, torch.int8]
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _write_both(cache_dtype, keys, values, slots, k_scale, v_scale, shape):
    caches = []
    for fn in (write_kv, write_kv_ref):
        k_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
        v_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
        fn(keys, values, k_cache, v_cache, slots, k_scale, v_scale)
        caches.append((k_cache, v_cache))
    return caches


@pytest.mark.parametrize("cache_dtype", ALL_CACHE_DTYPES, ids=str)
def test_write_kv_matches_reference_bit_for_bit_on_representable_values(cache_dtype):
    g = torch.Generator().manual_seed(0)
    lengths, block_size, num_kv_heads, head_dim = [1, 15, 16, 17, 40], 16, 3, 80
    table = scattered_tables(lengths, block_size, 12, g)
    slots = slots_for(table, lengths, block_size)
    k_scale, v_scale = make_scales(cache_dtype, num_kv_heads, g)
    keys = representable((len(slots), num_kv_heads, head_dim), cache_dtype, k_scale, g)
    values = representable((len(slots), num_kv_heads, head_dim), cache_dtype, v_scale, g)
    (k1, v1), (k2, v2) = _write_both(cache_dtype, keys, values, slots, k_scale, v_scale,
                                     (12, block_size, num_kv_heads, head_dim))
    assert torch.equal(k1.view(torch.uint8), k2.view(torch.uint8))
    assert torch.equal(v1.view(torch.uint8), v2.view(torch.uint8))
    untouched = torch.ones(12 * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not k1.view(12 * block_size, -1)[untouched].float().abs().sum()  # nothing else written


def test_write_kv_int8_rounds_half_away_from_zero_and_clamps():
    k_scale = torch.tensor([0.5], device=DEVICE)
    key = torch.tensor([0.25, -0.25, 0.75, -0.74, 100.0, -100.0, 0.0, 63.4] + [0.0] * 56,
                       device=DEVICE).view(1, 1, 64)
    (k1, _), (k2, _) = _write_both(torch.int8, key, key, torch.tensor([3], device=DEVICE), k_scale,
                                   k_scale, (1, 8, 1, 64))
    assert k1[0, 3, 0, :8].tolist() == [1, -1, 2, -1, 127, -127, 0, 127]
    assert torch.equal(k1, k2)


INTERPRETER_FP8 = pytest.mark.skipif(
    DEVICE == "cpu", reason="the Triton CPU interpreter mis-rounds float32 -> fp8 where rounding "
    "carries into the exponent (-127.9 becomes -64); exact fp8 writes are checked above")


@pytest.mark.parametrize("cache_dtype", [
    torch.bfloat16,
    pytest.param(torch.float8_e4m3fn, marks=[pytest.mark.cuda, INTERPRETER_FP8]),
    pytest.param(torch.float8_e5m2, marks=[pytest.mark.cuda, INTERPRETER_FP8]),
], ids=str)
def test_write_kv_rounds_arbitrary_values_within_one_step_of_the_format(cache_dtype):
    """Rounding between grid points is the hardware's (the CPU interpreter truncates bfloat16),
    so kernel and reference agree to one step of the format's mantissa."""
    g = torch.Generator().manual_seed(1)
    k_scale, v_scale = make_scales(cache_dtype, 2, g)
    keys = torch.randn((20, 2, 64), generator=g).to(DEVICE)
    slots = torch.arange(20, device=DEVICE)
    (k1, _), (k2, _) = _write_both(cache_dtype, keys, keys, slots, k_scale, v_scale, (3, 8, 2, 64))
    step = {torch.bfloat16: 2.0 ** -7, torch.float8_e4m3fn: 2.0 ** -3, torch.float8_e5m2: 2.0 ** -2}
    got = dequantise(k1, k_scale) if k_scale is not None else k1.float()
    want = dequantise(k2, k_scale) if k_scale is not None else k2.float()
    subnormal = 0.0 if k_scale is None else float(k_scale.max()) * 2.0 ** -6
    torch.testing.assert_close(got, want, rtol=step[cache_dtype], atol=subnormal + 1e-12)


def test_copy_blocks_matches_reference_and_copies_whole_blocks():
    g = torch.Generator().manual_seed(2)
    shape = (10, 16, 2, 64)
    k = torch.randn(shape, generator=g).to(DEVICE)
    v = torch.randn(shape, generator=g).to(DEVICE)
    src = torch.tensor([0, 3, 9], device=DEVICE)
    dst = torch.tensor([5, 1, 2], device=DEVICE)
    k_ref, v_ref = k.clone(), v.clone()
    copy_blocks(k, v, src, dst)
    copy_blocks_ref(k_ref, v_ref, src, dst)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert torch.equal(k[5], k[0]) and torch.equal(v[2], v[9])


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8], ids=str)
def test_copy_blocks_copies_one_byte_formats_bit_for_bit(cache_dtype):
    """One-byte caches are copied as bytes (no fp8 arithmetic, so an A100 copies fp8 blocks too)."""
    g = torch.Generator().manual_seed(3)
    k = torch.randint(-128, 128, (6, 8, 2, 64), generator=g, dtype=torch.int8).view(cache_dtype).to(DEVICE)
    v = torch.randint(-128, 128, (6, 8, 2, 64), generator=g, dtype=torch.int8).view(cache_dtype).to(DEVICE)
    k_ref, v_ref = k.clone(), v.clone()
    copy_blocks(k, v, torch.tensor([4, 0], device=DEVICE), torch.tensor([1, 5], device=DEVICE))
    copy_blocks_ref(k_ref, v_ref, torch.tensor([4, 0], device=DEVICE), torch.tensor([1, 5], device=DEVICE))
    assert k.dtype == cache_dtype
    assert torch.equal(k.view(torch.int8), k_ref.view(torch.int8)) and torch.equal(v.view(torch.int8),
                                                                                   v_ref.view(torch.int8))
    assert torch.equal(k[1].view(torch.int8), k[4].view(torch.int8))


@pytest.mark.parametrize("src, dst, message", [
    ([0, 1], [2, 2], "dst: a destination block appears twice"),
    ([0, 1], [1, 2], "dst: a destination block is also a source"),
    ([0], [10], "src: block ids must lie in [0, 10)"),
])
def test_copy_blocks_refuses_unsafe_pairs(src, dst, message):
    k = torch.zeros((10, 8, 1, 64), device=DEVICE)
    with pytest.raises(KernelArgumentError) as info:
        copy_blocks(k, k.clone(), torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE))
    assert str(info.value) == message


def _big_cache_case(fn_write, fn_decode):
    """Blocks past 2**31 elements: a 32-bit offset would wrap and read the wrong block."""
    block_size, head_dim = 16, 64
    num_blocks = 2**31 // (block_size * head_dim) + 4  # int8: about 2 GiB, never touched but here
    big_k = torch.empty((num_blocks, block_size, 1, head_dim), dtype=torch.int8, device=DEVICE)
    big_v = torch.empty_like(big_k)
    small_k = torch.zeros((3, block_size, 1, head_dim), dtype=torch.int8, device=DEVICE)
    small_v = torch.zeros_like(small_k)
    g = torch.Generator().manual_seed(3)
    keys = torch.randn((40, 1, head_dim), generator=g).to(DEVICE)
    values = torch.randn((40, 1, head_dim), generator=g).to(DEVICE)
    scale = torch.tensor([0.03], device=DEVICE)
    far = [num_blocks - 1, num_blocks - 3, num_blocks - 2]  # offsets > 2**31 elements
    positions = torch.arange(40, device=DEVICE)
    big_slots = torch.tensor(far, device=DEVICE)[positions // block_size] * block_size + positions % block_size
    fn_write(keys, values, big_k, big_v, big_slots, scale, scale)
    write_kv_ref(keys, values, small_k, small_v, positions, scale, scale)
    q = torch.randn((1, 4, head_dim), generator=g).to(DEVICE)
    lens = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    far_out = fn_decode(q, big_k, big_v, torch.tensor([far], dtype=torch.int32, device=DEVICE), lens,
                        scale=0.125, k_scale=scale, v_scale=scale)
    near_out = paged_decode_attention_ref(q, small_k, small_v,
                                          torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEVICE),
                                          lens, scale=0.125, k_scale=scale, v_scale=scale)
    torch.testing.assert_close(far_out, near_out, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU variant of the 64-bit offset check")
def test_reference_path_handles_offsets_past_32_bits():
    _big_cache_case(write_kv_ref, paged_decode_attention_ref)


@cuda
@needs_cuda
def test_kernels_handle_offsets_past_32_bits_on_gpu():
    _big_cache_case(write_kv, paged_decode_attention)


@cuda
@needs_cuda
@pytest.mark.parametrize("cache_dtype", ALL_CACHE_DTYPES, ids=str)
def test_gpu_decode_long_contexts_against_reference(cache_dtype):
    g = torch.Generator().manual_seed(4)
    block_size, num_kv_heads, group, head_dim = 16, 8, 4, 128
    lengths = [1, 15, 16, 17, 4099, 32768]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 64
    table = scattered_tables(lengths, block_size, num_blocks, g)
    k_scale, v_scale = make_scales(cache_dtype, num_kv_heads, g)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    tokens = sum(lengths)
    keys = representable((tokens, num_kv_heads, head_dim), cache_dtype, k_scale, g)
    values = representable((tokens, num_kv_heads, head_dim), cache_dtype, v_scale, g)
    write_kv(keys, values, k_cache, v_cache, slots_for(table, lengths, block_size), k_scale, v_scale)
    q_dtype = torch.bfloat16 if cache_dtype not in (torch.float32, torch.float16) else cache_dtype
    q = torch.randn((len(lengths), num_kv_heads * group, head_dim), generator=g).to(q_dtype).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    kwargs = dict(scale=head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale)
    out = paged_decode_attention(q, k_cache, v_cache, table, lens, **kwargs)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, **kwargs)
    tol = {torch.float32: 1e-4, torch.float16: 2e-3}.get(q_dtype, 1.6e-2)
    torch.testing.assert_close(out.float(), ref.float(), **out_tolerance(q_dtype, v_cache, v_scale, base=tol))
    assert QUANT_MAX  # formats table loaded


@cuda
@needs_cuda
def test_decode_and_prefill_replay_from_a_cuda_graph():
    """`kvctl bench kernels --timer graph` replays the kernels from a CUDA graph: their launchers
    must not synchronise with the host, and a replay must compute from the inputs' current
    values (new queries give the eager call's new output)."""
    from kvctl.bench_kernels import capture_calls, paged_case
    from kvctl.kernels import paged_prefill_attention

    case = paged_case("llama3-8b", "bfloat16", 16, 3, 300, "cuda")
    q = torch.randn((3, 32, 128), device="cuda", dtype=torch.bfloat16)
    qp = torch.randn((3 * 20, 32, 128), device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, 61, 20, dtype=torch.int32, device="cuda")

    def decode():
        return paged_decode_attention(q, case.k, case.v, case.tables, case.lens, scale=0.088, max_context=300)

    def prefill():
        return paged_prefill_attention(qp, case.k, case.v, case.tables, qsl, case.lens, scale=0.088,
                                       max_new_tokens=20)

    for fn, query in ((decode, q), (prefill, qp)):
        fn()
        torch.cuda.synchronize()
        graph, replayed = capture_calls(fn, 2)
        query.copy_(torch.randn_like(query))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, fn())
