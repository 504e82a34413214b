"""Model configuration read from a Hugging Face style `config.json`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError
from .rope import RopeScaling, read_scaling

__all__ = ["ModelConfig", "ModelError", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",  # Mistral's attention, a mixture of experts for every MLP
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",  # Qwen2's attention; routed experts beside a gated shared expert
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3's attention; routed experts
    "Phi3ForCausalLM": "phi3",  # Phi-3 and Phi-4: Q, K and V in one projection, gate and up in another
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    # Gemma 3 4B, 12B and 27B: kvd serves their language model, text in and text out
    "Gemma3ForConditionalGeneration": "gemma3",
    # gpt-oss: attention sinks, every other layer sliding, biased experts with a clamped SwiGLU
    "GptOssForCausalLM": "gpt_oss",
}
DTYPES = ("float32", "bfloat16", "float16")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config's name -> kvd's

# transformers' Gemma2Config defaults, which its configs may lean on (with the every-other-layer
# window its layer_types default to, as a pattern of 2)
GEMMA2_DEFAULTS = {
    "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 2, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
}
# transformers' GptOssConfig defaults that change what is computed, where a config leaves them out
GPT_OSS_DEFAULTS = {
    "num_local_experts": 128, "num_experts_per_tok": 4, "head_dim": 64, "sliding_window": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 150_000.0, "attention_bias": True, "tie_word_embeddings": False,
    "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
}
# the quantised checkpoints kvd reads (kept so, or dequantised as they load), by quant_method and architecture
READ_QUANTISATIONS = {("mxfp4", "gpt_oss")}

# transformers' Gemma3TextConfig defaults: Gemma 3's multimodal checkpoints give only the fields
# that differ from them in their `text_config`
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi3", "gemma2",
    # "gemma3" or "gpt_oss"
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
    qkv_bias: bool  # Q, K and V have biases
    dtype: str  # float32, bfloat16 or float16
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    o_bias: bool = False  # the attention's output projection has a bias (`attention_bias` of Llama, Qwen3, Gemma)
    attention_sinks: bool = False  # gpt-oss: each head's learned logit joins its softmax's sum (`self_attn.sinks`)
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of Q and K, before RoPE
    sliding_window: int | None = None  # tokens a sliding-window layer attends to, where one does
    sliding_layers: tuple[int, ...] = ()  # the layers that slide that window (the others attend in full)
    # Gemma 3: the sliding layers' own RoPE (base 10,000, unscaled) where the full layers' differs
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: RopeScaling | None = None
    activation: str = "silu"  # of the gated MLP: "silu" (Llama, Qwen, Mistral) or "gelu_tanh" (Gemma)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scores scale by its -1/2 power, not head_dim's
    # Gemma: RMSNorm scales by (1 + weight) in float32, embeddings by sqrt(hidden_size), and each
    # layer also normalises its attention's and its MLP's output ("sandwich" norms)
    gemma_norms: bool = False
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap), where a config sets it
    attn_logit_softcapping: float | None = None  # Gemma 2: each attention score s becomes cap * tanh(s / cap)
    # a mixture of experts (daemon/model/moe.py): in each layer of `moe_layers`, a router sends each
    # token to `experts_per_token` of `num_experts` gated MLPs of `expert_intermediate_size`, their
    # outputs weighed by the router's softmax over the experts chosen (renormalised to sum to 1
    # with `norm_topk_prob`); `shared_expert_intermediate_size` > 0: every token also passes one
    # shared expert, scaled by a sigmoid gate (Qwen2-MoE). The other layers' MLPs are dense.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    # gpt-oss (`stacked_experts`, whose router and experts have biases): each expert's activation is the
    # clamped SwiGLU (up + 1) * g * sigmoid(alpha * g), g the gate clamped to at most `swiglu_limit` and
    # up to +-`swiglu_limit`
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    quantisation: str | None = None  # the checkpoint's `quantization_config.quant_method` (READ_QUANTISATIONS)
    # kvd's choice, not the checkpoint's (kvd serve --dequantise-experts): an MXFP4 checkpoint's experts
    # dequantised as they load (4x the memory) instead of kept in MXFP4 and decoded as each step runs them
    dequantise_experts: bool = False

    @property
    def fused_projections(self) -> bool:
        """Whether the checkpoint stores Q, K and V as one `qkv_proj` and gate and up as one
        `gate_up_proj` (Phi-3), stacked in the order kvd packs them."""
        return self.architecture == "phi3"

    @property
    def experts_prefix(self) -> str:
        """Where a MoE layer's router and experts are, under `model.layers.{i}.`: Mixtral's
        `block_sparse_moe.` (experts' w1, w3, w2: gate, up, down), Qwen's `mlp.` (gate_proj, up_proj, down_proj)."""
        return "block_sparse_moe." if self.architecture == "mixtral" else "mlp."

    @property
    def stacked_experts(self) -> bool:
        """Whether the checkpoint keeps each MoE layer's experts as stacked tensors (gpt-oss's
        `mlp.experts.gate_up_proj` [E, hidden, 2·I], gate and up columns interleaved, and
        `down_proj` [E, I, hidden]) rather than one tensor per expert and projection."""
        return self.architecture == "gpt_oss"

    @property
    def norm_style(self) -> str:
        """How RMSNorm applies its weight, as transformers writes each model (llama.rms_norm):
        "gemma" (1 + weight, in float32), "float32" (weight, in float32: gpt-oss), else "llama"
        (weight, after the normalised values are cast back to the model's dtype)."""
        return "gemma" if self.gemma_norms else "float32" if self.architecture == "gpt_oss" else "llama"

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def embedding_scale(self) -> float | None:
        """What the token embeddings are multiplied by (Gemma: sqrt(hidden_size)); None: by nothing."""
        return self.hidden_size ** 0.5 if self.gemma_norms else None

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
        quantisation = _quantisation(raw, arch, where)  # (the outer config's: a multimodal one's text_config has none)
        raw = language_model_fields(raw, where)

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
        max_positions = int(raw.get("max_position_embeddings", 4096))
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
        if dtype not in DTYPES:
            raise ModelError(f"{where}: torch_dtype {dtype!r} unsupported; use one of {', '.join(DTYPES)}")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        _refuse_what_kvd_does_not_compute(raw, where)
        gemma = arch in ("gemma2", "gemma3")
        act_field = "hidden_activation" if gemma else "hidden_act"
        activation = raw.get(act_field) or "silu"
        if activation not in ACTIVATIONS:
            raise ModelError(f"{where}: field {act_field!r} {activation!r} is not supported; "
                             f"supported: {', '.join(ACTIVATIONS)}")
        scalar = raw.get("query_pre_attn_scalar") if gemma else None
        cap, score_cap = raw.get("final_logit_softcapping"), raw.get("attn_logit_softcapping")
        for name, value in (("query_pre_attn_scalar", scalar), ("final_logit_softcapping", cap),
                            ("attn_logit_softcapping", score_cap)):
            if value is not None and not _positive(value):
                raise ModelError(f"{where}: field {name!r} must be a positive number (got {value!r})")
        return cls(
            architecture=arch, vocab_size=need("vocab_size"), hidden_size=hidden,
            intermediate_size=need("intermediate_size"), num_layers=need("num_hidden_layers"),
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            **_attention_biases(raw, arch), attention_sinks=arch == "gpt_oss",
            dtype=dtype, bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids,
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"), **_sliding_window(raw, arch, need("num_hidden_layers"), where),
            **_rope(raw, arch, max_positions, where), activation=ACTIVATIONS[activation],
            query_pre_attn_scalar=None if scalar is None else float(scalar), gemma_norms=gemma,
            final_logit_softcapping=None if cap is None else float(cap),
            attn_logit_softcapping=None if score_cap is None else float(score_cap),
            **_experts(raw, arch, need("num_hidden_layers"), where), quantisation=quantisation,
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


def _positive(value) -> bool:
    """Whether a config's value is a positive, finite number (a JSON true is not one)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


def language_model_fields(raw: dict, where: str = "config.json") -> dict:
    """The fields of the language model a config.json describes: a multimodal Gemma 3's
    `text_config` (which names only what differs from transformers' defaults, filled in here,
    and leaves dtype and EOS to the outer config); a text model's own fields otherwise."""
    text = raw.get("text_config")
    archs = raw.get("architectures") or []
    if "Gemma3ForConditionalGeneration" in archs:
        if not isinstance(text, dict):
            raise ModelError(f"{where}: field 'text_config' must be an object for Gemma3ForConditionalGeneration "
                             f"(got {text!r})")
        outer = {k: raw[k] for k in ("torch_dtype", "dtype", "eos_token_id", "bos_token_id") if raw.get(k) is not None}
        # (transformers' Gemma3ForConditionalGeneration caps no logits, whatever its text_config says)
        return {**GEMMA3_TEXT_DEFAULTS, **outer, **text, "architectures": archs, "final_logit_softcapping": None}
    if "Gemma3ForCausalLM" in archs:
        return {**GEMMA3_TEXT_DEFAULTS, **raw}
    if "Gemma2ForCausalLM" in archs:
        return {**GEMMA2_DEFAULTS, **raw}
    if "GptOssForCausalLM" in archs:
        if raw.get("rope_scaling") or raw.get("rope_parameters"):  # a config's own RoPE replaces the default whole
            return {**GPT_OSS_DEFAULTS, "rope_scaling": None, **raw}
        return {**GPT_OSS_DEFAULTS, **raw}
    return raw


def _attention_biases(raw: dict, arch: str) -> dict:
    """Which attention projections have biases, as transformers builds each architecture: Qwen2's
    Q, K and V always (Qwen2-MoE's by `qkv_bias`), never its output; Mistral's, Mixtral's and
    Phi-3's none; the others' Q, K, V and output where `attention_bias` says."""
    if arch == "qwen2":
        return {"qkv_bias": True, "o_bias": False}
    if arch == "qwen2_moe":
        return {"qkv_bias": bool(raw.get("qkv_bias", True)), "o_bias": False}
    if arch in ("mistral", "mixtral", "phi3"):
        return {"qkv_bias": False, "o_bias": False}
    bias = bool(raw.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def _quantisation(raw: dict, arch: str, where: str) -> str | None:
    """The checkpoint's quantisation, where kvd reads it (READ_QUANTISATIONS: gpt-oss's MXFP4
    experts); any other is refused by name at load, since its tensors would be read as plain
    weights without their scales."""
    config = raw.get("quantization_config")
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else None
    if (method, arch) in READ_QUANTISATIONS:
        return method
    readable = ", ".join(f"{m} ({a})" for m, a in sorted(READ_QUANTISATIONS))
    raise ModelError(f"{where}: quantization_config quant_method {method!r} is not supported for {arch} "
                     f"(kvd reads {readable}); serve the unquantised checkpoint")


def _refuse_what_kvd_does_not_compute(raw: dict, where: str) -> None:
    """Fields that change what a model computes in ways kvd does not follow: refused by name at
    load, never served wrongly."""
    if raw.get("use_bidirectional_attention"):
        raise ModelError(f"{where}: use_bidirectional_attention true is not supported (kvd decodes causally)")


def _rope(raw: dict, arch: str, max_positions: int, where: str) -> dict:
    """RoPE's base and scaling, as `rope_scaling` (or transformers 5's `rope_parameters`) gives
    them; Gemma 3's sliding layers rotate with their own (`rope_local_base_freq`, unscaled, or
    `rope_parameters.sliding_attention`)."""
    params = raw.get("rope_parameters")
    by_layer_type = isinstance(params, dict) and "full_attention" in params
    scaling = params["full_attention"] if by_layer_type else (raw.get("rope_scaling") or (params or {}))
    if not isinstance(scaling, dict):
        raise ModelError(f"{where}: field 'rope_scaling' must be an object (got {scaling!r})")
    partial = raw.get("partial_rotary_factor", scaling.get("partial_rotary_factor", 1.0))
    if partial != 1.0:  # rotating part of each head is not written here: refused, not served wrongly
        raise ModelError(f"{where}: partial_rotary_factor {partial!r} is not supported (kvd rotates whole heads)")
    fields = {"rope_theta": float(scaling.get("rope_theta", raw.get("rope_theta", 10000.0))) if by_layer_type
              else float(raw.get("rope_theta", scaling.get("rope_theta", 10000.0))),
              "rope_scaling": read_scaling(scaling, max_positions, where)}
    if arch != "gemma3":
        return fields
    local = params.get("sliding_attention") if by_layer_type else None
    if local is not None and not isinstance(local, dict):
        raise ModelError(f"{where}: field 'rope_parameters.sliding_attention' must be an object (got {local!r})")
    theta = (local or {}).get("rope_theta", raw.get("rope_local_base_freq", 10000.0))
    if not _positive(theta):
        raise ModelError(f"{where}: the sliding layers' rope_theta must be a positive number (got {theta!r})")
    return {**fields, "sliding_rope_theta": float(theta),
            "sliding_rope_scaling": read_scaling(local or {}, max_positions, where)}


def _sliding_window(raw: dict, arch: str, num_layers: int, where: str) -> dict:
    """`sliding_window` (the window of the checkpoint's sliding-window layers, or None when every
    layer attends in full) and `sliding_layers` (which layers slide), as transformers reads them:
    `layer_types` where the file has them; else Mistral slides every layer by `sliding_window`;
    Qwen2 and Qwen3 slide the layers from `max_window_layers` on, only with `use_sliding_window`;
    Gemma 2 and 3 every layer but each `sliding_window_pattern`-th."""
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ModelError(f"{where}: field 'layer_types' must list one type for each of the {num_layers} layers "
                             f"(got {layer_types!r})")
        layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    elif arch in ("mistral", "mixtral", "phi3"):
        layers = tuple(range(num_layers)) if window is not None else ()
    elif arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and raw.get("use_sliding_window"):
        layers = tuple(range(int(raw.get("max_window_layers") or 0), num_layers))
    elif arch == "gpt_oss":  # transformers' default: layers 0, 2, 4... slide
        layers = tuple(range(0, num_layers, 2)) if window is not None else ()
    elif arch in ("gemma2", "gemma3"):  # every `sliding_window_pattern`-th layer attends in full, the others slide
        pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern"))
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ModelError(f"{where}: field 'sliding_window_pattern' must be a positive integer (got {pattern!r})")
        layers = tuple(i for i in range(num_layers) if (i + 1) % pattern)
    else:
        layers = ()
    if not layers:
        return {"sliding_window": None, "sliding_layers": ()}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelError(f"{where}: field 'sliding_window' must be a positive integer where layers slide "
                         f"(got {window!r})")
    return {"sliding_window": window, "sliding_layers": layers}


MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")


def _experts(raw: dict, arch: str, num_layers: int, where: str) -> dict:
    """A mixture of experts' fields (ModelConfig.num_experts and those after it) as transformers
    reads them: Mixtral's `num_local_experts` in every layer, each expert `intermediate_size`
    wide, its top-k always renormalised; Qwen's `num_experts` (or `num_local_experts`) of
    `moe_intermediate_size` in each `decoder_sparse_step`-th layer not in `mlp_only_layers`,
    renormalised where `norm_topk_prob`, and Qwen2-MoE's shared expert. Nothing for a dense model."""
    if arch not in MOE_ARCHITECTURES:
        return {}

    def count(name: str, value, least: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ModelError(f"{where}: field {name!r} must be an integer >= {least} (got {value!r})")
        return value

    experts_field = "num_local_experts" if arch == "mixtral" or "num_experts" not in raw else "num_experts"
    experts = count(experts_field, raw.get(experts_field))
    top_k = count("num_experts_per_tok", raw.get("num_experts_per_tok"))
    if top_k > experts:
        raise ModelError(f"{where}: field 'num_experts_per_tok' {top_k} is more than the {experts} experts")
    if arch == "mixtral":
        return {"num_experts": experts, "experts_per_token": top_k,
                "expert_intermediate_size": count("intermediate_size", raw.get("intermediate_size")),
                "moe_layers": tuple(range(num_layers)), "norm_topk_prob": True}
    if arch == "gpt_oss":  # a softmax over the top k's scores: the whole softmax's top k, renormalised
        limit, alpha = raw.get("swiglu_limit"), raw.get("swiglu_alpha")
        for name, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
            if not _positive(value):
                raise ModelError(f"{where}: field {name!r} must be a positive number (got {value!r})")
        return {"num_experts": experts, "experts_per_token": top_k,
                "expert_intermediate_size": count("intermediate_size", raw.get("intermediate_size")),
                "moe_layers": tuple(range(num_layers)), "norm_topk_prob": True,
                "swiglu_limit": float(limit), "swiglu_alpha": float(alpha)}
    step = count("decoder_sparse_step", raw.get("decoder_sparse_step", 1))
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise ModelError(f"{where}: field 'mlp_only_layers' must be a list of layer numbers (got {dense!r})")
    shared = raw.get("shared_expert_intermediate_size", 0) if arch == "qwen2_moe" else 0
    return {"num_experts": experts, "experts_per_token": top_k,
            "expert_intermediate_size": count("moe_intermediate_size", raw.get("moe_intermediate_size")),
            "moe_layers": tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "shared_expert_intermediate_size": count("shared_expert_intermediate_size", shared, 0)}
