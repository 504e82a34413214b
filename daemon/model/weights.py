"""Weights from `*.safetensors` (single file or sharded with an index), and the model revision.

gpt-oss's MXFP4 checkpoints keep each layer's experts as `{name}_blocks` and `{name}_scales`
(kvctl.kernels.mxfp4). kvd keeps them so: `{name}` is then the blocks, `{name}_scales` the
scales, both uint8, on the device they load to. With `ModelConfig.dequantise_experts` they are
dequantised as they load instead, into the tensor the unquantised checkpoint names `{name}`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .config import ModelConfig, ModelError
from kvctl.kernels.mxfp4 import check_mxfp4, dequantise_mxfp4

INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ModelError(f"{index}: expected a JSON object with a 'weight_map'") from None
        files = [model_dir / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelError(f"{index}: lists shard {missing[0]!r}, which is not in {str(model_dir)!r}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelError(f"model: no *.safetensors file in {str(model_dir)!r}")
    return files


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_revision(model_dir: Path) -> str:
    """SHA-256 over config.json and every weight file's SHA-256: new weights, new revision."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256(b"kvctl/model-revision/v1\0")
    digest.update(hashlib.sha256((model_dir / "config.json").read_bytes()).digest())
    for path in weight_files(model_dir):
        digest.update(path.name.encode() + b"\0" + file_digest(path).encode())
    return digest.hexdigest()


def expected_tensors(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if config.gemma_norms:
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
        if config.fused_projections:  # Phi-3: Q, K and V in one tensor, gate and up in another
            names += [p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight", p + "mlp.gate_up_proj.weight",
                      p + "mlp.down_proj.weight"]
            continue
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        if config.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if config.o_bias:
            names.append(p + "self_attn.o_proj.bias")
        if config.attention_sinks:
            names.append(p + "self_attn.sinks")
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += mlp_tensors(config, i) if i in config.moe_layers else [p + f"mlp.{x}_proj.weight"
                                                                         for x in ("gate", "up", "down")]
    return names


def expert_names(config: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    """A MoE layer's expert's gate, up and down projections, as the checkpoint names them."""
    p = f"model.layers.{layer}.{config.experts_prefix}experts.{expert}."
    if config.architecture == "mixtral":
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def mlp_tensors(config: ModelConfig, layer: int) -> list[str]:
    """A MoE layer's MLP tensors: its router, every expert's projections, and a shared expert's
    with its gate (Qwen2-MoE); gpt-oss's router and stacked experts, with their biases."""
    p = f"model.layers.{layer}.{config.experts_prefix}"
    if config.stacked_experts:
        return [p + "router.weight", p + "router.bias"] + [p + f"experts.{x}" for x in STACKED_EXPERTS]
    names = [p + "gate.weight"] + [n for e in range(config.num_experts) for n in expert_names(config, layer, e)]
    if config.shared_expert_intermediate_size:
        names += [p + f"shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")]
        names.append(p + "shared_expert_gate.weight")
    return names


# gpt-oss's stacked experts: gate_up_proj [E, hidden, 2·I] (gate and up columns interleaved), down_proj
# [E, I, hidden], and their biases
STACKED_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
MXFP4_TENSORS = ("gate_up_proj", "down_proj")  # the ones an MXFP4 checkpoint quantises


def stored_names(config: ModelConfig, name: str) -> tuple[str, ...]:
    """The tensors the checkpoint stores for the model's tensor `name`: itself, or an MXFP4
    checkpoint's blocks and scales of it."""
    if config.quantisation == "mxfp4" and name.rsplit(".", 1)[-1] in MXFP4_TENSORS and ".experts." in name:
        return name + "_blocks", name + "_scales"
    return (name,)


# where a multimodal checkpoint keeps its language model's tensors (transformers 4's layout, then
# 5's), and the names a text model gives them; the vision tower's tensors are not read
LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                           ("model.language_model.", "model."))


def text_model_name(name: str) -> str:
    """The name a text model gives the checkpoint's tensor `name`: itself, unless a multimodal
    checkpoint's language model holds it under its own prefix."""
    for prefix, text in LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return text + name[len(prefix):]
    return name


def load_weights(model_dir: Path, config: ModelConfig, dtype, device) -> dict:
    """Every tensor the model needs, cast to `dtype` on `device`; a missing one is named. Only
    those are read: a multimodal checkpoint's vision tower stays on disk."""
    from safetensors import safe_open

    names = expected_tensors(config)
    stored = {name: stored_names(config, name) for name in names}
    wanted = {s for parts in stored.values() for s in parts}
    tensors = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                text = text_model_name(name)
                if text in wanted:
                    tensors[text] = handle.get_tensor(name)
    for name in (part for name in names for part in stored[name]):
        if name not in tensors:
            raise ModelError(f"model: tensor {name!r} is missing from the weights in {str(model_dir)!r}")
    loaded = {}
    for name in names:
        if len(stored[name]) == 1:
            loaded[name] = tensors.pop(name).to(device=device, dtype=dtype)
            continue
        blocks, scales = (tensors.pop(s).to(device) for s in stored[name])
        try:
            check_mxfp4(blocks, scales)
        except ValueError as exc:
            raise ModelError(f"model: {name}: {exc}") from None
        if config.dequantise_experts:  # [E, out, in] as quantised; the unquantised checkpoint's layout is [E, in, out]
            loaded[name] = dequantise_mxfp4(blocks, scales, dtype).transpose(1, 2)
        else:
            loaded[name], loaded[name + "_scales"] = blocks, scales
    return loaded
