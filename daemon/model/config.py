"""Model configuration read from a Hugging Face style `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError
from .rope import RopeScaling, read_scaling

__all__ = ["ModelConfig", "ModelError", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "mistral", "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    dtype: str  # float32, bfloat16 or float16
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of Q and K, before RoPE
    sliding_window: int | None = None  # tokens a sliding-window layer attends to, where one does
    sliding_layers: tuple[int, ...] = ()  # the layers that slide that window (the others attend in full)

    @property
    def context_limit(self) -> int:
        """The longest context kvd serves: the model's positions (a sliding-window layer attends
        to the last `sliding_window` of them, position i to i-W+1..i)."""
        return self.max_position_embeddings

    def context_limit_text(self) -> str:
        """What `context_limit` is, for an error message: "the model's 4096 positions"."""
        return f"the model's {self.context_limit} positions"

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention span: the sliding window for a sliding layer, None for full attention."""
        sliding = set(self.sliding_layers)
        return tuple(self.sliding_window if i in sliding else None for i in range(self.num_layers))

    @property
    def every_layer_slides(self) -> bool:
        """Whether no layer attends in full: then a sequence needs only its window's blocks."""
        return self.sliding_window is not None and len(self.sliding_layers) == self.num_layers

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelError(f"{where}: unsupported architecture {archs!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")

        def need(name: str, kind=int):
            value = raw.get(name)
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ModelError(f"{where}: field {name!r} is missing or not a number (got {value!r})")
            return kind(value)

        if raw.get("mlp_bias"):
            raise ModelError(f"{where}: field 'mlp_bias' true is not supported")
        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ModelError(f"{where}: num_attention_heads {num_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        scaling = raw.get("rope_scaling") or (raw.get("rope_parameters") or {})
        if not isinstance(scaling, dict):
            raise ModelError(f"{where}: field 'rope_scaling' must be an object (got {scaling!r})")
        max_positions = int(raw.get("max_position_embeddings", 4096))
        rope_scaling = read_scaling(scaling, max_positions, where)
        partial = raw.get("partial_rotary_factor", scaling.get("partial_rotary_factor", 1.0))
        if partial != 1.0:  # rotating part of each head is not written here: refused, not served wrongly
            raise ModelError(f"{where}: partial_rotary_factor {partial!r} is not supported (kvd rotates whole heads)")
        rope_theta = raw.get("rope_theta", scaling.get("rope_theta", 10000.0))
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
        if dtype not in DTYPES:
            raise ModelError(f"{where}: torch_dtype {dtype!r} unsupported; use one of {', '.join(DTYPES)}")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch, vocab_size=need("vocab_size"), hidden_size=hidden,
            intermediate_size=need("intermediate_size"), num_layers=need("num_hidden_layers"),
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            dtype=dtype, bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids,
            qk_norm=arch == "qwen3", **_sliding_window(raw, arch, need("num_hidden_layers"), where),
        )

    @classmethod
    def load(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelError(f"model: no config.json in {str(model_dir)!r}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelError(f"{path}: not valid JSON ({exc.msg})") from None
        return cls.from_dict(raw, str(path))


def _sliding_window(raw: dict, arch: str, num_layers: int, where: str) -> dict:
    """`sliding_window` (the window of the checkpoint's sliding-window layers, or None when every
    layer attends in full) and `sliding_layers` (which layers slide), as transformers reads them:
    `layer_types` where the file has them; else Mistral slides every layer by `sliding_window`;
    Qwen2 and Qwen3 slide the layers from `max_window_layers` on, only with `use_sliding_window`."""
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ModelError(f"{where}: field 'layer_types' must list one type for each of the {num_layers} layers "
                             f"(got {layer_types!r})")
        layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    elif arch == "mistral":
        layers = tuple(range(num_layers)) if window is not None else ()
    elif arch in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
        layers = tuple(range(int(raw.get("max_window_layers") or 0), num_layers))
    else:
        layers = ()
    if not layers:
        return {"sliding_window": None, "sliding_layers": ()}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelError(f"{where}: field 'sliding_window' must be a positive integer where layers slide "
                         f"(got {window!r})")
    return {"sliding_window": window, "sliding_layers": layers}
