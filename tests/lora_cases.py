"""LoRA adapters for the demo checkpoint, written as PEFT's save_pretrained writes them, and the
checkpoint with an adapter merged into its weights (W + scaling·B·A, in the checkpoint's own
tensors: the reference kvd's unmerged adapter is held to)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvctl.daemon.model.demo import DEMO_CONFIG

GROUPS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def projection_shape(module: str, config: dict = DEMO_CONFIG) -> tuple[int, int]:
    hidden, inter, dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * dim, config["num_key_value_heads"] * dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}[module]


def lora_tensors(modules, rank: int = 4, seed: int = 1, std: float = 0.15, layers=None,
                 config: dict = DEMO_CONFIG) -> dict[str, torch.Tensor]:
    """Random A and B for `modules` of every layer (B is not zero: PEFT starts it at zero, which
    would make the adapter change nothing)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in (range(config["num_hidden_layers"]) if layers is None else layers):
        for module in modules:
            out_features, in_features = projection_shape(module, config)
            key = f"base_model.model.model.layers.{layer}.{GROUPS[module]}.{module}"
            tensors[key + ".lora_A.weight"] = torch.randn(rank, in_features, generator=g) * std
            tensors[key + ".lora_B.weight"] = torch.randn(out_features, rank, generator=g) * std
    return tensors


def write_adapter(directory: Path, modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"),
                  rank: int = 4, alpha: float = 8.0, seed: int = 1, tensors=None, model_config: dict = DEMO_CONFIG,
                  **config) -> Path:
    """A PEFT LoRA adapter folder: adapter_config.json and adapter_model.safetensors, for a model of
    `model_config` (the demo's); `config`: more adapter_config.json fields."""
    directory.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
                "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
                "fan_in_fan_out": False, "modules_to_save": None, "task_type": "CAUSAL_LM",
                "base_model_name_or_path": "kvd-demo-llama-v1", **config}
    (directory / "adapter_config.json").write_text(json.dumps(settings, indent=2))
    save_file(lora_tensors(modules, rank, seed, config=model_config) if tensors is None else tensors,
              str(directory / "adapter_model.safetensors"))
    return directory


def merged_checkpoint(base: Path, adapter: Path, target: Path) -> Path:
    """`base` with `adapter` folded into its weights, as a checkpoint of its own."""
    shutil.copytree(base, target)
    settings = json.loads((adapter / "adapter_config.json").read_text())
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    weights = load_file(str(target / "model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        rank = a.shape[0]
        scaling = settings["lora_alpha"] / (rank ** 0.5 if settings.get("use_rslora") else rank)
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[name] = weights[name] + scaling * (b.double() @ a.double()).float()
    save_file(weights, str(target / "model.safetensors"))
    return target
