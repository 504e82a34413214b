"""Capacity planning arithmetic for the KV cache (plain Python, no torch).

    bytes per token  = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
                       (+ 2 x layers x kv_heads x 4 for formats with per-token scales)
    bytes per block  = bytes per token x block size
    cache budget     = GPU memory - weights - LoRA adapters - activation workspace - reserve x GPU memory
    blocks           = floor(cache budget / bytes per block)  (none when the budget is negative:
                       `shortfall_bytes` says by how much the rest overcommits the GPU)
    sequences at S   = floor(blocks / ceil(S / block size))
                       (a model whose every layer slides a window W holds at most
                       ceil((W - 1 + batch tokens) / block size) + 2 blocks a sequence, as kvd does)

A LoRA adapter of rank r on every projection kvd adapts takes, per layer, as kvd packs it
(daemon/model/lora.py: A matrices stacked, B block-diagonal, in the model's dtype)

    r x (7 x hidden + 4 x heads x head_dim + 6 x kv_heads x head_dim + 5 x intermediate) elements
    r x (4 x hidden + 2 x heads x head_dim + 2 x kv_heads x head_dim + 3 x intermediate)
                                   where the checkpoint fuses Q, K and V, and gate and up (Phi-3)

Per-KV-head scales of fp8/int8 (one float32 per head and layer) cost a few KiB in all
and are not charged per token.

A lower tier (disk, Redis) stores each block as a payload: a header, the body and a checksum
(daemon/cache/tiers/payload.py). Compressed (`tier_compress` int8 or fp8_e4m3, for float caches)
the body is a byte a value and a float32 scale per token, KV head and layer: what `int8-token`
costs per token here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
PER_TOKEN_SCALE_FORMATS = {"int8-token": ("int8", 4)}  # int8 with a float32 scale per token and head


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    hidden_size: int | None = None
    intermediate_size: int | None = None
    dtype: str = "bfloat16"
    weights_bytes: int | None = None
    heads: int | None = None  # attention (query) heads
    sliding_window: int | None = None  # where every layer slides one: a sequence holds only its window's blocks
    # (window, layers that slide it) where some layers slide one and others attend in full (Gemma 2
    # and 3, Qwen's max_window_layers): kvd keeps every block, since the full layers read them all
    mixed_window: tuple[int, int] | None = None
    fused_projections: bool = False  # Phi-3: one qkv_proj and one gate_up_proj, each adapted as one
    moe_layers: int = 0  # layers whose MLP is a mixture of experts (Mixtral, Qwen-MoE): LoRA adapts their attention only
    # an MXFP4 checkpoint's experts (gpt-oss), as `weights_bytes` counts them: "kept" or "dequantised"
    mxfp4_experts: str | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a whole number of at least 1, got {value!r}")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window: must be a whole number of at least 1, got {window!r}")

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, dequantise_experts: bool = False) -> "ModelShape":
        """The shape in a checkpoint's config.json: a folder, or a Hugging Face id in the local cache.
        An MXFP4 checkpoint's weights count as kvd serves them on a GPU: as on disk (its experts kept
        in MXFP4), or dequantised where kvd serve is given --mxfp4-experts dequantise
        (`dequantise_experts`)."""
        from kvctl.daemon.model.config import ModelError, language_model_fields
        from kvctl.daemon.model.hub_cache import resolve_model

        model_dir, _ = resolve_model(str(model_dir))
        try:
            outer = json.loads((model_dir / "config.json").read_text())
        except OSError:
            raise ValueError(f"model: no readable config.json in {str(model_dir)!r}") from None
        try:  # a multimodal checkpoint's language model (Gemma 3 4B and up): its text_config
            raw = language_model_fields(outer, f"{str(model_dir)!r}/config.json")
        except ModelError as exc:
            raise ValueError(f"model: {exc}") from None
        heads = raw.get("num_attention_heads")
        hidden = raw.get("hidden_size")
        if not heads or not hidden or not raw.get("num_hidden_layers"):
            raise ValueError(f"model: {str(model_dir)!r}/config.json lacks num_hidden_layers, "
                             "num_attention_heads or hidden_size")
        multimodal = raw is not outer and "text_config" in outer  # kvd reads only its language model's tensors
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
        quantised = isinstance(raw.get("quantization_config"), dict) and \
            raw["quantization_config"].get("quant_method") == "mxfp4"
        try:
            if multimodal:
                weights = language_model_bytes(model_dir, outer)
            elif quantised:
                weights = mxfp4_served_bytes(model_dir, ELEMENT_BYTES.get(dtype, 2), dequantise_experts)
            else:
                weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
            weights = weights or None
        except ModelError as exc:
            raise ValueError(f"model: {exc}") from None
        return cls(layers=int(raw["num_hidden_layers"]), kv_heads=int(raw.get("num_key_value_heads") or heads),
                   head_dim=int(raw.get("head_dim") or hidden // heads), hidden_size=int(hidden),
                   intermediate_size=raw.get("intermediate_size"),
                   dtype=dtype, weights_bytes=weights, heads=int(heads),
                   mxfp4_experts=("dequantised" if dequantise_experts else "kept") if quantised else None,
                   **_as_kvd_reads(outer))


def _stored_tensors(model_dir: Path):
    """(name, bytes) of every tensor in the folder's safetensors files, from their headers: no
    tensor is read."""
    import struct

    for path in model_dir.glob("*.safetensors"):
        with open(path, "rb") as handle:
            try:
                header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
            except (struct.error, ValueError):
                raise ValueError(f"model: {str(path)!r} is not a safetensors file") from None
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                yield name, end - start


def language_model_bytes(model_dir: Path, raw: dict) -> int:
    """Bytes of the tensors kvd reads from a multimodal checkpoint of config.json `raw` (its
    language model's, `expected_tensors`; the vision tower stays on disk)."""
    from kvctl.daemon.model.config import ModelConfig
    from kvctl.daemon.model.weights import expected_tensors, text_model_name

    wanted = set(expected_tensors(ModelConfig.from_dict(raw)))
    return sum(size for name, size in _stored_tensors(model_dir) if text_model_name(name) in wanted)


def mxfp4_served_bytes(model_dir: Path, element_bytes: int, dequantise_experts: bool = False) -> int:
    """Bytes an MXFP4 checkpoint's tensors take as kvd serves them (gpt-oss's experts,
    kvctl.kernels.mxfp4): blocks and scales as stored, or, where kvd dequantises them
    (`dequantise_experts`), two values of `element_bytes` for each byte of blocks and no scales;
    every other tensor takes what it takes on disk."""
    total = 0
    for name, size in _stored_tensors(model_dir):
        if dequantise_experts and name.endswith("_blocks"):
            total += 2 * size * element_bytes
        elif not (dequantise_experts and name.endswith("_scales")):
            total += size
    return total


def _as_kvd_reads(raw: dict) -> dict:
    """What kvd's reading of config.json `raw` adds to its shape: `sliding_window` (every layer
    slides one), `mixed_window` (layers slide it only in part), `fused_projections`, `moe_layers`;
    nothing for an architecture kvd does not serve."""
    from kvctl.daemon.model.config import ModelConfig, ModelError

    try:
        config = ModelConfig.from_dict(raw)
    except ModelError:
        return {}
    fields = {"fused_projections": config.fused_projections, "moe_layers": len(config.moe_layers)}
    if config.sliding_window is None:
        return fields
    if config.every_layer_slides:
        return {**fields, "sliding_window": config.sliding_window}
    return {**fields, "mixed_window": (config.sliding_window, len(config.sliding_layers))}


def blocks_per_sequence(shape: ModelShape, context: int, block_size: int, batch_tokens: int = 256) -> int:
    """Blocks a sequence of `context` tokens holds at its longest, as kvd's cache keeps it
    (`policies.admission.peak_blocks`, with `batch_tokens` as kvd's max_batch_tokens)."""
    from kvctl.policies.admission import peak_blocks

    return peak_blocks(context, block_size, shape.sliding_window, batch_tokens)


@dataclass
class CapacityRow:
    cache_dtype: str
    bytes_per_token: int
    bytes_per_block: int
    cache_bytes: int
    blocks: int
    tokens: int
    sequences_at_context: int


def bytes_per_token(shape: ModelShape, cache_dtype: str) -> int:
    if cache_dtype in PER_TOKEN_SCALE_FORMATS:
        base, scale_bytes = PER_TOKEN_SCALE_FORMATS[cache_dtype]
        return 2 * shape.layers * shape.kv_heads * (shape.head_dim * ELEMENT_BYTES[base] + scale_bytes)
    if cache_dtype not in ELEMENT_BYTES:
        raise ValueError(f"dtype: unknown value {cache_dtype!r}; choose from "
                         f"{', '.join([*ELEMENT_BYTES, *PER_TOKEN_SCALE_FORMATS])}")
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * ELEMENT_BYTES[cache_dtype]


def lora_bytes(shape: ModelShape, rank: int) -> int:
    """What one LoRA adapter of `rank` on every projection (q, k, v, o, gate, up, down) takes on the
    device as kvd holds it, in the model's dtype: the figure `kvctl status` gives a loaded one. A
    mixture of experts' layers are adapted in their attention only (kvd adapts no expert)."""
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_rank: must be a whole number of at least 1, got {rank!r}")
    if not (shape.hidden_size and shape.intermediate_size and shape.heads):
        raise ValueError("lora_rank: needs the model's hidden_size, intermediate_size and attention heads "
                         "(--model DIR)")
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    inter = int(shape.intermediate_size)
    if shape.fused_projections:
        attention, mlp = rank * (2 * shape.hidden_size + 2 * q + 2 * kv), rank * (2 * shape.hidden_size + 3 * inter)
    else:
        attention, mlp = rank * (4 * shape.hidden_size + 4 * q + 6 * kv), rank * (3 * shape.hidden_size + 5 * inter)
    return (shape.layers * attention + (shape.layers - shape.moe_layers) * mlp) * ELEMENT_BYTES.get(shape.dtype, 2)


COMPRESSIBLE_DTYPES = ("float32", "float16", "bfloat16")


def payload_overhead(layers: int, compressed: bool, scale_version: str = "") -> int:
    """Bytes a stored block carries besides its K/V: the header (fixed part, a dtype code per
    layer, the scale version, the body length, the codec when compressed) and the checksum.
    Kept equal to `BlockLayout.stored_bytes` by a test (this module imports no torch)."""
    return 218 + layers + 2 + len(scale_version.encode()) + 8 + (1 if compressed else 0) + 8


def tier_plan(shape: ModelShape, *, tier_bytes: int, cache_dtype: str, block_size: int) -> dict:
    """Blocks and tokens a lower tier of `tier_bytes` holds of this cache dtype: stored whole and,
    for float caches, compressed (None where compression does not apply)."""
    if tier_bytes < 1:
        raise ValueError(f"tier_bytes: must be at least 1, got {tier_bytes!r}")
    whole = bytes_per_token(shape, cache_dtype) * block_size + payload_overhead(shape.layers, False)
    out = {"cache_dtype": cache_dtype, "tier_bytes": tier_bytes, "block_bytes": whole,
           "blocks": tier_bytes // whole, "tokens": tier_bytes // whole * block_size,
           "compressed_block_bytes": None, "compressed_blocks": None, "compressed_tokens": None}
    if cache_dtype in COMPRESSIBLE_DTYPES:
        packed = bytes_per_token(shape, "int8-token") * block_size + payload_overhead(shape.layers, True)
        out.update(compressed_block_bytes=packed, compressed_blocks=tier_bytes // packed,
                   compressed_tokens=tier_bytes // packed * block_size)
    return out


def default_workspace(shape: ModelShape, batch_tokens: int = 2048) -> int:
    """Activation workspace: a prefill chunk's transients in float32, or 1 GiB without sizes."""
    if not shape.hidden_size:
        return 2**30
    width = 4 * shape.hidden_size + 2 * (shape.intermediate_size or 4 * shape.hidden_size)
    return batch_tokens * width * 4


def plan(shape: ModelShape, *, gpu_memory: int, cache_dtype: str, block_size: int, context: int,
         reserve: float = 0.1, workspace: int | None = None, weights_bytes: int | None = None,
         lora_bytes: int = 0, batch_tokens: int = 256) -> dict:
    """Capacity for one cache dtype, with the budget broken down. `lora_bytes`: what the LoRA
    adapters served beside the model take (lora_bytes() each); `batch_tokens`: kvd's
    max_batch_tokens, what a sliding-window sequence holds beside its window."""
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve: must be in [0, 1), got {reserve!r}")
    for name, value in (("block_size", block_size), ("context", context), ("gpu_memory", gpu_memory),
                        ("batch_tokens", batch_tokens)):
        if value < 1:
            raise ValueError(f"{name}: must be at least 1, got {value!r}")
    for name, value in (("workspace", workspace), ("weights_bytes", weights_bytes), ("lora_bytes", lora_bytes)):
        if value is not None and value < 0:
            raise ValueError(f"{name}: must not be negative, got {value!r}")
    weights = weights_bytes if weights_bytes is not None else (shape.weights_bytes or 0)
    work = default_workspace(shape) if workspace is None else workspace
    budget = gpu_memory - weights - lora_bytes - work - int(reserve * gpu_memory)
    per_token = bytes_per_token(shape, cache_dtype)
    per_block = per_token * block_size
    blocks = max(budget, 0) // per_block
    per_sequence = blocks_per_sequence(shape, context, block_size, batch_tokens)
    row = CapacityRow(cache_dtype, per_token, per_block, max(budget, 0), blocks, blocks * block_size,
                      blocks // per_sequence)
    return {"gpu_memory": gpu_memory, "weights_bytes": weights, "lora_bytes": lora_bytes, "workspace_bytes": work,
            "reserve_bytes": int(reserve * gpu_memory), "shortfall_bytes": max(-budget, 0), **asdict(row)}


def compare_dtypes(shape: ModelShape, dtypes: list[str], **kwargs) -> list[dict]:
    return [plan(shape, cache_dtype=d, **kwargs) for d in dtypes]
