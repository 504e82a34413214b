"""LoRA adapters in PEFT's on-disk format, served beside the base model.

An adapter folder holds `adapter_config.json` and `adapter_model.safetensors` (what PEFT's
`save_pretrained` writes). Each adapted projection W gains `scaling · B·A`: kvd never merges it
into W, so one batch mixes requests for the base model and for any number of adapters
(`LlamaModel.forward` adds each adapter's term to its own rows, `lora_delta`).

The adapter's weights are packed like the base model's (daemon/model/llama.py `pack_layers`):
the A matrices of q, k and v stacked into one, their B matrices into one block-diagonal matrix,
so a step makes two small GEMMs per packed projection and adapter, whichever projections the
adapter trains. The scaling is folded into B. A model whose checkpoint fuses them (Phi-3's
`qkv_proj` and `gate_up_proj`) is adapted as PEFT adapts it: one A and one B for each fused
projection, which is already the packed form.

An adapter's identity in the prefix cache (daemon/cache/keys.py `Namespace.adapter_id`) is the
SHA-256 of its two files: K/V computed under one adapter never serves another, nor the base model,
and a folder whose weights change is another adapter, whatever its name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .config import ModelConfig
from .errors import ModelError
from .weights import file_digest, text_model_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# the projections kvd adapts, in the order the packed weights hold them
ATTENTION = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")
PACKED = {"qkv": ("self_attn", ATTENTION), "o": ("self_attn", ("o_proj",)),
          "gate_up": ("mlp", MLP), "down": ("mlp", ("down_proj",))}
# a checkpoint with fused projections (ModelConfig.fused_projections: Phi-3)
PACKED_FUSED = {"qkv": ("self_attn", ("qkv_proj",)), "o": ("self_attn", ("o_proj",)),
                "gate_up": ("mlp", ("gate_up_proj",)), "down": ("mlp", ("down_proj",))}
GROUP_OF = {module: group for table in (PACKED, PACKED_FUSED)
            for group, modules in table.values() for module in modules}  # q_proj -> self_attn
# a tensor of a MoE layer's MLP: its experts (PEFT's `target_parameters`, or one expert's projection), its
# shared expert, or its router (`gate`; gpt-oss's `router`)
EXPERTS_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(?:experts|shared_expert|gate|router)\b")
KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight")
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}")
PEFT_PREFIX = "base_model.model."
# a multimodal model's parts kvd does not run (it serves text in, text out): their adapters change nothing served
UNSERVED_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def adapted_name(key: str) -> str | None:
    """An adapter tensor's name as KEY reads it: a multimodal checkpoint's language model under
    the text model's names (daemon/model/weights.py `text_model_name`); None for a part of the
    model kvd does not run (a vision tower)."""
    if not key.startswith(PEFT_PREFIX):
        return key
    inner = key[len(PEFT_PREFIX):]
    if inner.startswith(UNSERVED_PARTS):
        return None
    return PEFT_PREFIX + text_model_name(inner)


class NoRoomForAdapter(ModelError):
    """A LoRA adapter's weights do not fit on the model's device beside what serving needs."""


@dataclass
class PackedLora:
    """One packed projection's LoRA term: delta(x) = (x @ a.T) @ b.T, the scaling in b."""

    a: torch.Tensor  # [ranks, in]
    b: torch.Tensor  # [out, ranks]


@dataclass
class LoraAdapter:
    name: str  # what a request's `model` field says to use it
    path: Path
    digest: str  # SHA-256 over its config and weights: its identity in the prefix cache
    rank: int  # the largest rank of its projections
    alpha: float
    modules: tuple[str, ...]  # the projections it adapts, e.g. ("q_proj", "v_proj")
    layers: list[dict[str, PackedLora]] = field(repr=False)  # per layer: packed projection -> its term
    stamp: tuple = field(default=(), repr=False, compare=False)  # its files as read (source_stamp)
    nbytes: int = field(default=0, compare=False)  # what its packed weights take on the model's device
    # while kvd sleeps (daemon/server/sleep_ops.py): the device its weights left for host memory
    offloaded_from: torch.device | None = field(default=None, repr=False, compare=False)

    def describe(self) -> dict:
        return {"name": self.name, "path": str(self.path), "digest": self.digest, "rank": self.rank,
                "alpha": self.alpha, "modules": list(self.modules), "bytes": self.nbytes}

    @property
    def device(self) -> torch.device:
        """Where its packed weights are now."""
        return next((p.a.device for layer in self.layers for p in layer.values()), torch.device("cpu"))

    def offload(self) -> int:
        """Move the packed weights to host memory while kvd sleeps, the originals let go (a copy
        even from the CPU, as from a GPU); returns the bytes they took on the device (0: in host
        memory already). Only with no request on the adapter: a step would find them on the host."""
        if self.offloaded_from is not None:
            return 0
        self.offloaded_from = self.device
        self.layers = _layers_to(self.layers, torch.device("cpu"), copy=True)
        return self.nbytes

    def restore(self) -> int:
        """Back to the device `offload` took them from; returns their bytes there (0: not offloaded)."""
        if self.offloaded_from is None:
            return 0
        self.layers = _layers_to(self.layers, self.offloaded_from)
        self.offloaded_from = None
        return self.nbytes


def _layers_to(layers: list[dict[str, PackedLora]], device: torch.device, copy: bool = False) -> list:
    """Per-layer packed terms, as `layers` holds them, on `device`."""
    return [{k: PackedLora(p.a.to(device, copy=copy), p.b.to(device, copy=copy)) for k, p in layer.items()}
            for layer in layers]


def adapter_digest(path: Path) -> str:
    """SHA-256 over the adapter's config and weights (each by its own SHA-256)."""
    digest = hashlib.sha256(b"kvctl/lora-adapter/v1\0")
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        digest.update(name.encode() + b"\0" + file_digest(path / name).encode())
    return digest.hexdigest()


def source_stamp(path: Path) -> tuple:
    """What moves when an adapter's files change: each file's inode, size, modification and
    change times (the change time moves at any write or rename, whatever a copy sets as the
    modification time). () when a file cannot be read."""
    stamp = []
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        try:
            st = (path / name).stat()
        except OSError:
            return ()
        stamp.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(stamp)


def check_adapter_name(name: str, base_name: str | None = None, field_name: str = "lora_modules") -> str:
    """`name` if it can name an adapter; ModelError, its message starting with `field_name`, if not."""
    if not ADAPTER_NAME.fullmatch(name or ""):
        raise ModelError(f"{field_name}: adapter name {name!r} must be 1-128 letters, digits or . _ / : - "
                         "(starting with a letter or digit)")
    if base_name is not None and name == base_name:
        raise ModelError(f"{field_name}: adapter name {name!r} is the base model's name; give the adapter "
                         "another")
    return name


def _read_config(path: Path) -> dict:
    source = path / ADAPTER_CONFIG
    if not source.is_file():
        raise ModelError(f"lora_modules: {str(path)!r} has no {ADAPTER_CONFIG} (a PEFT adapter folder, as "
                         "save_pretrained writes it)")
    try:
        config = json.loads(source.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelError(f"{source}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{source}: expected a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ModelError(f"{source}: peft_type {kind!r} is not LORA; kvd serves LoRA adapters only")
    for name, unsupported in (("use_dora", True), ("fan_in_fan_out", True)):
        if config.get(name) is unsupported:
            raise ModelError(f"{source}: {name} true is not supported")
    if config.get("bias", "none") != "none":
        raise ModelError(f"{source}: bias {config['bias']!r} is not supported (only none: the adapter "
                         "trains no bias)")
    if config.get("modules_to_save"):
        raise ModelError(f"{source}: modules_to_save {config['modules_to_save']!r} is not supported (the "
                         "adapter would replace whole modules of the base model)")
    config["lora_alpha"] = _number(source, "lora_alpha", config.get("lora_alpha", 8))  # PEFT's default
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise ModelError(f"{source}: alpha_pattern must be an object of module name to alpha, got {patterns!r}")
    config["alpha_pattern"] = {key: _number(source, f"alpha_pattern[{key!r}]", v) for key, v in patterns.items()}
    return config


def _number(source: Path, field_name: str, value) -> float:
    """`value` as a float; ModelError names the file and the field when it is no finite number."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ModelError(f"{source}: {field_name} must be a number, got {value!r}")
    return float(value)


def _alpha_for(config: dict, module: str) -> float:
    """A module's alpha: PEFT's alpha_pattern entry whose key ends its name, else lora_alpha (both
    checked numbers, `_read_config`)."""
    for key, value in config["alpha_pattern"].items():
        if module == key or module.endswith("." + key) or re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return config["lora_alpha"]


def load_adapter(name: str, path: str | Path, config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, room: Callable[[str, int], None] | None = None) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter for a model of `config`; a problem names the file and
    the tensor or field. `room(name, nbytes)`, given, is asked before the packed weights go to
    `device` (kvd serving: daemon/server/adapter_room.py) and raises ModelError where they do not
    fit beside what serving needs."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"lora_modules: {name}={str(path)!r} is not a directory")
    stamp = source_stamp(path)  # before the reads: a file written meanwhile is read again at the next reload
    settings = _read_config(path)
    weights_file = path / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        raise ModelError(f"lora_modules: {str(path)!r} has no {ADAPTER_WEIGHTS}")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    sizes = _projection_sizes(config)
    try:
        with safe_open(str(weights_file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                read_as = adapted_name(key)
                if read_as is None:
                    continue
                match = KEY.fullmatch(read_as)
                moe = EXPERTS_KEY.match(read_as)
                if moe is not None or (match is not None and match[2] == "mlp" and int(match[1]) in config.moe_layers):
                    layer = int((moe or match)[1])
                    raise ModelError(f"{weights_file}: tensor {key!r} adapts layer {layer}'s MLP, a mixture of experts; "
                                     "kvd adapts a MoE layer's attention only")
                if match is None:
                    raise ModelError(f"{weights_file}: tensor {key!r} is not a LoRA weight of a layer's q, k, v, "
                                     "o, gate, up or down projection; kvd adapts only those")
                layer, group, module, which = int(match[1]), match[2], match[3], match[4]
                if layer >= config.num_layers:
                    raise ModelError(f"{weights_file}: tensor {key!r} is for layer {layer}, and the model has "
                                     f"{config.num_layers}")
                if GROUP_OF.get(module) != group or module not in sizes:
                    raise ModelError(f"{weights_file}: tensor {key!r} adapts {group}.{module}, which kvd does not"
                                     + (" in this model (its checkpoint fuses Q, K and V, and gate and up)"
                                        if config.fused_projections and module in GROUP_OF else ""))
                pairs.setdefault((layer, module), {})[which] = handle.get_tensor(key)
    except ModelError:
        raise
    except Exception as exc:  # a torn or foreign file: safetensors' own error, named
        raise ModelError(f"{weights_file}: cannot be read as safetensors ({exc})") from None
    if not pairs:
        raise ModelError(f"{weights_file}: holds no LoRA weights")
    terms: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, module), found in sorted(pairs.items()):
        where = f"{weights_file}: layer {layer} {module}"
        if set(found) != {"A", "B"}:
            raise ModelError(f"{where} has lora_{next(iter(found))} without lora_{'B' if 'A' in found else 'A'}")
        a, b = found["A"], found["B"]
        out_features, in_features = sizes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
                or a.shape[0] != b.shape[1] or a.shape[0] < 1:
            raise ModelError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a "
                             f"[{out_features}, {in_features}] projection (expected A [r, {in_features}], "
                             f"B [{out_features}, r])")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ModelError(f"{where}: holds a value that is not finite")
        r = a.shape[0]
        alpha = _alpha_for(settings, f"model.layers.{layer}.{GROUP_OF[module]}.{module}")
        scaling = alpha / math.sqrt(r) if settings.get("use_rslora") else alpha / r
        terms[layer, module] = (a.float(), b.float() * scaling)
        rank = max(rank, r)
    table = packing(config)
    layers = [_pack(terms, layer, sizes, dtype, table) for layer in range(config.num_layers)]
    nbytes = sum(t.numel() * t.element_size() for layer in layers for p in layer.values() for t in (p.a, p.b))
    if room is not None:
        room(name, nbytes)
    if device.type != "cpu":
        try:
            layers = _layers_to(layers, device)
        except torch.OutOfMemoryError:  # what the room check saw was taken meanwhile: nothing of it stays
            raise NoRoomForAdapter(f"LoRA adapter {name!r} needs {nbytes:,} bytes on {device}, and the device ran "
                                   "out of memory copying it") from None
    modules = tuple(m for _, ms in table.values() for m in ms if any(k[1] == m for k in terms))
    return LoraAdapter(name, path, adapter_digest(path), rank, settings["lora_alpha"], modules, layers, stamp,
                       nbytes)


def packing(config: ModelConfig) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Packed projection -> (module group, the checkpoint's projections it holds) for `config`."""
    return PACKED_FUSED if config.fused_projections else PACKED


def _projection_sizes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) features of each projection kvd can adapt in `config`'s checkpoint."""
    hidden, dim = config.hidden_size, config.head_dim
    if config.fused_projections:
        return {"qkv_proj": ((config.num_heads + 2 * config.num_kv_heads) * dim, hidden),
                "o_proj": (hidden, config.num_heads * dim), "gate_up_proj": (2 * config.intermediate_size, hidden),
                "down_proj": (hidden, config.intermediate_size)}
    return {"q_proj": (config.num_heads * dim, hidden), "k_proj": (config.num_kv_heads * dim, hidden),
            "v_proj": (config.num_kv_heads * dim, hidden), "o_proj": (hidden, config.num_heads * dim),
            "gate_proj": (config.intermediate_size, hidden), "up_proj": (config.intermediate_size, hidden),
            "down_proj": (hidden, config.intermediate_size)}


def _pack(terms: dict, layer: int, sizes: dict, dtype: torch.dtype,
          table: dict[str, tuple[str, tuple[str, ...]]] = PACKED) -> dict[str, PackedLora]:
    """One layer's terms as the packed projections hold them (in host memory): A matrices
    stacked, B matrices block-diagonal (each projection's rows of the packed output see only its
    own ranks)."""
    packed = {}
    for name, (_, modules) in table.items():
        present = [(m, terms[layer, m]) for m in modules if (layer, m) in terms]
        if not present:
            continue
        ranks = sum(a.shape[0] for _, (a, _) in present)
        out_total = sum(sizes[m][0] for m in modules)
        b_packed = torch.zeros(out_total, ranks)
        row = col = 0
        for module in modules:
            if (layer, module) in terms:
                a, b = terms[layer, module]
                b_packed[row:row + b.shape[0], col:col + a.shape[0]] = b
                col += a.shape[0]
            row += sizes[module][0]
        a_packed = torch.cat([a for _, (a, _) in present])
        packed[name] = PackedLora(a_packed.to(dtype=dtype), b_packed.to(dtype=dtype))
    return packed


def lora_delta(out: torch.Tensor, x: torch.Tensor, groups, layer: int, projection: str) -> None:
    """Add each adapter's term for `projection` of `layer` to its rows of `out` (in place).

    `groups`: (adapter, rows) pairs, rows an int64 tensor of token rows, or None for every row."""
    for adapter, rows in groups:
        term = adapter.layers[layer].get(projection)
        if term is None:
            continue
        if rows is None:
            out += (x @ term.a.T) @ term.b.T
        else:
            out.index_add_(0, rows, (x.index_select(0, rows) @ term.a.T) @ term.b.T)


def load_adapters(modules: tuple[tuple[str, str], ...], loaded, base_name: str,
                  current: dict[str, LoraAdapter] | None = None,
                  room: Callable[[str, int], None] | None = None) -> dict[str, LoraAdapter]:
    """Every adapter of `lora_modules` ((name, folder) pairs) for `loaded`, by name, on its device
    and in its dtype; ModelError names the first that cannot be served. `current`: the adapters
    served now (a reload): one under the same name and folder whose files have not changed since
    it was read (`source_stamp`) is kept as it is, not read again. `room`: as load_adapter takes it."""
    adapters: dict[str, LoraAdapter] = {}
    model = loaded.model
    for name, path in modules:
        check_adapter_name(name, base_name)
        folder = Path(path).expanduser()
        kept = kept_adapter(current, name, folder)
        adapters[name] = kept or load_adapter(name, folder, loaded.config, model.device, model.dtype, room)
    return adapters


def kept_adapter(current: dict[str, LoraAdapter] | None, name: str, folder: Path) -> LoraAdapter | None:
    """The adapter `current` serves as `name` where a reload keeps it as it is, not read again:
    from the same folder, whose files have not changed since it was read (`source_stamp`)."""
    kept = (current or {}).get(name)
    if kept is not None and kept.path == folder and kept.stamp and kept.stamp == source_stamp(folder):
        return kept
    return None


def warn_if_kv_changes(adapters: dict[str, LoraAdapter], cache_dtype: str) -> None:
    """Log a warning when the cache is quantised and an adapter changes K or V: the cache's scales
    were calibrated on the base model alone."""
    if cache_dtype != "auto" and any({"k_proj", "v_proj", "qkv_proj"} & set(a.modules) for a in adapters.values()):
        logging.getLogger("kvd").warning(
            "lora_modules: an adapter changes K or V, and the %s cache's scales were calibrated on the base "
            "model: its K/V may fall outside them", cache_dtype)


def adapter_changes(before: dict[str, LoraAdapter], after: dict[str, LoraAdapter]) -> dict[str, list[str]]:
    """What serving `after` in place of `before` changes, by adapter name: added, removed, and
    replaced (other weights under the same name: its blocks cached so far serve it no more)."""
    return {"added": [name for name in after if name not in before],
            "removed": [name for name in before if name not in after],
            "replaced": [name for name in after if name in before and after[name].digest != before[name].digest]}
