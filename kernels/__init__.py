"""Kernels for the paged KV cache: Triton launchers, each beside a plain-torch `*_ref` twin.

    write_kv / write_kv_ref                                  store (and quantise) new K/V
    paged_decode_attention / paged_decode_attention_ref      one query per sequence
    paged_prefill_attention / paged_prefill_attention_ref    new tokens over their prefix
    copy_blocks / copy_blocks_ref                            copy-on-write block copies
    grouped_gemm / grouped_gemm_ref, moe_experts             a mixture of experts' MLP (its weights
                                                             as they are, or kept in MXFP4: mxfp4.py)
    paged_attention_torch                                    batched plain-torch path for CPUs

The launchers run on CUDA, or on the CPU under TRITON_INTERPRET=1 (for tests).
This package imports nothing of the rest of the project.
"""

from .checks import KernelArgumentError, format_unsupported, format_unsupported_on
from .copy_blocks import copy_blocks, copy_blocks_ref
from .decode import DecodeLaunch, paged_decode_attention, paged_decode_attention_ref
from .formats import CACHE_DTYPES, absmax_scales, cache_dtype, dequantise, is_quantised, quantise
from .moe import MoeLaunch, align_pairs, grouped_gemm, grouped_gemm_ref, moe_experts
from .prefill import PrefillLaunch, paged_prefill_attention, paged_prefill_attention_ref
from .torch_paged import paged_attention_torch, plan_attention
from .write_kv import write_kv, write_kv_ref

__all__ = [
    "CACHE_DTYPES", "DecodeLaunch", "KernelArgumentError", "MoeLaunch", "PrefillLaunch", "absmax_scales",
    "align_pairs", "cache_dtype", "grouped_gemm", "grouped_gemm_ref", "moe_experts",
    "copy_blocks", "format_unsupported", "format_unsupported_on",
    "copy_blocks_ref", "dequantise", "is_quantised", "paged_decode_attention",
    "paged_attention_torch", "plan_attention", "paged_decode_attention_ref", "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "quantise", "write_kv", "write_kv_ref",
]
