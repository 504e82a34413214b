"""`kvctl capacity`: how many cache blocks and sequences fit, per cache dtype, side by side."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Optional

import typer
from rich.console import Console
from rich import box
from rich.table import Table

from kvctl.daemon.gpu_nvml import Nvml

from .capacity import (ELEMENT_BYTES, PER_TOKEN_SCALE_FORMATS, ModelShape, blocks_per_sequence, compare_dtypes,
                       lora_bytes, tier_plan)
from .errors import UserError


def _bytes(field: str, text: str) -> int:
    from kvctl.daemon.server.byte_sizes import size_in_bytes

    try:
        return size_in_bytes(text)
    except ValueError:
        raise UserError(f"{field}: invalid size {text!r}; use bytes or 80GiB, 141GB, ...") from None


def nvml_free_memory() -> int:
    """Free bytes on the GPU that CUDA device 0 of this process is (CUDA_VISIBLE_DEVICES honoured)."""
    free = Nvml().free_memory(0)
    if free is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
        raise UserError(f"gpu: --gpu auto needs an NVIDIA GPU visible through NVML{seen}; "
                        "give --gpu-memory BYTES")
    return free


def capacity_command(
    model: Optional[str] = typer.Option(
        None, "--model", help="Checkpoint directory (config.json), or a Hugging Face id in the local cache."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Decoder layers."),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="KV heads."),
    head_dim: Optional[int] = typer.Option(None, "--head-dim", help="Head dimension."),
    dtype: Optional[list[str]] = typer.Option(
        None, "--dtype", help="Cache dtypes to compare (default: the model's own, as kvd's cache_dtype auto takes "
                              "it, bfloat16 without --model; then fp8_e4m3 and int8)."),
    block_size: int = typer.Option(16, help="Tokens per block."),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="GPU memory, e.g. 141GB."),
    gpu: Optional[str] = typer.Option(
        None, "--gpu", help="'auto': free memory through NVML of the first GPU CUDA_VISIBLE_DEVICES leaves visible."),
    weights_bytes: str = typer.Option("auto", help="Weights: auto (safetensors sizes) or bytes."),
    workspace: Optional[str] = typer.Option(None, help="Activation workspace bytes (default: estimated)."),
    reserve: float = typer.Option(0.1, help="Fraction of GPU memory kept free."),
    context: int = typer.Option(8192, help="Context length S for the sequences column."),
    sliding_window: Optional[int] = typer.Option(
        None, "--sliding-window", help="Every layer slides a window of this many tokens (read from --model's "
                                       "config.json): a sequence holds only its window's blocks."),
    batch_tokens: int = typer.Option(256, "--batch-tokens", help="kvd's max_batch_tokens: what a sliding-window "
                                                                   "sequence holds beside its window."),
    tier_bytes: Optional[str] = typer.Option(
        None, "--tier-bytes", help="Also: tokens a lower tier (disk, Redis) of this size holds, whole and "
                                   "compressed (tier_compress), e.g. 512GiB."),
    loras: int = typer.Option(0, "--loras", help="LoRA adapters served beside the model (lora_modules); "
                                                  "with --lora-rank and --model."),
    lora_rank: Optional[int] = typer.Option(None, "--lora-rank", help="Their rank, on every projection."),
    mxfp4_experts: str = typer.Option(
        "auto", "--mxfp4-experts", help="kvd serve's: an MXFP4 checkpoint's experts (gpt-oss) counted kept as "
                                        "published (auto, as on a GPU; keep) or dequantised to the model's dtype."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Bytes per token and block, and blocks and sequences that fit, per cache dtype.

    `--loras N --lora-rank R` takes N LoRA adapters of rank R on every projection out of the
    cache's memory, at what kvd holds of each (`kvctl status` gives a loaded one's bytes).

    Example: kvctl capacity --layers 32 --kv-heads 8 --head-dim 128 --gpu-memory 141GB --weights-bytes 16GB
    """
    if not model and None in (layers, kv_heads, head_dim):
        raise UserError("model: give --model DIR, or --layers, --kv-heads and --head-dim")
    try:
        from kvctl.daemon.config import MXFP4_EXPERTS

        if mxfp4_experts not in MXFP4_EXPERTS:
            raise ValueError(f"mxfp4_experts: unknown value {mxfp4_experts!r}; choose from {', '.join(MXFP4_EXPERTS)}")
        shape = ModelShape.from_model_dir(model, mxfp4_experts == "dequantise") if model else \
            ModelShape(layers, kv_heads, head_dim)
        if sliding_window is not None:
            shape = replace(shape, sliding_window=sliding_window)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if gpu == "auto":
        memory = nvml_free_memory()
    elif gpu is not None:
        raise UserError(f"gpu: invalid value {gpu!r}; the only value is auto")
    elif gpu_memory:
        memory = _bytes("gpu_memory", gpu_memory)
    else:
        raise UserError("gpu_memory: give --gpu-memory BYTES or --gpu auto")
    weights = None if weights_bytes == "auto" else _bytes("weights_bytes", weights_bytes)
    if loras < 0:
        raise UserError(f"loras: must be >= 0, got {loras}")
    if (loras > 0) != (lora_rank is not None):
        raise UserError("loras: give --loras N with --lora-rank R (both or neither)")
    try:
        adapters = loras * lora_bytes(shape, lora_rank) if loras else 0
    except ValueError as exc:
        raise UserError(str(exc)) from None
    from kvctl.daemon.config import cache_dtype_name

    if not dtype:  # what kvd's cache_dtype auto would hold, beside the quantised formats
        own = shape.dtype if shape.dtype in ELEMENT_BYTES else "bfloat16"
        dtype = [",".join(dict.fromkeys([own, "fp8_e4m3", "int8"]))]
    dtypes = [cache_dtype_name(d) for value in dtype for d in value.split(",") if d.strip()]
    for name in dtypes:
        if name not in ELEMENT_BYTES and name not in PER_TOKEN_SCALE_FORMATS:
            raise UserError(f"dtype: unknown value {name!r}; choose from "
                            f"{', '.join([*ELEMENT_BYTES, *PER_TOKEN_SCALE_FORMATS])}")
    try:
        rows = compare_dtypes(shape, dtypes, gpu_memory=memory, block_size=block_size, context=context,
                              reserve=reserve, workspace=None if workspace is None else _bytes("workspace", workspace),
                              weights_bytes=weights, lora_bytes=adapters, batch_tokens=batch_tokens)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    document = {"shape": {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim},
                "block_size": block_size, "context": context, "rows": rows}
    if shape.sliding_window is not None:
        document["sliding_window"] = {"tokens": shape.sliding_window, "batch_tokens": batch_tokens,
                                      "blocks_per_sequence": blocks_per_sequence(shape, context, block_size,
                                                                                 batch_tokens),
                                      "blocks_per_sequence_without": -(-context // block_size)}
    elif shape.mixed_window is not None:  # counted at every block: say why
        document["mixed_sliding_window"] = {"tokens": shape.mixed_window[0], "layers": shape.mixed_window[1],
                                            "of": shape.layers}
    if shape.mxfp4_experts is not None:
        document["mxfp4_experts"] = shape.mxfp4_experts
    if loras:
        document["loras"] = {"count": loras, "rank": lora_rank, "bytes_each": adapters // loras}
    if tier_bytes is not None:
        size = _bytes("tier_bytes", tier_bytes)
        try:
            document["tier"] = [tier_plan(shape, tier_bytes=size, cache_dtype=d, block_size=block_size)
                                for d in dtypes]
        except ValueError as exc:
            raise UserError(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(document, indent=2))
        return
    first = rows[0]
    table = Table(box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False,
                  title=f"KV cache capacity: {shape.layers} layers x {shape.kv_heads} KV heads x "
                        f"{shape.head_dim} dims; GPU {first['gpu_memory'] / 2**30:.1f} GiB - weights "
                        f"{first['weights_bytes'] / 2**30:.1f}"
                        + (f" - {loras} LoRA {adapters / 2**30:.1f}" if loras else "")
                        + f" - workspace {first['workspace_bytes'] / 2**30:.1f}"
                        f" - reserve {first['reserve_bytes'] / 2**30:.1f} GiB; "
                        f"sequences of {context:,} tokens")
    for column in ("cache dtype", "B/token", "B/block", "cache GiB", "blocks", "tokens",
                   "sequences"):  # short headers: the table fits 80 columns unwrapped
        table.add_column(column, justify="right", overflow="fold")
    for r in rows:
        table.add_row(r["cache_dtype"], f"{r['bytes_per_token']:,}", f"{r['bytes_per_block']:,}",
                      f"{r['cache_bytes'] / 2**30:.1f}", f"{r['blocks']:,}", f"{r['tokens']:,}",
                      f"{r['sequences_at_context']:,}")
    console = Console()
    console.print(table)
    if "sliding_window" in document:
        window = document["sliding_window"]
        console.print(f"Every layer slides a window of {window['tokens']:,} tokens: a sequence of {context:,} tokens "
                      f"holds at most {window['blocks_per_sequence']:,} blocks at once (its window and "
                      f"{batch_tokens:,} batch tokens), not {window['blocks_per_sequence_without']:,}.", markup=False)
    if "mixed_sliding_window" in document:
        mixed = document["mixed_sliding_window"]
        console.print(f"{mixed['layers']} of the {mixed['of']} layers slide a window of {mixed['tokens']:,} tokens; "
                      "the others attend to the whole context, so kvd keeps every block of a sequence, as counted "
                      "here.", markup=False)
    if document.get("mxfp4_experts") == "kept":
        console.print("The experts are counted in MXFP4, as kvd keeps them on a GPU (4.25 bits a weight); "
                      "--mxfp4-experts dequantise counts them as kvd serve --mxfp4-experts dequantise holds them.",
                      markup=False)
    elif document.get("mxfp4_experts") == "dequantised":
        console.print("The experts are counted dequantised to the model's dtype (kvd serve --mxfp4-experts "
                      "dequantise); kept in MXFP4, as kvd keeps them on a GPU by default, they take 17 bytes per "
                      "32 weights (about a quarter of bfloat16's).", markup=False)
    for t in document.get("tier", []):
        held = f"a lower tier of {t['tier_bytes'] / 2**30:,.1f} GiB holds {t['tokens']:,} tokens of {t['cache_dtype']}"
        if t["compressed_tokens"] is not None:
            held += (f" stored whole, {t['compressed_tokens']:,} compressed (tier_compress int8 or fp8_e4m3: "
                     f"{t['compressed_block_bytes']:,} bytes a block against {t['block_bytes']:,})")
        console.print(held, markup=False)
    if first["shortfall_bytes"]:
        console.print(f"No room for a cache: weights, workspace and reserve exceed the GPU's memory by "
                      f"{first['shortfall_bytes'] / 2**30:.1f} GiB.")
