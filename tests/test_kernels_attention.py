"""Paged attention kernels against their torch references (CPU: TRITON_INTERPRET=1), the
references against scaled_dot_product_attention, and quantised caches against float ones."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from kvctl.kernels import (DecodeLaunch, KernelArgumentError, PrefillLaunch, is_quantised,  # noqa: E402
                           paged_attention_torch, paged_decode_attention,
                           paged_decode_attention_ref, paged_prefill_attention,
                           paged_prefill_attention_ref, quantise, write_kv_ref)
from kvctl.kernels.decode import gather_sequence  # noqa: E402
from kvctl.kernels.formats import dequantise  # noqa: E402

from .kernel_cases import (DEVICE, OUT_TOL, make_scales, out_tolerance, ragged_lengths, representable,  # noqa: E402
                           scattered_tables, slots_for)

ALL_CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                    torch.float8_e5m2, torch.int8]


def cpu_paged_caches(cache_dtype, blocks=80, block=16, kv_heads=2, dim=64):
    """Random K and V caches of a dtype for the CPU path, with the scale kwargs int8 needs."""
    shape = (blocks, block, kv_heads, dim)
    if cache_dtype == torch.int8:
        scales = dict(k_scale=torch.linspace(0.02, 0.03, kv_heads), v_scale=torch.linspace(0.01, 0.04, kv_heads))
        return (torch.randint(-127, 128, shape, dtype=torch.int8), torch.randint(-127, 128, shape, dtype=torch.int8),
                scales)
    return torch.randn(shape).to(cache_dtype), torch.randn(shape).to(cache_dtype), {}


def query_dtype(cache_dtype):
    return torch.bfloat16 if is_quantised(cache_dtype) else cache_dtype


def build(cache_dtype, *, block_size=16, num_kv_heads=2, group=4, head_dim=64, lengths=None,
          seed=0, spare_blocks=5):
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or ragged_lengths(block_size, 3 * block_size + 5)
    num_blocks = sum(-(-n // block_size) for n in lengths) + spare_blocks
    table = scattered_tables(lengths, block_size, num_blocks, g)
    k_scale, v_scale = make_scales(cache_dtype, num_kv_heads, g)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
    v_cache = torch.zeros(shape, dtype=cache_dtype, device=DEVICE)
    tokens = sum(lengths)
    keys = representable((tokens, num_kv_heads, head_dim), cache_dtype, k_scale, g)
    values = representable((tokens, num_kv_heads, head_dim), cache_dtype, v_scale, g)
    write_kv_ref(keys, values, k_cache, v_cache, slots_for(table, lengths, block_size), k_scale, v_scale)
    return dict(k_cache=k_cache, v_cache=v_cache, block_tables=table, k_scale=k_scale,
                v_scale=v_scale, lengths=lengths, heads=num_kv_heads * group, head_dim=head_dim,
                generator=g)


def decode_inputs(case, q_dtype):
    q = torch.randn((len(case["lengths"]), case["heads"], case["head_dim"]),
                    generator=case["generator"]).to(q_dtype).to(DEVICE)
    lens = torch.tensor(case["lengths"], dtype=torch.int32, device=DEVICE)
    return q, lens


def run_decode(fn, case, q, lens, **extra):
    return fn(q, case["k_cache"], case["v_cache"], case["block_tables"], lens,
              scale=case["head_dim"] ** -0.5, k_scale=case["k_scale"], v_scale=case["v_scale"], **extra)


# ---- decode ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", ALL_CACHE_DTYPES, ids=str)
def test_decode_kernel_matches_reference_for_every_cache_dtype(cache_dtype):
    case = build(cache_dtype)
    q, lens = decode_inputs(case, query_dtype(cache_dtype))
    out = run_decode(paged_decode_attention, case, q, lens)
    ref = run_decode(paged_decode_attention_ref, case, q, lens)
    torch.testing.assert_close(out.float(), ref.float(), **out_tolerance(q.dtype, case["v_cache"], case["v_scale"]))


@pytest.mark.parametrize("num_kv_heads, group", [(4, 1), (2, 4), (1, 8), (1, 16)],
                         ids=["mha", "gqa4", "gqa8-mqa", "mqa16"])
def test_decode_kernel_gqa_and_mqa(num_kv_heads, group):
    case = build(torch.float16, num_kv_heads=num_kv_heads, group=group, seed=1)
    q, lens = decode_inputs(case, torch.float16)
    torch.testing.assert_close(run_decode(paged_decode_attention, case, q, lens).float(),
                               run_decode(paged_decode_attention_ref, case, q, lens).float(),
                               **OUT_TOL[torch.float16])


@pytest.mark.parametrize("tile_bytes, heads_per_program", [(16 * 64 * 4, 16), (32 * 64 * 4, 32)])
def test_decode_splits_a_wide_query_group_across_programs(monkeypatch, tile_bytes, heads_per_program):
    """When one KV head's query tile would pass QUERY_TILE_BYTES, its heads are shared out in
    chunks (2 programs of 16 heads, or 1 of 32 here, for 32 heads on one KV head); every head
    still gets its own output."""
    import kvctl.kernels.decode as decode

    monkeypatch.setattr(decode, "QUERY_TILE_BYTES", tile_bytes)
    assert decode._heads_per_program(32, 64, dot_f32=True) == heads_per_program
    case = build(torch.float32, num_kv_heads=2, group=32, seed=4, lengths=[1, 17, 40])
    q, lens = decode_inputs(case, torch.float32)
    torch.testing.assert_close(run_decode(paged_decode_attention, case, q, lens),
                               run_decode(paged_decode_attention_ref, case, q, lens),
                               **OUT_TOL[torch.float32])


def test_a_query_group_is_split_only_past_the_tile_budget():
    from kvctl.kernels.decode import _heads_per_program

    assert _heads_per_program(8, 128, dot_f32=False) == 16  # padded up to tl.dot's 16 rows
    assert _heads_per_program(64, 128, dot_f32=False) == 64  # 64 x 128 x 2 bytes = 16 KiB: whole
    assert _heads_per_program(64, 256, dot_f32=False) == 32  # 32 KiB: split in two
    assert _heads_per_program(64, 256, dot_f32=True) == 16  # 64 KiB: split in four
    assert _heads_per_program(128, 80, dot_f32=True) == 32  # head_dim 80 takes 128 lanes


@pytest.mark.parametrize("head_dim", [80, 96, 128, 256])
def test_decode_kernel_head_dims(head_dim):
    case = build(torch.bfloat16, head_dim=head_dim, num_kv_heads=1, group=2, seed=2,
                 lengths=[1, 15, 16, 17, 40])
    q, lens = decode_inputs(case, torch.bfloat16)
    torch.testing.assert_close(run_decode(paged_decode_attention, case, q, lens).float(),
                               run_decode(paged_decode_attention_ref, case, q, lens).float(),
                               **OUT_TOL[torch.bfloat16])


@pytest.mark.parametrize("block_size", [8, 32, 256])
def test_decode_kernel_block_sizes(block_size):
    case = build(torch.float32, block_size=block_size, num_kv_heads=1, group=4, seed=3,
                 lengths=ragged_lengths(block_size, 2 * block_size + 3))
    q, lens = decode_inputs(case, torch.float32)
    torch.testing.assert_close(run_decode(paged_decode_attention, case, q, lens),
                               run_decode(paged_decode_attention_ref, case, q, lens),
                               **OUT_TOL[torch.float32])


def test_decode_split_merge_is_exact_whatever_the_partition():
    case = build(torch.float32, lengths=[1, 33, 130, 257], seed=4)
    q, lens = decode_inputs(case, torch.float32)
    ref = run_decode(paged_decode_attention_ref, case, q, lens)
    for partition in (32, 64, 288):  # many splits, some empty for short sequences; one split
        out = run_decode(paged_decode_attention, case, q, lens, partition_size=partition,
                         launch=DecodeLaunch(tile=32))
        torch.testing.assert_close(out, ref, **OUT_TOL[torch.float32])
    with pytest.raises(KernelArgumentError, match="partition_size: must be a positive multiple of 64, got 96"):
        run_decode(paged_decode_attention, case, q, lens, partition_size=96)


def test_decode_with_one_split_writes_the_output_in_one_launch(monkeypatch):
    """One partition covering every context: the partial kernel normalises and writes the output
    itself, and the merge kernel is not launched; several partitions still merge."""
    import kvctl.kernels.decode as decode

    case = build(torch.float32, lengths=[1, 33, 130, 257], seed=4)
    q, lens = decode_inputs(case, torch.float32)
    ref = run_decode(paged_decode_attention_ref, case, q, lens)
    merges, merge_kernel = [], decode._decode_merge_kernel

    class CountingMerge:  # kernel[grid](...) as before, noting the grid
        def __getitem__(self, grid):
            merges.append(grid)
            return merge_kernel[grid]

    monkeypatch.setattr(decode, "_decode_merge_kernel", CountingMerge())
    one = run_decode(paged_decode_attention, case, q, lens, partition_size=288, launch=DecodeLaunch(tile=32))
    assert merges == []
    several = run_decode(paged_decode_attention, case, q, lens, partition_size=64, launch=DecodeLaunch(tile=32))
    assert merges == [(4, case["heads"])]  # one merge program per (sequence, query head)
    merged = run_decode(paged_decode_attention, case, q, lens, partition_size=288,
                        launch=DecodeLaunch(tile=32, direct_write=0))
    assert merges == [(4, case["heads"])] * 2  # direct_write=0: one split is merged too
    for out in (one, several, merged):
        torch.testing.assert_close(out, ref, **OUT_TOL[torch.float32])


@pytest.mark.parametrize("launch", [DecodeLaunch(tile=16, programs_per_sm=8), DecodeLaunch(tile=32, fp16_dot=1),
                                    DecodeLaunch(tile=128, num_warps=8, num_stages=2, programs_per_sm=1,
                                                 fp16_dot=0)],
                         ids=["tile16", "tile32-fp16", "tile128-query-dtype"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn], ids=str)
def test_decode_kernel_matches_reference_at_every_launch(launch, cache_dtype):
    """Tiles smaller and larger than a block, and than the shortest contexts: the launch changes
    speed, never the answer (the scale folding of quantised caches included)."""
    case = build(cache_dtype, seed=6)
    q, lens = decode_inputs(case, torch.bfloat16)
    torch.testing.assert_close(run_decode(paged_decode_attention, case, q, lens, launch=launch).float(),
                               run_decode(paged_decode_attention_ref, case, q, lens).float(),
                               **out_tolerance(torch.bfloat16, case["v_cache"], case["v_scale"]))


@pytest.mark.parametrize("launch_class, field, value, message", [
    (DecodeLaunch, "tile", 24, "launch.tile: must be a power of two of at least 16, got 24"),
    (DecodeLaunch, "num_warps", 3, "launch.num_warps: must be 1, 2, 4, 8 or 16, got 3"),
    (DecodeLaunch, "programs_per_sm", 0, "launch.programs_per_sm: must be at least 1, got 0"),
    (DecodeLaunch, "fp16_dot", 2, "launch.fp16_dot: must be 0 or 1, got 2"),
    (DecodeLaunch, "direct_write", 2, "launch.direct_write: must be 0 or 1, got 2"),
    (PrefillLaunch, "rows", 8, "launch.rows: must be a power of two of at least 16, got 8"),
    (PrefillLaunch, "num_stages", 0, "launch.num_stages: must be at least 1, got 0"),
], ids=["decode-tile", "decode-num_warps", "decode-programs_per_sm", "decode-fp16_dot", "decode-direct_write",
        "prefill-rows", "prefill-num_stages"])
def test_launch_settings_are_checked_by_name(launch_class, field, value, message):
    with pytest.raises(KernelArgumentError, match=message):
        launch_class(**{field: value})


def test_launches_shrink_to_fit_the_smaller_gpus_shared_memory():
    """float32 at head_dim 256 needed 148 KiB (decode, 64-token tile) and 136 KiB (prefill, 64
    rows) of shared memory, past sm_89's 99 KiB: those tiles are halved; bf16 keeps the defaults."""
    from kvctl.kernels.decode import step_fits

    assert DecodeLaunch().fitted(16, 256, dot_f32=True) == DecodeLaunch(tile=32)
    assert DecodeLaunch().fitted(32, 256, dot_f32=False) == DecodeLaunch()
    assert DecodeLaunch(tile=128).fitted(16, 128, dot_f32=False) == DecodeLaunch(tile=128)
    assert PrefillLaunch().fitted(256, dot_f32=True) == PrefillLaunch(rows=16, tile=32)
    assert PrefillLaunch().fitted(256, dot_f32=False) == PrefillLaunch()
    assert PrefillLaunch(rows=16, tile=128).fitted(256, dot_f32=True) == PrefillLaunch(rows=16, tile=32)
    assert step_fits(16, 32, 256, dot_f32=True) and not step_fits(16, 64, 256, dot_f32=True)


# ---- prefill -----------------------------------------------------------------------------------
def prefill_inputs(case, new_tokens, q_dtype):
    starts = [0]
    for n in new_tokens:
        starts.append(starts[-1] + n)
    q = torch.randn((starts[-1], case["heads"], case["head_dim"]), generator=case["generator"])
    return (q.to(q_dtype).to(DEVICE), torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            torch.tensor(case["lengths"], dtype=torch.int32, device=DEVICE))


def run_prefill(fn, case, q, qsl, lens, **extra):
    return fn(q, case["k_cache"], case["v_cache"], case["block_tables"], qsl, lens,
              scale=case["head_dim"] ** -0.5, k_scale=case["k_scale"], v_scale=case["v_scale"], **extra)


def assert_torch_path_matches_references(case, q_dtype, new_rows, q_factor: float = 1.0, **options):
    """paged_attention_torch against paged_prefill_attention_ref on `case`, once for each list of
    new tokens per sequence in `new_rows` (decodes, decode rows of a few tokens, prompt chunks,
    mixed), the queries times `q_factor`, with `options` (window, softcap, sinks)."""
    extra = dict(scale=case["head_dim"] ** -0.5, k_scale=case["k_scale"], v_scale=case["v_scale"], **options)
    tables = (case["k_cache"], case["v_cache"], case["block_tables"])
    for new in new_rows:
        q, qsl, lens = prefill_inputs(case, new, q_dtype)
        got = paged_attention_torch(q * q_factor, *tables, qsl, lens, **extra)
        want = paged_prefill_attention_ref(q * q_factor, *tables, qsl, lens, **extra)
        torch.testing.assert_close(got.float(), want.float(), **OUT_TOL[q_dtype])


def assert_kernels_match_references(case, q_dtype, new, q_factor: float = 1.0, **options):
    """The Triton decode kernel (one split writing its output, then several merged) and prefill
    kernel (two launches; `new` tokens per sequence) against their references on `case`, the
    queries times `q_factor`, with `options` (window, softcap, sinks)."""
    tol = out_tolerance(q_dtype, case["v_cache"], case["v_scale"])
    q, lens = decode_inputs(case, q_dtype)
    q = q * q_factor
    want = run_decode(paged_decode_attention_ref, case, q, lens, **options).float()
    for extra in ({}, dict(partition_size=16, launch=DecodeLaunch(tile=16))):
        torch.testing.assert_close(run_decode(paged_decode_attention, case, q, lens, **options, **extra).float(),
                                   want, **tol)
    qp, qsl, _ = prefill_inputs(case, new, q_dtype)
    qp = qp * q_factor
    want = run_prefill(paged_prefill_attention_ref, case, qp, qsl, lens, **options).float()
    for launch in (PrefillLaunch(), PrefillLaunch(rows=16, tile=16)):
        got = run_prefill(paged_prefill_attention, case, qp, qsl, lens, launch=launch, **options).float()
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, **tol)


def assert_cascade_matches_the_reference(rows: int = 1, q_factor: float = 1.0, **options) -> None:
    """Three sequences decoding `rows` new tokens each, two of them sharing six cached blocks (so
    the CPU path attends that prefix once for both and merges by log-sum-exp), the third apart:
    paged_attention_torch against paged_prefill_attention_ref with `options` (softcap, sinks)."""
    from kvctl.kernels.torch_paged import plan_decode

    torch.manual_seed(5)
    block, heads, kv_heads, dim = 16, 4, 2, 64
    k_cache = torch.randn(64, block, kv_heads, dim)
    v_cache = torch.randn(64, block, kv_heads, dim)
    shared = list(range(10, 16))
    tables = [shared + [30, 31], shared + [32], [60, 61, 62]]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor([7 * 16 + 5, 6 * 16 + 16, 40], dtype=torch.int32)
    assert [g.members for g in plan_decode(table, lens, block).groups] == [[0, 1]]
    q = torch.randn(3 * rows, heads, dim) * q_factor
    starts = torch.arange(0, 3 * rows + 1, rows, dtype=torch.int32)
    got = paged_attention_torch(q, k_cache, v_cache, table, starts, lens, scale=dim ** -0.5, max_new_tokens=rows,
                                **options)
    want = paged_prefill_attention_ref(q, k_cache, v_cache, table, starts, lens, scale=dim ** -0.5, **options)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def attention_by_hand(q, k, v, scale, positions, window, weights):
    """q [n, H, D] at `positions`, k/v [t, Hkv, D]: each head's and row's output written out one
    at a time, `weights(scores, head)` making the weights of the keys the row sees (the last
    `window` of them, or all) from their scaled scores."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for head in range(q.shape[1]):
        keys, values = k[:, head // group].float(), v[:, head // group].float()
        for row, position in enumerate(positions):
            lo = 0 if window is None else max(0, position - window + 1)
            s = keys[lo:position + 1] @ q[row, head].float() * scale
            out[row, head] = weights(s, head) @ values[lo:position + 1]
    return out


@pytest.mark.parametrize("launch", [PrefillLaunch(rows=16, tile=16), PrefillLaunch(rows=32, tile=64),
                                    PrefillLaunch(rows=128, tile=32, num_warps=8)],
                         ids=["rows16-tile16", "rows32-tile64", "rows128"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e5m2], ids=str)
def test_prefill_kernel_matches_reference_at_every_launch(launch, cache_dtype):
    case = build(cache_dtype, lengths=PREFILL_LENGTHS, seed=7)
    q, qsl, lens = prefill_inputs(case, PREFILL_NEW, torch.bfloat16)
    torch.testing.assert_close(run_prefill(paged_prefill_attention, case, q, qsl, lens, launch=launch).float(),
                               run_prefill(paged_prefill_attention_ref, case, q, qsl, lens).float(),
                               **out_tolerance(torch.bfloat16, case["v_cache"], case["v_scale"]))


# (context lengths, new tokens): a full prompt, prefix hits of B-1, B and B+1 tokens, a chunk.
PREFILL_LENGTHS = [1, 20, 21, 34, 60]
PREFILL_NEW = [1, 20, 5, 17, 40]


@pytest.mark.parametrize("cache_dtype", ALL_CACHE_DTYPES, ids=str)
def test_prefill_kernel_matches_reference_for_every_cache_dtype(cache_dtype):
    case = build(cache_dtype, lengths=PREFILL_LENGTHS, seed=5)
    q, qsl, lens = prefill_inputs(case, PREFILL_NEW, query_dtype(cache_dtype))
    torch.testing.assert_close(run_prefill(paged_prefill_attention, case, q, qsl, lens).float(),
                               run_prefill(paged_prefill_attention_ref, case, q, qsl, lens).float(),
                               **out_tolerance(q.dtype, case["v_cache"], case["v_scale"]))


@pytest.mark.parametrize("num_kv_heads, group, head_dim, block_size",
                         [(4, 1, 64, 8), (1, 8, 96, 32), (2, 4, 128, 16), (1, 2, 80, 256)])
def test_prefill_kernel_shapes(num_kv_heads, group, head_dim, block_size):
    case = build(torch.float16, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                 block_size=block_size, lengths=PREFILL_LENGTHS, seed=6)
    q, qsl, lens = prefill_inputs(case, PREFILL_NEW, torch.float16)
    torch.testing.assert_close(run_prefill(paged_prefill_attention, case, q, qsl, lens).float(),
                               run_prefill(paged_prefill_attention_ref, case, q, qsl, lens).float(),
                               **OUT_TOL[torch.float16])


def test_prefill_of_a_chunk_equals_the_same_rows_of_a_full_prefill():
    case = build(torch.float32, lengths=[48], seed=7)
    q_full, qsl_full, lens = prefill_inputs(case, [48], torch.float32)
    full = run_prefill(paged_prefill_attention, case, q_full, qsl_full, lens)
    chunk = run_prefill(paged_prefill_attention, case, q_full[30:].contiguous(),
                        torch.tensor([0, 18], dtype=torch.int32, device=DEVICE), lens)
    torch.testing.assert_close(chunk, full[30:], **OUT_TOL[torch.float32])


# ---- the references against torch's own attention ----------------------------------------------
def test_decode_reference_matches_sdpa_on_contiguous_kv():
    case = build(torch.float32, num_kv_heads=2, group=4, seed=8)
    q, lens = decode_inputs(case, torch.float32)
    ref = run_decode(paged_decode_attention_ref, case, q, lens)
    for seq, length in enumerate(case["lengths"]):
        k = gather_sequence(case["k_cache"], case["block_tables"][seq], length, None)
        v = gather_sequence(case["v_cache"], case["block_tables"][seq], length, None)
        expected = F.scaled_dot_product_attention(
            q[seq][None, :, None, :], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            scale=case["head_dim"] ** -0.5, enable_gqa=True)[0, :, 0, :]
        torch.testing.assert_close(ref[seq], expected, atol=1e-5, rtol=1e-5)


def test_prefill_reference_matches_sdpa_with_a_prefix_mask():
    case = build(torch.float32, lengths=PREFILL_LENGTHS, seed=9)
    q, qsl, lens = prefill_inputs(case, PREFILL_NEW, torch.float32)
    ref = run_prefill(paged_prefill_attention_ref, case, q, qsl, lens)
    for seq, (length, new) in enumerate(zip(PREFILL_LENGTHS, PREFILL_NEW)):
        k = gather_sequence(case["k_cache"], case["block_tables"][seq], length, None)
        v = gather_sequence(case["v_cache"], case["block_tables"][seq], length, None)
        rows = q[int(qsl[seq]):int(qsl[seq + 1])]
        visible = (torch.arange(length, device=DEVICE)[None, :]
                   <= (length - new + torch.arange(new, device=DEVICE))[:, None])
        expected = F.scaled_dot_product_attention(
            rows.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=visible, scale=case["head_dim"] ** -0.5, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(ref[int(qsl[seq]):int(qsl[seq + 1])], expected, atol=1e-5, rtol=1e-5)


# ---- quantised caches against the unquantised result --------------------------------------------
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8], ids=str)
def test_quantised_decode_stays_within_the_bound_its_rounding_implies(cache_dtype):
    """With per-key score error ds and per-value error dv, softmax weights move by at most a
    factor exp(2 ds), so |out_q - out| <= dv + (exp(2 ds) - 1) * max|v| (plus bf16 rounding)."""
    g = torch.Generator().manual_seed(10)
    block_size, num_kv_heads, group, head_dim, length = 16, 2, 4, 64, 70
    keys = torch.randn((length, num_kv_heads, head_dim), generator=g).to(DEVICE)
    values = torch.randn((length, num_kv_heads, head_dim), generator=g).to(DEVICE)
    q = torch.randn((1, num_kv_heads * group, head_dim), generator=g).to(DEVICE)
    scales = [t.abs().amax(dim=(0, 2)) / (448.0 if cache_dtype != torch.int8 else 127.0)
              for t in (keys, values)]
    if cache_dtype == torch.float8_e5m2:
        scales = [t.abs().amax(dim=(0, 2)) / 57344.0 for t in (keys, values)]
    k_scale, v_scale = (s.float().contiguous() for s in scales)
    table = torch.arange(5, dtype=torch.int32, device=DEVICE)[None]
    lens = torch.tensor([length], dtype=torch.int32, device=DEVICE)
    slots = torch.arange(length, device=DEVICE)
    outs = {}
    for dtype, ks, vs in ((torch.float32, None, None), (cache_dtype, k_scale, v_scale)):
        kc = torch.zeros((5, block_size, num_kv_heads, head_dim), dtype=dtype, device=DEVICE)
        vc = torch.zeros_like(kc)
        write_kv_ref(keys, values, kc, vc, slots, ks, vs)
        outs[dtype] = paged_decode_attention(q.to(torch.bfloat16) if ks is not None else q, kc, vc,
                                             table, lens, scale=head_dim ** -0.5, k_scale=ks,
                                             v_scale=vs).float()
    dk = (keys - dequantise(quantise(keys, k_scale, cache_dtype), k_scale)).abs().amax(dim=0)
    dv = (values - dequantise(quantise(values, v_scale, cache_dtype), v_scale)).abs().max()
    q_kv = q[0].float().abs().view(num_kv_heads, group, head_dim)
    ds = head_dim ** -0.5 * float((q_kv * dk[:, None, :]).sum(-1).max())
    bound = float(dv) + (math.exp(2 * ds) - 1) * float(values.abs().max()) + 2e-2  # + bf16 query
    error = float((outs[cache_dtype] - outs[torch.float32]).abs().max())
    assert error <= bound
    assert error > 0  # the comparison is not vacuous: quantisation changed the result


# ---- argument checks ---------------------------------------------------------------------------
def test_launchers_name_the_bad_argument():
    case = build(torch.float16, lengths=[5, 9], seed=11)
    q, lens = decode_inputs(case, torch.float16)
    good = dict(scale=0.125)
    k, v, table = case["k_cache"], case["v_cache"], case["block_tables"]
    cases = [
        (lambda: paged_decode_attention(q, k, v, table.long(), lens, **good),
         "block_tables: expected dtype int32, got int64"),
        (lambda: paged_decode_attention(q, k, v, table, lens[:1], **good),
         "context_lens: 1 lengths for 2 sequences"),
        (lambda: paged_decode_attention(q, k.transpose(1, 2), v, table, lens, **good),
         "k_cache: must be contiguous"),
        (lambda: paged_decode_attention(q[:, :3].contiguous(), k, v, table, lens, **good),
         "q: 3 heads is not a multiple of the cache's 2 KV heads"),
        (lambda: paged_decode_attention(q, k, v, table, lens, k_scale=torch.ones(2, device=DEVICE), **good),
         "k_scale: given for an unquantised torch.float16 cache"),
        (lambda: paged_decode_attention(q, k.to(torch.int8), v.to(torch.int8), table, lens, **good),
         "k_scale: required for a torch.int8 cache"),
        (lambda: paged_decode_attention(q[..., :48].contiguous(), k[..., :48].contiguous(),
                                        v[..., :48].contiguous(), table, lens, **good),
         "k_cache: head_dim 48 unsupported"),
        (lambda: paged_prefill_attention(q, k, v, table, lens, lens, **good),
         "query_start_loc: expected 3 entries (num_seqs + 1), got 2"),
    ]
    for call, message in cases:
        with pytest.raises(KernelArgumentError) as info:
            call()
        assert str(info.value).startswith(message), (str(info.value), message)


def test_the_decode_plan_serves_every_layer_of_a_step_and_never_hides_a_bad_argument():
    """The launcher checks and plans once per distinct (shapes, dtypes, strides, devices, context
    length) and reuses the plan for the next layer: each layer's own K/V are read (the plan holds
    no data), and an argument whose metadata differs is checked again and named."""
    from kvctl.kernels import decode

    decode._PLANS.entries.clear()
    layers = [build(torch.float16, lengths=[5, 9, 40], seed=seed) for seed in (21, 22)]
    q, lens = decode_inputs(layers[0], torch.float16)
    for case in layers:  # two layers of one step: one plan
        out = run_decode(paged_decode_attention, case, q, lens, max_context=40)
        want = run_decode(paged_decode_attention_ref, case, q, lens)
        torch.testing.assert_close(out.float(), want.float(), **OUT_TOL[torch.float16])
    assert len(decode._PLANS.entries) == 1
    k, v, table = layers[1]["k_cache"], layers[1]["v_cache"], layers[1]["block_tables"]
    bad = [(lambda: paged_decode_attention(q, k, v.to(torch.float32), table, lens, scale=0.1, max_context=40),
            "v_cache: dtype torch.float32 differs from k_cache torch.float16"),
           (lambda: paged_decode_attention(q, k.transpose(1, 2), v, table, lens, scale=0.1, max_context=40),
            "k_cache: must be contiguous"),
           (lambda: paged_decode_attention(q, k, v, table, lens, scale=0.1, max_context=0),
            "context_lens: every sequence needs at least one token")]
    for call, message in bad:
        with pytest.raises(KernelArgumentError) as info:
            call()
        assert str(info.value).startswith(message), (str(info.value), message)
    assert len(decode._PLANS.entries) == 1  # a refused call plans nothing


def test_write_and_prefill_check_once_per_step_and_still_name_a_bad_argument():
    import importlib

    from kvctl.kernels import prefill, write_kv

    from .kernel_cases import slots_for

    write_module = importlib.import_module("kvctl.kernels.write_kv")  # the package's write_kv is the function
    write_module._CHECKED.entries.clear()
    prefill._CHECKED.entries.clear()
    layers = [build(torch.float16, lengths=[5, 9], seed=seed) for seed in (31, 32)]
    q, lens = decode_inputs(layers[0], torch.float16)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    key = torch.randn((2, 2, 64), device=DEVICE).to(torch.float16)
    slots = slots_for(layers[0]["block_tables"], [5, 9], 16)[[4, 13]]  # each sequence's last token
    for case in layers:
        write_kv(key, key, case["k_cache"], case["v_cache"], slots)
        assert torch.equal(case["k_cache"].view(-1, 2, 64)[slots], key)  # this layer's cache, written
        got = paged_prefill_attention(q, case["k_cache"], case["v_cache"], case["block_tables"], qsl, lens,
                                      scale=0.125, max_new_tokens=1)
        want = paged_prefill_attention_ref(q, case["k_cache"], case["v_cache"], case["block_tables"], qsl, lens,
                                           scale=0.125)
        torch.testing.assert_close(got.float(), want.float(), **OUT_TOL[torch.float16])
    assert len(write_module._CHECKED.entries) == 1 and len(prefill._CHECKED.entries) == 1
    k, v, table = layers[1]["k_cache"], layers[1]["v_cache"], layers[1]["block_tables"]
    with pytest.raises(KernelArgumentError, match="^slot_mapping: expected dtype int64, got int32"):
        write_kv(key, key, k, v, slots.int())
    with pytest.raises(KernelArgumentError, match=r"^query_start_loc: expected 3 entries \(num_seqs \+ 1\), got 2"):
        paged_prefill_attention(q, k, v, table, qsl[:2], lens, scale=0.125, max_new_tokens=1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu-attention", "matmul-fallback"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn], ids=str)
def test_batched_torch_path_matches_the_references(cache_dtype, fused, monkeypatch):
    from kvctl.kernels import paged_attention_torch, torch_paged

    if not fused:
        monkeypatch.setattr(torch_paged, "_FLASH_CPU", None)

    case = build(cache_dtype, lengths=PREFILL_LENGTHS, seed=12)
    q_dtype = query_dtype(cache_dtype)
    scale = case["head_dim"] ** -0.5
    extra = dict(scale=scale, k_scale=case["k_scale"], v_scale=case["v_scale"])
    # A mixed batch: decodes (one new token) and prefills of several lengths.
    q, qsl, lens = prefill_inputs(case, [1, 20, 1, 17, 40], q_dtype)
    got = paged_attention_torch(q, case["k_cache"], case["v_cache"], case["block_tables"], qsl, lens, **extra)
    want = paged_prefill_attention_ref(q, case["k_cache"], case["v_cache"], case["block_tables"], qsl, lens,
                                       **extra)
    torch.testing.assert_close(got.float(), want.float(), **OUT_TOL[q_dtype])
    q1, lens1 = decode_inputs(case, q_dtype)
    ones = torch.arange(len(PREFILL_LENGTHS) + 1, dtype=torch.int32, device=DEVICE)
    got = paged_attention_torch(q1, case["k_cache"], case["v_cache"], case["block_tables"], ones, lens1, **extra)
    want = paged_decode_attention_ref(q1, case["k_cache"], case["v_cache"], case["block_tables"], lens1, **extra)
    torch.testing.assert_close(got.float(), want.float(), **OUT_TOL[q_dtype])


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous-prefix", "scattered-prefix"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_cascade_decode_over_shared_prefixes_matches_the_reference(cache_dtype, contiguous, monkeypatch):
    """Decodes that share cached prefix blocks (two groups, plus a loner and one whose context
    ends on a block boundary) give what the per-sequence reference gives."""
    from kvctl.kernels import paged_attention_torch
    from kvctl.kernels import torch_paged
    from kvctl.kernels.torch_paged import plan_decode

    torch.manual_seed(3)
    block, heads, kv_heads, dim, blocks = 16, 4, 2, 64, 64
    q_dtype = query_dtype(cache_dtype)
    k_cache = torch.randn(blocks, block, kv_heads, dim).to(cache_dtype if cache_dtype != torch.int8 else torch.float32)
    v_cache = torch.randn(blocks, block, kv_heads, dim).to(k_cache.dtype)
    extra = {}
    if cache_dtype == torch.int8:
        k_cache = torch.randint(-127, 128, k_cache.shape, dtype=torch.int8)
        v_cache = torch.randint(-127, 128, v_cache.shape, dtype=torch.int8)
        extra = dict(k_scale=torch.tensor([0.02, 0.03]), v_scale=torch.tensor([0.01, 0.04]))
    shared_a = list(range(10, 16)) if contiguous else [40, 3, 17, 9, 33, 21]
    shared_b = list(range(20, 24)) if contiguous else [50, 51, 7, 8]
    tables = [shared_a + [30, 31], shared_a + [32], shared_b + [34, 35, 36], shared_b + [37],
              [60, 61, 62], shared_a[:5] + [38]]
    lengths = [7 * 16 + 5, 6 * 16 + 16, 4 * 16 + 40, 4 * 16 + 1, 40, 5 * 16 + 9]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    plan = plan_decode(table, lens, block)
    assert plan.prefix == [5, 5, 4, 4, 0, 5]  # a group shares what all its members share
    assert [g.members for g in plan.groups] == [[0, 1, 5], [2, 3]]
    assert [(g.start, g.end) for g in plan.groups] == [(0, 3), (3, 5)]
    assert plan.order.tolist() == [0, 1, 5, 2, 3, 4]  # members together, the loner last
    assert all((g.scattered is None) == contiguous for g in plan.groups)  # a slice of the cache when contiguous
    # suffix rows in plan order: what follows the shared prefix, padded by repeating a used block
    assert plan.suffix_tables[2].tolist() == [38, 38, 38]
    assert plan.suffix_tables[5].tolist() == [60, 61, 62]
    assert (plan.suffix_mask[2, 0, 0] == 0).sum() == 9  # the 9 keys after 5 shared blocks
    q = torch.randn(len(tables), heads, dim).to(q_dtype)
    ones = torch.arange(len(tables) + 1, dtype=torch.int32)
    got = paged_attention_torch(q, k_cache, v_cache, table, ones, lens, scale=dim ** -0.5, max_new_tokens=1,
                                **extra)
    want = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale=dim ** -0.5, **extra)
    torch.testing.assert_close(got.float(), want.float(), **OUT_TOL[q_dtype])
    # prefixes split in two parts attended at once and merged (flash-decoding on the CPU): the
    # shared length is trimmed to whole pairs of blocks, the odd block joins each member's suffix
    split = plan_decode(table, lens, block, splits=2, min_split_keys=16)
    assert [g.splits for g in split.groups] == [2, 2] and split.prefix == [4, 4, 4, 4, 0, 4]
    got = paged_attention_torch(q, k_cache, v_cache, table, ones, lens, scale=dim ** -0.5, max_new_tokens=1,
                                plan=torch_paged.AttentionPlan(None, split, []), **extra)
    torch.testing.assert_close(got.float(), want.float(), **OUT_TOL[q_dtype])
    # the same through the matmul fallback used where torch has no fused CPU attention
    monkeypatch.setattr(torch_paged, "_FLASH_CPU", None)
    got = paged_attention_torch(q, k_cache, v_cache, table, ones, lens, scale=dim ** -0.5, max_new_tokens=1,
                                **extra)
    torch.testing.assert_close(got.float(), want.float(), **OUT_TOL[q_dtype])


@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu-attention", "matmul-fallback"])
def test_torch_prefill_reads_consecutive_blocks_in_place_and_gathers_the_rest(fused, monkeypatch):
    """A prompt chunk after a cached prefix (GQA 4:2): the same K/V stored in consecutive blocks
    (read in place), in scattered ones (gathered), and in a consecutive run followed by others
    (a shared prompt, then the sequence's own blocks) give the reference's output."""
    from kvctl.kernels import paged_attention_torch, torch_paged

    if not fused:
        monkeypatch.setattr(torch_paged, "_FLASH_CPU", None)
    torch.manual_seed(5)
    block, heads, kv_heads, dim, used = 16, 4, 2, 64, 5
    k_cache = torch.randn(40, block, kv_heads, dim)
    v_cache = torch.randn(40, block, kv_heads, dim)
    consecutive = list(range(7, 7 + used))
    scattered = [31, 2, 19, 25, 11]
    k_cache[scattered], v_cache[scattered] = k_cache[consecutive], v_cache[consecutive]
    context, new = 4 * block + 9, 23  # 50 cached keys, then 23 new rows
    q = torch.randn(new, heads, dim)
    qsl = torch.tensor([0, new], dtype=torch.int32)
    lens = torch.tensor([context], dtype=torch.int32)
    run_then_own = consecutive[:3] + scattered[3:]
    for table in (consecutive, scattered, run_then_own):
        tables = torch.tensor([table], dtype=torch.int32)
        got = paged_attention_torch(q, k_cache, v_cache, tables, qsl, lens, scale=dim ** -0.5)
        want = paged_prefill_attention_ref(q, k_cache, v_cache, tables, qsl, lens, scale=dim ** -0.5)
        torch.testing.assert_close(got, want, **OUT_TOL[torch.float32])


def test_a_decode_plan_is_reused_while_only_context_lengths_move():
    """The next decode step keeps the grouping when no sequence needs a new block (only the mask
    moves) and plans afresh when one does; either way attention equals the reference."""
    from kvctl.kernels import paged_attention_torch
    from kvctl.kernels.torch_paged import AttentionPlan, plan_decode

    torch.manual_seed(8)
    block, heads, kv_heads, dim = 16, 4, 2, 64
    k_cache, v_cache = torch.randn(40, block, kv_heads, dim), torch.randn(40, block, kv_heads, dim)
    shared = [3, 4, 5, 6]
    rows = [shared + [10, 11], shared + [12, 13], [20, 21]]
    table = torch.tensor([r + [0] * (6 - len(r)) for r in rows], dtype=torch.int32)
    lengths = [4 * 16 + 20, 4 * 16 + 17, 2 * 16]
    first = plan_decode(table, torch.tensor(lengths, dtype=torch.int32), block)
    moved = [lengths[0] + 1, lengths[1] + 1, lengths[2]]  # still within their last blocks
    again = plan_decode(table, torch.tensor(moved, dtype=torch.int32), block, reuse=first)
    assert again.groups is first.groups and again.suffix_tables is first.suffix_tables
    visible = (again.suffix_mask[:, 0, 0] == 0).sum(-1).tolist()
    assert visible == [(first.suffix_mask[:, 0, 0] == 0).sum(-1)[i].item() + d for i, d in enumerate([1, 1, 0])]
    grown = [lengths[0], lengths[1], lengths[2] + 1]  # the third needs a block it does not have in `first`
    table_grown = table.clone()
    table_grown[2, 2] = 22
    fresh = plan_decode(table_grown, torch.tensor(grown, dtype=torch.int32), block, reuse=first)
    assert fresh.groups is not first.groups and fresh.suffix_tables[2].tolist()[:3] == [20, 21, 22]
    q = torch.randn(3, heads, dim)
    ones = torch.arange(4, dtype=torch.int32)
    for plan, tab, lens in ((again, table, moved), (fresh, table_grown, grown)):
        lens = torch.tensor(lens, dtype=torch.int32)
        got = paged_attention_torch(q, k_cache, v_cache, tab, ones, lens, scale=dim ** -0.5,
                                    plan=AttentionPlan(None, plan, []))
        want = paged_decode_attention_ref(q, k_cache, v_cache, tab, lens, scale=dim ** -0.5)
        torch.testing.assert_close(got, want, **OUT_TOL[torch.float32])


@pytest.mark.parametrize("fused", [True, False], ids=["fused-cpu-attention", "matmul-fallback"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_decode_rows_of_several_new_tokens_match_the_prefill_reference(cache_dtype, fused, monkeypatch):
    """Sequences bringing a few new tokens each (a next token plus a speculative draft), over
    shared prefixes, give the reference's causal result row for row: uneven counts (padded at
    the front), even counts (no padding), and rows mixed with a long prompt chunk."""
    from kvctl.kernels import paged_attention_torch, torch_paged
    from kvctl.kernels.torch_paged import plan_attention

    if not fused:
        monkeypatch.setattr(torch_paged, "_FLASH_CPU", None)
    torch.manual_seed(21)
    block, heads, kv_heads, dim, blocks = 16, 4, 2, 64, 80
    q_dtype = query_dtype(cache_dtype)
    k_cache, v_cache, extra = cpu_paged_caches(cache_dtype, blocks, block, kv_heads, dim)
    shared = list(range(10, 16))
    tables = [shared + [30, 31], shared + [32], shared + [33, 34], [60, 61, 62], [40, 41, 42, 43, 44, 45, 46]]
    lengths = [7 * 16 + 5, 6 * 16 + 16, 6 * 16 + 18, 40, 100]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    scale = dim ** -0.5

    def check(counts, expect_rows, expect_padding):
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        qsl = torch.tensor(starts, dtype=torch.int32)
        q = torch.randn(starts[-1], heads, dim).to(q_dtype)
        plan = plan_attention(table, qsl, lens, block, max(counts))
        assert plan.decode.rows == expect_rows
        assert (plan.decode.row_index is not None) == expect_padding
        got = paged_attention_torch(q, k_cache, v_cache, table, qsl, lens, scale=scale, plan=plan, **extra)
        want = paged_prefill_attention_ref(q, k_cache, v_cache, table, qsl, lens, scale=scale, **extra)
        torch.testing.assert_close(got.float(), want.float(), **OUT_TOL[q_dtype])
        return plan

    plan = check([3, 1, 5, 2, 4], 5, True)
    assert plan.decode.groups[0].members == [0, 1, 2]
    # the shared prefix ends before the first (padded) row of every member: 6 blocks here
    assert plan.decode.groups[0].blocks == 6
    check([4, 4, 4, 4, 4], 4, False)
    mixed = check([2, 1, 3, 1, 40], 3, True)  # the 40-token chunk is attended as a prefill
    assert mixed.prefills == [(7, 47, 4, 7)]
    # padding four decodes to a 12-token chunk's rows would attend 60 rows for 16: the chunk
    # goes the prefill way and the decodes keep one row each
    lopsided = check([1, 1, 1, 1, 12], 1, False)
    assert lopsided.prefills == [(4, 16, 4, 7)]


def test_decode_rows_are_padded_at_most_twice_over():
    from kvctl.kernels.torch_paged import _decode_rows

    assert _decode_rows([1] * 8 + [16]) == list(range(8))  # 144 padded rows for 24 real ones
    assert _decode_rows([5, 5, 5, 5]) == [0, 1, 2, 3]
    assert _decode_rows([3, 1, 5, 2, 4]) == [0, 1, 2, 3, 4]  # 25 rows for 15
    assert _decode_rows([1, 16, 16]) == [0, 1, 2]  # 48 rows for 33
    assert _decode_rows([1, 1, 9, 4, 40]) == [0, 1, 3]  # the 40 is past DECODE_MAX_ROWS; 9 then pads too much


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8], ids=str)
def test_shared_prefixes_of_different_lengths_are_attended_in_one_stacked_call(cache_dtype, monkeypatch):
    """Three groups (5, 4 and 4 shared blocks; 3, 2 and 2 members) go through one call over a
    copy of their prefixes, padded and masked; the copy is made once per layer cache and kept
    while the plan is reused; a layer whose copy would pass the size limit (all layers'
    copies together) gives each group its own call. All routes give the reference's output."""
    from kvctl.kernels import paged_attention_torch, torch_paged
    from kvctl.kernels.torch_paged import AttentionPlan, plan_decode

    torch.manual_seed(13)
    block, heads, kv_heads, dim = 16, 4, 2, 64
    k_cache, v_cache, extra = cpu_paged_caches(cache_dtype, 80, block, kv_heads, dim)
    a, b, c = list(range(10, 15)), [40, 3, 17, 9], list(range(20, 24))
    tables = [a + [30], a + [31, 32], a + [33], b + [34], b + [35], c + [36], c + [37]]
    lengths = [5 * 16 + 3, 6 * 16 + 2, 5 * 16 + 16, 4 * 16 + 7, 4 * 16 + 1, 4 * 16 + 9, 4 * 16 + 12]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor(lengths, dtype=torch.int32)
    plan = plan_decode(table, lens, block)
    stack = plan.stack
    assert [g.blocks for g in plan.groups] == [5, 4, 4] and stack.members == 3
    assert stack.blocks.tolist() == [a, b + [9], c + [23]]  # shorter prefixes repeat their last block
    assert stack.rows.tolist() == [0, 1, 2, 3, 4, 4, 5, 6, 6] and stack.valid.tolist() == [0, 1, 2, 3, 4, 6, 7]
    assert (stack.mask[1, 0, 0] == 0).sum() == 64 and (stack.mask[0, 0, 0] == 0).sum() == 80
    q = torch.randn(len(tables), heads, dim)
    ones = torch.arange(len(tables) + 1, dtype=torch.int32)
    want = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale=dim ** -0.5, **extra)

    def attend(p):
        return paged_attention_torch(q, k_cache, v_cache, table, ones, lens, scale=dim ** -0.5,
                                     plan=AttentionPlan(None, p, []), **extra)

    torch.testing.assert_close(attend(plan), want, **OUT_TOL[torch.float32])
    copied = stack.copies[k_cache.data_ptr()]
    assert copied[0].shape == (3, 80, kv_heads, dim)
    moved = plan_decode(table, lens, block, reuse=plan)  # the next step, same tables: same copy
    assert moved.stack is stack
    torch.testing.assert_close(attend(moved), want, **OUT_TOL[torch.float32])
    assert stack.copies[k_cache.data_ptr()] is copied
    # the bound covers every layer's copy together: room for one layer, and the next goes per group
    one_layer = 2 * copied[0].numel() * copied[0].element_size()
    monkeypatch.setattr(torch_paged, "STACK_MAX_BYTES", one_layer + 1)
    fresh = plan_decode(table, lens, block)
    second_k, second_v = k_cache.clone(), v_cache.clone()  # another layer's cache, same contents
    torch.testing.assert_close(attend(fresh), want, **OUT_TOL[torch.float32])
    got = paged_attention_torch(q, second_k, second_v, table, ones, lens, scale=dim ** -0.5,
                                plan=AttentionPlan(None, fresh, []), **extra)
    torch.testing.assert_close(got, want, **OUT_TOL[torch.float32])
    assert fresh.stack.copies[k_cache.data_ptr()] is not None and fresh.stack.copies[second_k.data_ptr()] is None


def test_a_new_grouping_keeps_the_stacked_copy_only_while_the_blocks_hold_the_same_contents():
    """A decode takes a new block, so the grouping is planned again: the stacked prefix copy
    carries over when `block_content` vouches that every stacked block holds what it held. When
    one of them was given back and written with other content (a new content key), or nothing
    vouches (no `block_content`, or a block without a key), the copy is made again, and the
    output is the reference's every time."""
    from kvctl.kernels import paged_attention_torch
    from kvctl.kernels.torch_paged import AttentionPlan, plan_decode

    torch.manual_seed(19)
    block, heads, kv_heads, dim = 16, 4, 2, 64
    k_cache, v_cache = torch.randn(40, block, kv_heads, dim), torch.randn(40, block, kv_heads, dim)
    a, b = [3, 4, 5, 6], [10, 11, 12, 13]
    keys = {blk: f"key-{blk}" for blk in a + b}
    content = keys.get  # the blocks a and b are indexed; the suffix blocks are not

    def attend(tables, lengths, reuse, block_content):
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        lens = torch.tensor(lengths, dtype=torch.int32)
        plan = plan_decode(table, lens, block, reuse=reuse, block_content=block_content)
        q = torch.randn(len(tables), heads, dim)
        got = paged_attention_torch(q, k_cache, v_cache, table, torch.arange(len(tables) + 1, dtype=torch.int32),
                                    lens, scale=dim ** -0.5, plan=AttentionPlan(None, plan, []))
        want = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale=dim ** -0.5)
        torch.testing.assert_close(got, want, **OUT_TOL[torch.float32])
        return plan

    tables = [a + [20], a + [21], b + [22], b + [23]]
    lengths = [80, 70, 66, 73]  # the first sequence's last block is full
    first = attend(tables, lengths, None, content)
    assert first.stack.contents == (tuple(keys[x] for x in a), tuple(keys[x] for x in b))
    copied = first.stack.copies[k_cache.data_ptr()]
    # the first sequence fills block 20 and takes block 24: planned again, the copy carries over
    tables[0], lengths = a + [20, 24], [81, 71, 67, 74]
    grown = attend(tables, lengths, first, content)
    assert grown.groups is not first.groups and grown.stack.copies[k_cache.data_ptr()] is copied
    # block 12 is given back and written with other content under another key
    k_cache[12], v_cache[12] = torch.randn(block, kv_heads, dim), torch.randn(block, kv_heads, dim)
    keys[12] = "key-12-again"
    tables[1], lengths = a + [21, 25], [82, 81, 68, 75]
    rewritten = attend(tables, lengths, grown, content)
    assert rewritten.stack.copies.get(k_cache.data_ptr()) is not copied
    # unvouched: no block_content, or a stacked block without a key
    tables[2], lengths = b + [22, 26], [83, 82, 81, 76]
    unvouched = attend(tables, lengths, rewritten, None)
    assert unvouched.stack.contents is None and unvouched.stack.copies is not rewritten.stack.copies
    del keys[3]
    tables[3], lengths = b + [23, 27], [84, 83, 82, 81]
    keyless = attend(tables, lengths, unvouched, content)
    assert keyless.stack.contents is None and keyless.stack.copies is not unvouched.stack.copies


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8], ids=str)
def test_a_long_prefix_nobody_shares_is_attended_alone_not_as_everyones_suffix(cache_dtype):
    """Two groups share short prefixes; a third decode holds a long prompt alone. It becomes a
    group of one (attended in place, after the stacked groups), so the suffix table stays two
    blocks wide instead of its eleven. With one real group there is no stack and every group
    gets its own call; with no group at all, nothing is split off. The reference's output
    every time."""
    from kvctl.kernels import paged_attention_torch
    from kvctl.kernels.torch_paged import SOLO_MIN_BLOCKS, AttentionPlan, plan_decode

    torch.manual_seed(23)
    block, heads, kv_heads, dim = 16, 4, 2, 64
    k_cache, v_cache, extra = cpu_paged_caches(cache_dtype, 80, block, kv_heads, dim)
    a, b, long = [3, 4], [7, 8], list(range(40, 50))

    def attend(tables, lengths):
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        lens = torch.tensor(lengths, dtype=torch.int32)
        plan = plan_decode(table, lens, block)
        q = torch.randn(len(tables), heads, dim)
        got = paged_attention_torch(q, k_cache, v_cache, table, torch.arange(len(tables) + 1, dtype=torch.int32),
                                    lens, scale=dim ** -0.5, plan=AttentionPlan(None, plan, []), **extra)
        want = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, scale=dim ** -0.5, **extra)
        torch.testing.assert_close(got, want, **OUT_TOL[torch.float32])
        return plan

    both = attend([a + [20], long + [60], a + [21], b + [22], b + [23]], [40, 170, 35, 44, 39])
    assert [(g.members, g.blocks) for g in both.groups] == [([0, 2], 2), ([3, 4], 2), ([1], 10)]
    assert len(both.stack.blocks) == 2  # the stack holds the two real groups; the solo goes alone
    assert both.suffix_tables.shape[1] == 1 and both.order.tolist() == [0, 2, 3, 4, 1]
    one = attend([a + [20], long + [60], a + [21]], [40, 170, 35])
    assert [(g.members, g.blocks) for g in one.groups] == [([0, 2], 2), ([1], 10)] and one.stack is None
    # a long prompt whose blocks are not consecutive: only the leading run is attended in place
    broken = attend([a + [20], long[:5] + [70] + long[5:] + [60], a + [21]], [40, 186, 35])
    assert [(g.members, g.blocks) for g in broken.groups][-1] == ([1], 5)
    # too short a run, or no real group whose suffix it would widen: nothing split off
    short = attend([a + [20], long[:SOLO_MIN_BLOCKS - 1] + [60], a + [21]], [40, 16 * SOLO_MIN_BLOCKS - 5, 35])
    assert [g.members for g in short.groups] == [[0, 2]]
    alone = attend([long + [60], b + [22]], [170, 40])
    assert alone.groups == []


def test_prefixes_too_uneven_to_pad_are_not_stacked():
    from kvctl.kernels.torch_paged import plan_decode

    long, short = list(range(10, 20)), [40, 41]
    tables = [long + [30], long + [31], short + [32], short + [33]]
    lens = torch.tensor([10 * 16 + 2, 10 * 16 + 3, 2 * 16 + 5, 2 * 16 + 6], dtype=torch.int32)
    table = torch.tensor([t + [0] * (11 - len(t)) for t in tables], dtype=torch.int32)
    plan = plan_decode(table, lens, 16)
    assert [g.blocks for g in plan.groups] == [10, 2] and plan.stack is None  # 8 padding blocks for 12 real


def test_a_prompt_chunk_beside_the_decodes_keeps_their_plan_and_prefix_copy():
    """Decode step, then the same decodes beside a new prompt chunk (its table wider than
    theirs), then the decodes alone again: the grouping and the stacked prefix copy made in the
    first step serve all three, and every step equals the reference."""
    from kvctl.kernels import paged_attention_torch
    from kvctl.kernels.torch_paged import plan_attention

    torch.manual_seed(17)
    block, heads, kv_heads, dim = 16, 4, 2, 64
    k_cache, v_cache = torch.randn(60, block, kv_heads, dim), torch.randn(60, block, kv_heads, dim)
    a, b = [3, 4, 5, 6], [10, 11, 12, 13]
    decoding = [a + [20], a + [21], b + [22], b + [23]]
    lengths = [4 * 16 + 3, 4 * 16 + 5, 4 * 16 + 2, 4 * 16 + 9]
    chunk_table, chunk_len, chunk = a + [30, 31, 32, 33], 8 * 16, 40  # a prompt over prefix `a`, 40 new rows

    def step(tables, lens, new_rows, previous):
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        starts = [0]
        for n in new_rows:
            starts.append(starts[-1] + n)
        qsl, lens_t = torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
        plan = plan_attention(table, qsl, lens_t, block, max(new_rows), previous)
        q = torch.randn(starts[-1], heads, dim)
        got = paged_attention_torch(q, k_cache, v_cache, table, qsl, lens_t, scale=dim ** -0.5, plan=plan)
        want = paged_prefill_attention_ref(q, k_cache, v_cache, table, qsl, lens_t, scale=dim ** -0.5)
        torch.testing.assert_close(got, want, **OUT_TOL[torch.float32])
        return plan

    first = step(decoding, lengths, [1] * 4, None)
    assert first.decode.stack is not None and first.decode.stack.copies
    lengths = [n + 1 for n in lengths]
    mixed = step(decoding + [chunk_table], lengths + [chunk_len], [1] * 4 + [chunk], first)
    assert mixed.prefills and mixed.decode.groups is first.decode.groups
    assert mixed.decode.stack is first.decode.stack
    lengths = [n + 1 for n in lengths]
    again = step(decoding, lengths, [1] * 4, mixed)
    assert again.decode.groups is first.decode.groups
